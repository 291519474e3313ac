"""Tracing (agent side, in the agent's process): OpenTelemetry spans of a rollout, into a store.

- :mod:`~agl.tracing.provider`: the tracer provider, ``rollout_context``, the span processors that stamp
  and store spans, ``flush``/``stats``;
- :mod:`~agl.tracing.spanconv`: an OpenTelemetry span → agl's :class:`~agl.types.Span`;
- :mod:`~agl.tracing.emit`: ``emit_reward``/``emit_message``/``emit_object``/``emit_exception``;
- :mod:`~agl.tracing.prompts`: prompt templates an agent reads (``agl.prompt``) and their version spans.

The face keeps ``agl.tracing.setup_tracing``, ``agl.tracing.flush`` and the rest of the provider's names.
"""

from __future__ import annotations

from agl.tracing.provider import (
    RolloutSpanProcessor,
    StoreSpanExporter,
    StoreSpanProcessor,
    current_rollout,
    flush,
    get_tracer,
    get_tracer_provider,
    reset_tracing,
    rollout_context,
    setup_tracing,
    span_from_otel,
    stats,
)

__all__ = [
    "RolloutSpanProcessor",
    "StoreSpanExporter",
    "StoreSpanProcessor",
    "current_rollout",
    "flush",
    "get_tracer",
    "get_tracer_provider",
    "reset_tracing",
    "rollout_context",
    "setup_tracing",
    "span_from_otel",
    "stats",
]
