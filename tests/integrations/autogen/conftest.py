"""The AutoGen suite on agl.testing's fixtures: the scripted model plays the math app's agents."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("autogen_agentchat")
pytest.importorskip("autogen_ext.models.openai")

from autogen_math_app import policy, role_of  # noqa: E402


@pytest.fixture(scope="module")
def agl_policy() -> Callable[[Any], Any]:
    return lambda request: policy(request.messages)


@pytest.fixture(scope="module")
def agl_agent_of() -> Callable[[Any], str | None]:
    return lambda request: role_of(request.messages)


# The suite's names for agl.testing's fixtures.
@pytest.fixture(scope="module")
def scripted_model(agl_model: Any) -> Any:
    return agl_model


@pytest.fixture
def gateway(agl_gateway: Any) -> tuple[Any, Any]:
    return agl_gateway, agl_gateway.store


@pytest.fixture(scope="module")
def gateway_url(agl_gateway_url: Any) -> Any:
    return agl_gateway_url


@pytest.fixture
def clean_agl(agl_tracer: Any) -> None:
    """Nothing instrumented or set up for tracing is left for the next test (agl_tracer's teardown)."""


@pytest.fixture
def memory_spans(agl_tracer: Any) -> tuple[Any, Any]:
    return agl_tracer.provider, agl_tracer.exporter
