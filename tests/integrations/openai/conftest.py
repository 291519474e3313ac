"""Fixtures for the openai-client integration: a real local OpenAI-protocol server and a traced setup.

No openai import here: the test modules skip themselves when openai is not installed."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agl
from agl import semconv
from agl.store.memory import MemoryStore
from agl.tracing import provider as tracing
from agl.types import NewRollout

sys.path.insert(0, str(Path(__file__).parent))
from fake_openai_server import FakeOpenAI, serve  # noqa: E402


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeOpenAI, str]]:
    with serve() as running:
        yield running


@dataclass
class Traced:
    provider: TracerProvider
    exporter: InMemorySpanExporter
    store: MemoryStore
    fake: FakeOpenAI
    base_url: str

    def chat_spans(self) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name == semconv.SPAN_CHAT]

    def rollout(self, rollout_id: str) -> int:
        self.store.enqueue([NewRollout(id=rollout_id)])
        claim = self.store.claim("worker")
        assert claim is not None
        return claim.attempt.number


@pytest.fixture()
def traced(server) -> Iterator[Traced]:
    fake, base_url = server
    fake.requests.clear()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    store = MemoryStore()
    tracing.setup_tracing(store, provider)
    assert agl.instrument("openai", tracer_provider=provider) == ["openai"]
    try:
        yield Traced(provider, exporter, store, fake, base_url)
    finally:
        agl.uninstrument()
        tracing.reset_tracing()
        provider.shutdown()
        store.close()
