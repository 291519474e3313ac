"""Fixtures for the CrewAI integration tests: a real gateway with the scripted model.

No framework import at module level: without CrewAI (the ``core`` env) the test modules skip
themselves through ``pytest.importorskip`` and these fixtures are never used.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agl
from agl.gateway.testing import GatewayURL, ScriptedBackend, serve_gateway
from agl.store import open as open_store
from agl.tracing import reset_tracing


@dataclass
class Recorded:
    """What the scripted model was asked, per call: the backend's own record of the run."""

    rollout: tuple[str, int] | None
    agent: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    reply: Any
    stream: bool


@dataclass
class Model:
    backend: ScriptedBackend
    calls: list[Recorded] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, request: Any) -> Any:
        from crewai_research_app import agent_of, policy

        answer = policy(request)
        with self.lock:
            self.calls.append(
                Recorded(
                    request.rollout,
                    agent_of(request.messages),
                    request.messages,
                    request.tools,
                    answer,
                    bool(request.raw.get("stream")),
                )
            )
        return answer

    def of(self, rollout_id: str) -> list[Recorded]:
        return [c for c in self.calls if c.rollout is not None and c.rollout[0] == rollout_id]


@pytest.fixture(scope="session")
def scripted_model() -> Model:
    model = Model(backend=None)  # type: ignore[arg-type]
    model.backend = ScriptedBackend(model)
    return model


@pytest.fixture
def gateway(scripted_model: Model, tmp_path: Any) -> Iterator[tuple[GatewayURL, Any]]:
    """A real gateway on 127.0.0.1 writing its server spans into a fresh SQLite store."""
    store = open_store(f"sqlite:///{tmp_path / 'agl.db'}")
    scripted_model.calls.clear()
    with serve_gateway(scripted_model.backend, store) as url:
        yield url, store
    store.close()


@pytest.fixture(scope="session")
def gateway_url(scripted_model: Model) -> Iterator[GatewayURL]:
    """A real gateway on 127.0.0.1 that records no spans (for tests that keep spans in memory)."""
    with serve_gateway(scripted_model.backend) as url:
        yield url


@pytest.fixture
def clean_agl() -> Iterator[None]:
    """Leave no instrumentation or tracing setup behind for the next test."""
    yield
    agl.uninstrument("crewai", "openai")
    reset_tracing()


@pytest.fixture
def memory_spans(clean_agl: None) -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """A private tracer provider whose spans are kept in memory."""
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()
