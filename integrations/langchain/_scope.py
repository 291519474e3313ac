"""A span stand-in that makes a leaked OpenTelemetry context harmless.

LangChain runs callbacks where it happens to invoke them, and on the async path it runs the *end*
callbacks of chains and LLMs (``@shielded``) in a copy of the caller's context. A handler that
attaches an OTel context when a run starts therefore cannot always detach it when the run ends: the
attachment stays in the caller's context after the run is over. If that attachment held the run's
span itself, everything the caller does afterwards (an LLM judge, ``emit_reward``, the next graph
run) would nest under a finished agent span and be attributed to the wrong agent.

So the handler never attaches a span directly; it attaches a :class:`ScopeSpan`: while the run is
live it *is* the run's span (its span context, attributes, events all go there), and once the run
has ended it turns into whatever span was current before the run started. A leaked context then
means exactly what a correctly detached one would. Where the end callback does run in the starting
context the handler also restores the previous context for real, so ``get_current_span()`` returns
the caller's own span object again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanContext
from opentelemetry.trace.status import Status, StatusCode
from opentelemetry.util import types

__all__ = ["ScopeSpan", "current_span", "resolve"]


def resolve(span: Span) -> Span:
    """The span a (possibly ended) scope stands for right now: never a ScopeSpan."""
    while isinstance(span, ScopeSpan):
        span = span._target if span._live else span._fallback
    return span


class ScopeSpan(Span):
    """``target`` while its run is live, then ``fallback`` (the span current before the run)."""

    __slots__ = ("_target", "_fallback", "_live")

    def __init__(self, target: Span, fallback: Span) -> None:
        self._target = target
        # a dead scope stays dead: keep chains short by skipping over them right away
        while isinstance(fallback, ScopeSpan) and not fallback._live:
            fallback = fallback._fallback
        self._fallback = fallback
        self._live = True

    def close(self) -> None:
        """The run ended: from now on this scope means the span that was current before it."""
        self._live = False

    @property
    def live(self) -> bool:
        return self._live

    # -- trace.Span: every call goes to the span this scope stands for now -----------------------
    def get_span_context(self) -> SpanContext:
        return resolve(self).get_span_context()

    def is_recording(self) -> bool:
        return resolve(self).is_recording()

    def end(self, end_time: int | None = None) -> None:
        resolve(self).end(end_time)

    def set_attributes(self, attributes: Mapping[str, types.AttributeValue]) -> None:
        resolve(self).set_attributes(attributes)

    def set_attribute(self, key: str, value: types.AttributeValue) -> None:
        resolve(self).set_attribute(key, value)

    def add_event(self, name: str, attributes: types.Attributes = None, timestamp: int | None = None) -> None:
        resolve(self).add_event(name, attributes, timestamp)

    def add_link(self, context: SpanContext, attributes: types.Attributes = None) -> None:
        resolve(self).add_link(context, attributes)

    def update_name(self, name: str) -> None:
        resolve(self).update_name(name)

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        resolve(self).set_status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        resolve(self).record_exception(exception, attributes, timestamp, escaped)

    def __repr__(self) -> str:
        state = "live" if self._live else "ended"
        return f"ScopeSpan({state}, {resolve(self)!r})"


def current_span(ctx: Any = None) -> Span:
    """The span current in ``ctx`` (or now), with any scope resolved."""
    return resolve(trace.get_current_span(ctx))
