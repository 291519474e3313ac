"""Fixtures for the LangChain/LangGraph integration: agl's real gateway with a scripted policy, a SQLite
store, and a traced setup (openai + langchain instrumented on agl.testing's ``agl_tracer``).

No LangChain import here: the test modules skip themselves when LangGraph is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from lc_support import Gateway, RecordingBackend, Traced

from agl.gateway.testing import serve_gateway
from agl.store.sqlite import SQLiteStore
from agl.tracing import provider as tracing


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    store = SQLiteStore(str(tmp_path_factory.mktemp("lc") / "agl.db"))
    backend = RecordingBackend()
    with serve_gateway(backend, store) as base_url:
        yield Gateway(backend, base_url, store)
    store.close()


@pytest.fixture()
def traced(gateway: Gateway, agl_tracer: Any) -> Traced:
    """openai + langchain instrumented onto agl.testing's in-memory tracer, exporting to the store."""
    tracing.setup_tracing(gateway.store, agl_tracer.provider)
    assert agl_tracer.instrument("openai", "langchain") == ["openai", "langchain"]
    gateway.backend.policy = lambda request: "ok"
    return Traced(agl_tracer.provider, agl_tracer.exporter, gateway)
