"""The runner warns once when gateway LLM calls ran under no agent span in an attempt that used an agent
framework (constructed here: an agent that runs a LangChain tool, then calls the raw openai client
outside LangChain); a plain-client agent in the same LangChain-instrumented process gets no warning, and
the four framework scenarios assert it stays quiet."""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("langchain_core")
openai = pytest.importorskip("openai")

from agl.instrumentation.attribution import unattributed_calls  # noqa: E402
from agl.runner.runner import Runner  # noqa: E402
from agl.types import LLM, NewRollout, Resources  # noqa: E402

WARNING = "ran under no agent span"


def _raw_call(task: Any, resources: Resources) -> float:
    """A plain-client agent: its calls reach the gateway, and no framework is involved."""
    llm = resources.llm
    client = openai.OpenAI(base_url=llm.base_url, api_key="sk-agl-test", max_retries=0)
    client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "hi"}])
    return 1.0


def _langchain_then_raw(task: Any, resources: Resources) -> float:
    """An agent that uses LangChain (a tool) but makes its LLM call around it: no agent span covers it."""
    from langchain_core.tools import tool

    @tool
    def count_words(text: str) -> int:
        """Count the words of a text."""
        return len(text.split())

    count_words.invoke({"text": "one two"})
    return _raw_call(task, resources)


def _run(agl_gateway: Any, n: int, agent: Any = _langchain_then_raw) -> list[str]:
    store = agl_gateway.store
    version = store.add_resources({"main": LLM(base_url=str(agl_gateway), model="scripted")}).version
    ids = [r.id for r in store.enqueue([NewRollout(input={}, resources_version=version) for _ in range(n)])]
    stats = Runner(agent, store, claim_timeout_s=0.2).run(max_rollouts=n)
    assert stats.succeeded == n, stats.errors
    return ids


def test_warns_once_naming_the_cause(agl_gateway: Any, agl_tracer: Any, caplog: Any) -> None:
    agl_tracer.instrument("openai", "langchain")
    with caplog.at_level(logging.WARNING, "agl.runner"):
        ids = _run(agl_gateway, 3)
    warnings = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warnings) == 1, warnings  # once, not per rollout
    assert "the attempt used langchain" in warnings[0] and "agl doctor" in warnings[0]
    assert "do not go through the instrumented framework" in warnings[0]  # the likely cause
    spans = agl_gateway.store.query_spans(rollout_id=ids[0], attempt=1)
    assert unattributed_calls(spans) == (1, 1)


def test_names_the_missing_openai_integration(agl_gateway: Any, agl_tracer: Any, caplog: Any) -> None:
    agl_tracer.instrument("langchain")
    with caplog.at_level(logging.WARNING, "agl.runner"):
        _run(agl_gateway, 1)
    (warning,) = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert "'openai' integration is not instrumented" in warning


def test_quiet_without_an_agent_framework(agl_gateway: Any, agl_tracer: Any, caplog: Any) -> None:
    agl_tracer.instrument("openai")  # plain LLM calls are fine when no agent framework is in play
    with caplog.at_level(logging.WARNING, "agl.runner"):
        _run(agl_gateway, 2, _raw_call)
    assert WARNING not in caplog.text


def test_quiet_for_a_plain_agent_while_a_framework_is_instrumented(
    agl_gateway: Any, agl_tracer: Any, caplog: Any
) -> None:
    """The false alarm new users met: a framework being instrumented is no evidence the agent used it."""
    agl_tracer.instrument("openai", "langchain")
    with caplog.at_level(logging.WARNING, "agl.runner"):
        _run(agl_gateway, 2, _raw_call)
    assert WARNING not in caplog.text
