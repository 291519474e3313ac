"""Fixtures for the anthropic-client integration: a traced setup over a memory store."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agl
from agl.store.memory import MemoryStore
from agl.tracing import provider as tracing
from agl.types import NewRollout


@dataclass
class Traced:
    provider: TracerProvider
    exporter: InMemorySpanExporter
    store: MemoryStore

    def rollout(self, rollout_id: str) -> int:
        self.store.enqueue([NewRollout(id=rollout_id)])
        claim = self.store.claim("worker")
        assert claim is not None
        return claim.attempt.number


@pytest.fixture()
def traced() -> Iterator[Traced]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    store = MemoryStore()
    tracing.setup_tracing(store, provider)
    assert agl.instrument("anthropic", tracer_provider=provider) == ["anthropic"]
    try:
        yield Traced(provider, exporter, store)
    finally:
        agl.uninstrument()
        tracing.reset_tracing()
        provider.shutdown()
        store.close()
