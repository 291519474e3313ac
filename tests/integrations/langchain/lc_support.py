"""Helpers of the LangChain integration tests (imported by conftest and the test modules): the
recording scripted backend, span trees read from the store, and the traced setup."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agl
from agl import semconv as sc
from agl.gateway.backends.base import GenerationRequest, GenerationResult
from agl.gateway.testing import ScriptedBackend
from agl.store.sqlite import SQLiteStore
from agl.tracing import provider as tracing
from agl.types import NewRollout, Span

MODEL = "scripted"


def system_prompt(request: GenerationRequest) -> str:
    for message in request.messages or ():
        if message.get("role") == "system":
            return str(message.get("content") or "")
    return ""


class RecordingBackend(ScriptedBackend):
    """The scripted backend, keeping its own record of every call (request + the ids it produced), so
    tests can compare what the spans and transitions say with what the engine really did."""

    def __init__(self) -> None:
        self.policy: Callable[[GenerationRequest], Any] = lambda request: "ok"
        super().__init__(lambda request: self.policy(request), accept_any_model=True)
        self.record: list[tuple[GenerationRequest, GenerationResult]] = []
        self._record_lock = threading.Lock()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = await super().generate(request)
        with self._record_lock:
            self.record.append((request, result))
        return result


@dataclass
class Gateway:
    backend: RecordingBackend
    base_url: Any  # agl.gateway.testing.GatewayURL
    store: SQLiteStore


# --------------------------------------------------------------------------------------- span trees


@dataclass
class Tree:
    """The spans of one rollout attempt as a tree (from the store: what the adapter will see)."""

    spans: list[Span]
    by_id: dict[str, Span] = field(init=False)
    kids: dict[str | None, list[Span]] = field(init=False)

    def __post_init__(self) -> None:
        self.by_id = {s.span_id: s for s in self.spans}
        self.kids = {}
        for s in sorted(self.spans, key=lambda s: (s.start_ns, s.seq or 0)):
            parent = s.parent_id if s.parent_id in self.by_id else None
            self.kids.setdefault(parent, []).append(s)

    def named(self, name: str) -> list[Span]:
        return sorted((s for s in self.spans if s.name == name), key=lambda s: s.start_ns)

    def agents(self, agent: str | None = None) -> list[Span]:
        return [
            s
            for s in self.named(sc.SPAN_INVOKE_AGENT)
            if agent is None or s.attributes.get(sc.GEN_AI_AGENT_NAME) == agent
        ]

    def tools(self) -> list[Span]:
        return self.named(sc.SPAN_EXECUTE_TOOL)

    def children(self, span: Span | None, name: str | None = None) -> list[Span]:
        kids = self.kids.get(None if span is None else span.span_id, [])
        return [k for k in kids if name is None or k.name == name]

    def parent(self, span: Span) -> Span | None:
        return self.by_id.get(span.parent_id) if span.parent_id else None

    def agent_of(self, span: Span) -> str | None:
        """Name of the nearest invoke_agent ancestor (the adapter's attribution rule)."""
        p = self.parent(span)
        while p is not None:
            if p.name == sc.SPAN_INVOKE_AGENT:
                return p.attributes.get(sc.GEN_AI_AGENT_NAME)
            p = self.parent(p)
        return None

    def client_chats(self) -> list[Span]:
        return [s for s in self.named(sc.SPAN_CHAT) if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_CLIENT]

    def server_chats(self) -> list[Span]:
        return [s for s in self.named(sc.SPAN_CHAT) if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER]

    def shape(self, span: Span | None = None, depth: int = 0) -> list[str]:
        """A readable outline (for assertion messages)."""
        out = []
        for k in self.children(span):
            label = k.attributes.get(sc.GEN_AI_AGENT_NAME) or k.attributes.get(sc.GEN_AI_TOOL_NAME) or ""
            side = k.attributes.get(sc.AGL_SIDE, "")
            out.append(f"{'  ' * depth}{k.name} {label} {side} {k.status.code}".rstrip())
            out.extend(self.shape(k, depth + 1))
        return out


@dataclass
class Traced:
    provider: TracerProvider
    exporter: InMemorySpanExporter
    gateway: Gateway
    counter: int = 0

    @property
    def store(self) -> SQLiteStore:
        return self.gateway.store

    @property
    def backend(self) -> RecordingBackend:
        return self.gateway.backend

    def new_rollout(self) -> tuple[str, int]:
        self.counter += 1
        rollout = self.store.enqueue([NewRollout()])[0]
        claim = self.store.claim(f"w{self.counter}")
        assert claim is not None and claim.rollout.id == rollout.id
        return rollout.id, claim.attempt.number

    @contextmanager
    def rollout(self) -> Iterator[dict[str, Any]]:
        """Run the body inside a fresh rollout; afterwards ``out["tree"]`` is its span tree."""
        rollout_id, attempt = self.new_rollout()
        out: dict[str, Any] = {"rollout_id": rollout_id, "attempt": attempt}
        self.backend.record.clear()
        with agl.rollout_context(rollout_id, attempt):
            yield out
        assert tracing.flush(10)
        out["spans"] = self.store.query_spans(rollout_id=rollout_id, attempt=attempt)
        out["tree"] = Tree(out["spans"])
        out["record"] = list(self.backend.record)
