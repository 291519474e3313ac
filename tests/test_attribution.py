"""unattributed_calls: which gateway LLM calls of an attempt have no agent span above them."""

from __future__ import annotations

from agl import semconv as sc
from agl.instrumentation.attribution import unattributed_calls
from agl.types import Span


def _span(sid: str, name: str, parent: str | None = None, **attrs: object) -> Span:
    return Span(
        trace_id="a" * 32,
        span_id=sid * 16,
        parent_id=parent * 16 if parent else None,
        name=name,
        start_ns=1,
        end_ns=2,
        attributes=dict(attrs),
        rollout_id="r",
        attempt=1,
    )


def test_counts_server_chat_spans_without_an_agent_ancestor() -> None:
    server = {sc.AGL_SIDE: sc.SIDE_SERVER}
    spans = [
        _span("1", sc.SPAN_ROLLOUT),
        _span("2", sc.SPAN_INVOKE_AGENT, "1", **{sc.GEN_AI_AGENT_NAME: "writer"}),
        _span("3", sc.SPAN_CHAT, "2", **{sc.AGL_SIDE: sc.SIDE_CLIENT}),
        _span("4", sc.SPAN_CHAT, "3", **server),  # under writer: attributed
        _span("5", sc.SPAN_CHAT, "1", **{sc.AGL_SIDE: sc.SIDE_CLIENT}),
        _span("6", sc.SPAN_CHAT, "5", **server),  # under the rollout only
        _span("7", sc.SPAN_CHAT, "f", **server),  # parent not stored (no traceparent link)
        _span("8", sc.SPAN_CHAT, "2", **{sc.AGL_SIDE: sc.SIDE_CLIENT}),  # client only: not a gateway call
    ]
    assert unattributed_calls(spans) == (2, 3)
    assert unattributed_calls([s for s in spans if s.span_id[0] in "1234"]) == (0, 1)
    assert unattributed_calls([]) == (0, 0)
