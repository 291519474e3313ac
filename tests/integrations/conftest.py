"""What the framework suites share: their names for agl.testing's fixtures (the plugin does the work).

Each suite's own conftest.py overrides ``agl_policy``/``agl_agent_of`` to script the model as its app's
agents; the langchain and openai suites define ``gateway``/``traced`` of their own shape.
"""

from __future__ import annotations

from typing import Any

import pytest


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
