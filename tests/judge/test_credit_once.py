"""Credit is computed by one function (agl.adapter.credit): the returns the adapter puts on the
transitions, the ones LightningRL recomputes, and the ones the trainer's reward assembly gives a
judge-rescored rollout are the same rule's values, checked against hand-computed numbers.

Real pieces: agl's gateway over a scripted backend, the openai client instrumented by agl, spans in a
real store; the judge a scripted backend behind its own gateway (judge_helpers.scores_from_answers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from judge_helpers import scores_from_answers

import agl
from agl import semconv as sc
from agl.adapter import Adapter, credit
from agl.adapter import adapter as adapter_module
from agl.algorithms import lightning_rl
from agl.errors import UsageError
from agl.gateway.testing import ScriptedBackend, reply, serve_gateway, tool_call
from agl.store.memory import MemoryStore
from agl.tracing import provider as tracing
from agl.tracing.emit import emit_reward
from agl.trainer.rewarding import RewardAssembly
from agl.types import NewRollout

openai = pytest.importorskip("openai")

#: each rollout: a tool call whose tool fails (AIR's tool_error, -0.1 on that call), then an answer
FINALS = {"ro-3": 1.0, "ro-8": 0.5}


def _rollouts(store: MemoryStore) -> list[Any]:
    """Two rollouts of one group, run one after the other through the gateway, each reporting its
    final reward; their answers say ``answer 3`` and ``answer 8`` (what the judge scores)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Status, StatusCode

    store.enqueue([NewRollout(id=rid, group_id="g", input={"q": "1/0?"}) for rid in FINALS])
    provider = TracerProvider()
    tracing.setup_tracing(store, provider)
    agl.instrument("openai", tracer_provider=provider)

    def script(request: Any) -> Any:  # per rollout: first the tool call, then its answer
        rid = request.rollout[0]
        if request.messages[-1]["role"] == "user":
            return reply(None, tool_call("div", a=1, b=0, id=f"call_{rid}"))
        return reply(f"answer {rid[-1]}")

    try:
        with serve_gateway(ScriptedBackend(script), store) as gw:
            tracer = provider.get_tracer("test")
            for rid, final in FINALS.items():
                claim = store.claim("w")
                assert claim.rollout.id == rid
                n = claim.attempt.number
                client = openai.OpenAI(base_url=gw.for_rollout(rid, n), api_key="x")
                with tracing.rollout_context(rid, n):
                    msgs: list[dict[str, Any]] = [{"role": "user", "content": "1/0?"}]
                    first = client.chat.completions.create(model="scripted", messages=msgs)
                    call = first.choices[0].message.tool_calls[0]
                    attrs = {
                        sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL,
                        sc.GEN_AI_TOOL_NAME: "div",
                        sc.GEN_AI_TOOL_CALL_ID: call.id,
                    }
                    with tracer.start_as_current_span(sc.SPAN_EXECUTE_TOOL, attributes=attrs) as tool:
                        tool.set_status(Status(StatusCode.ERROR, "ZeroDivisionError"))
                    msgs += [first.choices[0].message.model_dump(exclude_none=True)]
                    msgs += [{"role": "tool", "tool_call_id": call.id, "content": "error: division by zero"}]
                    client.chat.completions.create(model="scripted", messages=msgs)
                    emit_reward(final)
                assert tracing.flush(10)
                store.finish_attempt(rid, n, "succeeded")
    finally:
        agl.uninstrument()
        tracing.reset_tracing()
        provider.shutdown()
    return store.query_rollouts(ids=list(FINALS))


def _discounted(final: float) -> list[float]:
    """By hand, gamma 0.5, intermediate rewards (-0.1, 0): G_2 = 0 + 0.5 R, G_1 = -0.1 + 0.5 G_2."""
    g2 = 0.5 * final
    return [-0.1 + 0.5 * g2, g2]


def test_the_adapter_lightning_rl_and_the_judge_rescoring_credit_with_one_function(tmp_path: Path) -> None:
    # one implementation: every user holds the very function of agl.adapter.credit
    assert adapter_module.credit_returns is credit.credit_returns
    assert lightning_rl.credit_returns is credit.credit_returns
    assert lightning_rl.credit_transitions is credit.credit_transitions
    cfg = agl.LightningRL(credit="discounted", gamma=0.5, group_size=2)
    store = MemoryStore()
    try:
        rollouts = _rollouts(store)
        adapter = Adapter(algorithm=cfg)
        ts = adapter.from_store(store, rollouts)
        by_rollout = {rid: [t for t in ts if t.rollout_id == rid] for rid in FINALS}
        # the adapter: the credited return of each call, the hand values
        for rid, final in FINALS.items():
            got = by_rollout[rid]
            assert [t.intermediate_reward for t in got] == pytest.approx([-0.1, 0.0])
            assert [t.final_reward for t in got] == [final, final]
            assert [t.reward for t in got] == pytest.approx(_discounted(final))
        # LightningRL: crediting again from final/intermediate rewards gives the adapter's returns, so
        # advantages from the adapter's returns equal the recomputed ones
        assert [t.reward for t in cfg.assign_credit(ts)] == pytest.approx([t.reward for t in ts])
        adv_once, _ = cfg.compute_advantages(ts)
        adv_again, _ = lightning_rl.compute_advantages(ts, cfg, include_intermediate=True)
        assert adv_once == pytest.approx(adv_again) and any(adv_once)
        # the judge's rescoring: the new final reward (the judge's score) credited by the same rule
        judge = agl.Judge(backend=ScriptedBackend(scores_from_answers, accept_any_model=True), model="j")
        assembly = RewardAssembly(judge=judge, reward="judge", monitors=False)
        assembly.open(tmp_path, adapter)
        try:
            rewards = {rid: final for rid, final in FINALS.items()}
            new_ts, new_rewards, _ = assembly.assemble(store, list(FINALS), by_rollout, rewards)
        finally:
            assembly.close()
        assert new_rewards == pytest.approx({"ro-3": 0.3, "ro-8": 0.8})
        for rid, score in new_rewards.items():
            assert [t.reward for t in new_ts[rid]] == pytest.approx(_discounted(score))
            again = cfg.assign_credit(new_ts[rid])
            assert [t.reward for t in again] == pytest.approx([t.reward for t in new_ts[rid]])
    finally:
        store.close()


def test_the_credit_rule_is_checked_in_one_place() -> None:
    for bad in (
        lambda: agl.LightningRL(credit="greedy"),
        lambda: credit.credit_returns(1.0, [0.0], "greedy"),
    ):
        with pytest.raises(UsageError, match="must be one of identical, discounted, got 'greedy'"):
            bad()
    assert credit.CREDITS == ("identical", "discounted")
