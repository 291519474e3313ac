"""The Agents SDK suite on agl.testing's fixtures: the scripted model plays the RAG app's agents.

No framework import at module level: without the SDK (the ``core`` env) the test modules skip
themselves through ``pytest.importorskip`` and these fixtures are never used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def agl_policy() -> Callable[[Any], Any]:
    from openai_agents_rag_app import policy

    return lambda request: policy(request.messages)


@pytest.fixture(scope="module")
def agl_agent_of() -> Callable[[Any], str | None]:
    from openai_agents_rag_app import agent_of

    return lambda request: agent_of(request.messages)


@pytest.fixture(scope="session", autouse=True)
def user_processor() -> Iterator[Any]:
    """For the whole session the SDK's processors are [UserProcessor]: nothing tries to upload."""
    from agents.tracing import get_trace_provider, set_trace_processors
    from openai_agents_rag_app import UserProcessor

    provider = get_trace_provider()
    original = tuple(provider._multi_processor._processors)
    processor = UserProcessor()
    set_trace_processors([processor])
    yield processor
    set_trace_processors(list(original))


@pytest.fixture
def replace_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never let the SDK's own exporter try to upload traces to OpenAI."""
    monkeypatch.setenv("AGL_OPENAI_AGENTS_REPLACE_EXPORTER", "1")


# The Agents SDK suite also keeps the SDK's uploader away in clean_agl/memory_spans.
@pytest.fixture
def clean_agl(replace_exporter: None, agl_tracer: Any) -> None:
    """Nothing instrumented or set up for tracing is left for the next test (agl_tracer's teardown)."""


@pytest.fixture
def memory_spans(clean_agl: None, agl_tracer: Any) -> tuple[Any, Any]:
    return agl_tracer.provider, agl_tracer.exporter
