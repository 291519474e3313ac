"""AIR configuration and the ``agl_intermediate_reward`` plugin hook (real pluggy plugins)."""

from __future__ import annotations

import math

import pytest

from agl import semconv as sc
from agl.plugins import get_plugin_manager, hookimpl
from agl.rewards import AIR, RULES, plugin_rewards
from agl.types import Span, SpanStatus


def span(i: int, name: str = "x", status: str = "UNSET", **attrs) -> Span:
    return Span(
        trace_id="ab" * 16,
        span_id=f"{i + 1:016x}",
        name=name,
        start_ns=i,
        end_ns=i + 1,
        status=SpanStatus(code=status),
        attributes=attrs,
        rollout_id="ro-1",
        attempt=1,
    )


def test_default_weights_and_switches() -> None:
    air = AIR()
    assert air.weight("tool_error") == -0.1 and air.weight("exception") == -0.1
    assert air.weight("tool_success") == 0.0 and air.weight("malformed_tool_call") == -0.1
    assert set(RULES) == {"tool_error", "tool_success", "exception", "malformed_tool_call"}
    assert AIR(tool_error=None).weight("tool_error") == 0.0
    assert AIR(tool_error=-1).weight("tool_error") == -1.0
    off = AIR.off()
    assert not off.enabled and all(off.weight(r) == 0.0 for r in RULES)


@pytest.mark.parametrize(
    "kw", [{"tool_error": math.nan}, {"exception": "high"}, {"tool_success": True}, {"enabled": 1}]
)
def test_bad_weights_are_refused(kw) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        AIR(**kw)


class ErrorsCost:
    @hookimpl
    def agl_intermediate_reward(self, span, spans):
        return -1.0 if span.status.code == "ERROR" else None


class SecondRule:
    @hookimpl
    def agl_intermediate_reward(self, span, spans):
        if span.name == "bad":
            return math.inf  # not finite: ignored and reported
        return 0.5 if span.name == sc.SPAN_EXECUTE_TOOL else None


@pytest.fixture()
def plugins():
    pm = get_plugin_manager()
    registered = [ErrorsCost(), SecondRule()]
    for p in registered:
        pm.register(p)
    try:
        yield
    finally:
        for p in registered:
            pm.unregister(p)


def test_no_plugins_means_no_plugin_rewards() -> None:
    assert plugin_rewards([span(0, status="ERROR")]) == []


def test_plugin_results_are_summed_per_span(plugins) -> None:
    spans = [span(0), span(1, sc.SPAN_EXECUTE_TOOL, "ERROR"), span(2, status="ERROR"), span(3, "bad")]
    errors: list[str] = []
    assert plugin_rewards(spans, errors=errors) == [(1, -0.5), (2, -1.0)]
    assert len(errors) == 1 and "inf" in errors[0]
