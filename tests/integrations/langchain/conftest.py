"""Fixtures for the LangChain/LangGraph integration: agl's real gateway with a scripted policy, a SQLite
store, and a traced setup (openai + langchain instrumented on a private tracer provider).

No LangChain import here: the test modules skip themselves when LangGraph is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lc_support import Gateway, RecordingBackend, Traced
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agl
from agl import tracing
from agl.gateway.testing import serve_gateway
from agl.store.sqlite import SQLiteStore


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    store = SQLiteStore(str(tmp_path_factory.mktemp("lc") / "agl.db"))
    backend = RecordingBackend()
    with serve_gateway(backend, store) as base_url:
        yield Gateway(backend, base_url, store)
    store.close()


@pytest.fixture()
def traced(gateway: Gateway) -> Iterator[Traced]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.setup_tracing(gateway.store, provider)
    assert agl.instrument("openai", "langchain", tracer_provider=provider) == ["openai", "langchain"]
    gateway.backend.policy = lambda request: "ok"
    try:
        yield Traced(provider, exporter, gateway)
    finally:
        agl.uninstrument("langchain", "openai")
        tracing.reset_tracing()
        provider.shutdown()
