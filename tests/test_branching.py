"""Branching at an agent's call in Trainer.fit (issue 56): a repair agent that acts in only some rollouts
of a group gets K continuations at its call, replayed up to it through the gateway, and trains on them;
a rollout function that does not declare the replay contract is never branched. Tiny random model, an
adapter per agent, the embedded engine."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest

from agl import semconv as sc
from agl.errors import UsageError

K = 4


def parity(text: str) -> int:
    return zlib.crc32(text.encode()) % 2


def make_app(replayable: bool) -> Any:
    """Deterministic given the replies: the writer's reply decides whether the rewriter acts, and the
    rewriter's reply decides the reward."""
    import openai

    import agl

    def app(task: dict, resources: agl.Resources) -> float:
        llm = resources.llm
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "x", max_retries=0)
        ask = [{"role": "user", "content": task["q"]}]
        with agl.agent("writer"):
            w = client.chat.completions.create(model=llm.model, messages=ask, max_tokens=4)
        text = w.choices[0].message.content or ""
        if parity(text) == 0:
            return 0.0  # the writer's query "ran": the rewriter does not act, nothing to learn
        fix = [
            *ask,
            {"role": "assistant", "content": text},
            {"role": "user", "content": "that failed; fix it"},
        ]
        with agl.agent("rewriter"):
            r = client.chat.completions.create(model=llm.model, messages=fix, max_tokens=4)
        return float(parity(r.choices[0].message.content or ""))

    return agl.rollout(app, replayable=True) if replayable else app


def fit(tmp_path: Path, replayable: bool) -> Any:
    pytest.importorskip("torch")
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    import agl
    from agl import LightningRL
    from agl.trainer.trainer import load_tokenizer
    from tests.test_adapter_per_agent import AGENTS, tiny_model

    trainer = agl.Trainer(
        LightningRL(group_size=4, lora_r=4, lora_alpha=8, learning_rate=1e-2, mixed_precision="no",
                    agent_baseline="group"),
        model=tiny_model(),
        agents=AGENTS,
        serving=agl.Serving(
            tokenizer=load_tokenizer(), runners=4, run_dir=tmp_path / "run", progress=False, store="memory://"
        ),
        loop=agl.LoopConfig(adapter_per_agent=True, branches=K, steps=1, tasks_per_step=3, val_before=False),
        config=agl.RunConfig(temperature=1.0),
    )  # fmt: skip
    agl.instrument("openai")
    try:
        trainer.fit(make_app(replayable), [{"q": "rescuable"}, {"q": "lost"}, {"q": "third"}])
    finally:
        agl.uninstrument()
    return trainer


def test_a_repair_agent_acting_sometimes_gets_k_branches_and_trains(tmp_path: Path) -> None:
    trainer = fit(tmp_path, replayable=True)
    (rec,) = trainer.history
    store = trainer.store
    branches = [r for r in store.query_rollouts() if r.metadata.get(sc.ROLLOUT_BRANCH_KEY)]
    assert rec["branch_points"] >= 1 and rec["branch_rollouts"] == K * rec["branch_points"]
    assert rec["branch_points/rewriter"] == rec["branch_points"], "only the agent that acts sometimes"
    assert len(branches) == rec["branch_rollouts"] and rec["branch_failed"] == 0
    by_group: dict[str, list[Any]] = {}
    for r in branches:
        by_group.setdefault(r.group_id, []).append(r)
    for group in by_group.values():
        assert len(group) == K
        link = group[0].metadata[sc.ROLLOUT_BRANCH_KEY]
        parent = store.get_rollout(link["parent"])
        assert link["agent"] == "rewriter" and parent.status == "succeeded"
        assert group[0].group_id.startswith(parent.group_id)
        prompts, replies = set(), set()
        for r in group:
            (point,) = [
                s for s in store.query_spans(rollout_id=r.id) if s.attributes.get(sc.AGL_LLM_BRANCH_POINT)
            ]
            assert point.attributes[sc.AGL_LLM_CALL_INDEX] == link["call"]
            prompts.add(tuple(point.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS]))
            replies.add(tuple(point.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]))
        assert len(prompts) == 1, "every branch asks the agent the same prompt, token for token"
        assert len(replies) == K, "each branch samples its own continuation"
    # the branch groups give the rewriter a group of K at one prompt: it trains under per-task groups,
    # where without branches an agent acting once per group trains nothing (tests/test_sometimes_agent.py)
    assert rec["branch_groups_with_spread"] >= 1
    from agl.algorithms.lightning_rl import LightningRL
    from agl.trainer.branching import without_replayed

    trained = 0
    for group in by_group.values():
        ts = [t for r in group for t in without_replayed(store, r, trainer.adapter.from_store(store, [r]))]
        assert {t.agent for t in ts} == {"rewriter"} and len(ts) == K, "one group of K at the branch call"
        adv, stats = LightningRL(agent_baseline="group").compute_advantages(ts, per_agent=True)
        if len({t.final_reward for t in ts}) > 1:
            assert stats["groups"] == 1 and all(a != 0.0 for a in adv), "every branch gets an advantage"
            trained += 1
    assert trained == rec["branch_groups_with_spread"]
    assert rec["trained_transitions/rewriter"] >= K and rec["grad_norm/rewriter"] > 0.0
    assert rec["branch_transitions"] >= rec["branch_rollouts"], "the replayed writer calls are left out"


def test_a_function_without_the_replay_contract_is_never_branched(tmp_path: Path) -> None:
    trainer = fit(tmp_path, replayable=False)
    (rec,) = trainer.history
    assert rec["branch_points"] == 0
    assert not [r for r in trainer.store.query_rollouts() if r.metadata.get(sc.ROLLOUT_BRANCH_KEY)]


def test_bad_branch_settings_are_usage_errors() -> None:
    from agl.config import LoopConfig

    for bad in (1, -2, True, 2.5):
        with pytest.raises(UsageError, match="branches must be 0"):
            LoopConfig(branches=bad)
    with pytest.raises(UsageError, match="synchronous loop only"):
        LoopConfig(branches=4, max_staleness=1)
    assert LoopConfig(branches=2).branches == 2


def test_a_branch_group_is_compared_within_itself_on_the_agents_own_outcome() -> None:
    """Per agent, K branches at the rewriter's call form one group normalised on its credited returns:
    no branch rescued the task (equal final rewards), but the rewrite that ran beats the copies AIR
    penalised again; the rewriter's other calls keep their rule, the writer its task groups."""
    from agl.algorithms.lightning_rl import LightningRL, compute_advantages
    from agl.types import Transition

    def tr(rid: str, agent: str, group: str, index: int, final: float, inter: float = 0.0) -> Transition:
        return Transition(rollout_id=rid, attempt=1, index=index, agent=agent, group_id=group,
                          prompt_ids=(1,), response_ids=(2,), final_reward=final, intermediate_reward=inter,
                          reward=final + inter)  # fmt: skip

    ts = [tr(f"a{i}", "writer", "q-s0", 0, float(i % 2)) for i in range(4)]
    ts.append(tr("a0", "rewriter", "q-s0", 1, 0.0, -0.1))
    branch = "q-s0" + sc.BRANCH_GROUP_MARK + "a0:1"
    ts += [tr(f"b{i}", "rewriter", branch, 1, 0.0, 0.0 if i == 0 else -0.1) for i in range(K)]
    adv, stats = compute_advantages(ts, LightningRL(group_size=4), per_agent=True, include_intermediate=None)
    branched = [a for t, a in zip(ts, adv, strict=True) if t.group_id == branch]
    assert branched[0] > 0.0 and all(a < 0.0 for a in branched[1:])
    # the rewriter's one call outside the branches has no spread and no history: its task group whole
    assert stats["agent_baselines"] == {"writer": "group", "rewriter": "task"}
    assert adv[4] < 0.0
    assert stats["incomplete_groups"] == 0, "a branch group of K is not an incomplete task group"
    # a shared policy: a GRPO group like any other, on final rewards at rollout level (all 0 here)
    shared, _ = compute_advantages(ts, LightningRL(group_size=4), include_intermediate=None)
    assert [a for t, a in zip(ts, shared, strict=True) if t.group_id == branch] == [0.0] * K
