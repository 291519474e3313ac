"""AIR configuration and the ``agl_intermediate_reward`` plugin hook (real pluggy plugins)."""

from __future__ import annotations

import math

import pytest

from agl import semconv as sc
from agl.adapter.air_rules import AIR, RULES, plugin_rewards
from agl.plugins import get_plugin_manager, hookimpl
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


# --------------------------------------------------------------------------- honest rewards (issue 17)


def test_caps_bound_bonuses_and_penalties_separately() -> None:
    air = AIR(cap=0.3)
    # bonuses 0.4 + 0.2 = 0.6 > 0.3: scaled by 1/2; the penalty -0.1 is under the cap and kept
    assert air.shape([0.4, -0.1, 0.2], final_reward=0.0) == pytest.approx([0.2, -0.1, 0.1])
    # penalties -0.5 - 0.5 = -1 > 0.3 in magnitude: scaled to -0.15 each
    assert air.shape([-0.5, -0.5], final_reward=1.0) == pytest.approx([-0.15, -0.15])
    assert AIR(cap=None).shape([2.0, -3.0], 0.0) == [2.0, -3.0]
    assert AIR(cap=0.25, reward_scale=4.0).shape([3.0], 0.0) == pytest.approx([1.0])
    assert AIR.off().shape([0.5], 1.0) == [0.0]


def test_gate_keeps_bonuses_only_on_successful_rollouts() -> None:
    gated = AIR(gate="success", cap=None)
    assert gated.shape([0.2, -0.1], final_reward=0.0) == [0.0, -0.1]  # penalties still say which call failed
    assert gated.shape([0.2, -0.1], final_reward=1.0) == [0.2, -0.1]
    partial = AIR(gate="success", success_at=0.5, cap=None)
    assert partial.shape([0.2], final_reward=0.6) == [0.2] and partial.shape([0.2], final_reward=0.4) == [0.0]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"cap": 1.0}, "cap"),
        ({"cap": -0.1}, "cap"),
        ({"gate": "always"}, "gate"),
        ({"reward_scale": 0}, "scale"),
    ],
)
def test_bad_guards_are_refused(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        AIR(**kw)


def test_an_air_only_policy_cannot_exceed_the_task_reward_ceiling() -> None:
    """Whatever the rule weights, a policy that farms AIR bonuses (many successful tool calls) without
    solving the task earns less return than a clean solve — with the default cap, and with the gate."""
    from agl.algorithms.lightning_rl import LightningRL, credit_returns

    farming = [0.9] * 20  # a generous tool_success bonus on every one of 20 calls, task reward 0
    solve = [0.0, 0.0]  # two clean calls, task reward 1 (the ceiling)
    for air in (AIR(tool_success=0.9), AIR(tool_success=0.9, gate="success")):
        for credit in ("identical", "discounted"):
            cfg = LightningRL(credit=credit)
            cheat = credit_returns(0.0, air.shape(farming, 0.0), cfg)
            honest = credit_returns(1.0, air.shape(solve, 1.0), cfg)
            assert max(cheat) < 1.0 <= min(honest), (air, credit, cheat)
            assert sum(air.shape(farming, 0.0)) <= air.cap + 1e-9
    # and avoiding every penalty is worth less than solving: a penalised solve still beats a clean failure
    air = AIR(tool_error=-0.4)
    penalised_solve = credit_returns(1.0, air.shape([-0.4] * 5, 1.0), LightningRL())
    assert min(penalised_solve) > 0.0


def test_reward_breakdown_splits_task_and_air() -> None:
    from agl.adapter.air_rules import reward_breakdown
    from agl.types import Transition

    def t(rid: str, i: int, final: float, inter: float) -> Transition:
        return Transition(
            rollout_id=rid, attempt=1, index=i, prompt_ids=(1,), response_ids=(2,),
            final_reward=final, intermediate_reward=inter, reward=final + inter,
        )  # fmt: skip

    b = reward_breakdown([t("a", 0, 1.0, -0.1), t("a", 1, 1.0, 0.0), t("b", 0, 0.0, 0.3)])
    assert b["task_reward"] == pytest.approx(0.5)
    assert b["air_reward"] == pytest.approx(0.1)
    assert b["air_bonus"] == pytest.approx(0.15) and b["air_penalty"] == pytest.approx(-0.05)
    assert b["air_share"] == pytest.approx(0.4 / 1.4)
    assert reward_breakdown([])["task_reward"] is None


def test_judge_gate_keeps_bonuses_only_on_rollouts_the_judge_passed() -> None:
    air = AIR(gate="judge", success_at=0.5)
    assert air.shape([0.2, -0.1], 0.0) == [0.2, -0.1]  # the adapter leaves a judge gate to the trainer
    assert air.gate_on([0.2, -0.1], 0.4) == [0.0, -0.1]  # failed verdict: bonus gone, penalty kept
    assert air.gate_on([0.2, -0.1], 0.5) == [0.2, -0.1]
