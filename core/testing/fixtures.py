"""The objects behind ``agl.testing``'s fixtures: a recording scripted model and an instrumented tracer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

__all__ = ["Call", "InstrumentedTracer", "RecordingModel"]


@dataclass
class Call:
    """One call the scripted model answered: the backend's own record, to compare spans against."""

    rollout: tuple[str, int] | None  # (rollout id, attempt) from the gateway URL or baggage
    agent: str | None  # what ``agent_of(request)`` said
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    reply: Any  # what the policy answered
    stream: bool
    request: Any = field(repr=False, default=None)


class RecordingModel:
    """A ``ScriptedBackend`` driven by ``policy(request)``, recording every call it answers.

    ``policy`` may be replaced between tests (``model.policy = ...``); ``calls`` is cleared by the
    ``agl_gateway`` fixture at the start of each test. Thread-safe.
    """

    def __init__(
        self,
        policy: Callable[[Any], Any],
        agent_of: Callable[[Any], str | None] | None = None,
        **backend_kwargs: Any,
    ) -> None:
        from agl.gateway.testing import ScriptedBackend

        self.policy = policy
        self.agent_of = agent_of
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self.backend = ScriptedBackend(self._answer, **backend_kwargs)

    def _answer(self, request: Any) -> Any:
        reply = self.policy(request)
        agent = self.agent_of(request) if self.agent_of is not None else None
        call = Call(
            request.rollout,
            agent,
            request.messages,
            request.tools,
            reply,
            bool((getattr(request, "raw", None) or {}).get("stream")),
            request,
        )
        with self._lock:
            self.calls.append(call)
        return reply

    def of(self, rollout_id: str) -> list[Call]:
        """The calls made for one rollout, in order."""
        with self._lock:
            return [c for c in self.calls if c.rollout is not None and c.rollout[0] == rollout_id]

    def clear(self) -> None:
        with self._lock:
            self.calls.clear()


class InstrumentedTracer:
    """A private tracer provider whose spans are kept in memory, plus instrumenting onto it.

    ``close()`` (the fixture calls it) uninstruments every integration, resets agl's tracing setup and
    shuts the provider down, so nothing leaks into the next test.
    """

    def __init__(self) -> None:
        self.provider = TracerProvider()
        self.exporter = InMemorySpanExporter()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def instrument(self, *names: str, **kwargs: Any) -> list[str]:
        """``agl.instrument(*names, tracer_provider=this provider, **kwargs)``."""
        import agl

        return agl.instrument(*names, tracer_provider=self.provider, **kwargs)

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        """Finished spans (named ``name``), in the order they ended."""
        spans = list(self.exporter.get_finished_spans())
        return spans if name is None else [s for s in spans if s.name == name]

    def close(self) -> None:
        import agl
        from agl.tracing.provider import reset_tracing

        try:
            agl.uninstrument()
        finally:
            reset_tracing()
            self.provider.shutdown()
