"""Credit for an agent that acts only sometimes (issue 56): with an adapter per agent, a repair agent
that runs in one rollout of a group has groups of one call and no spread by construction; under the
``"auto"`` baseline it is compared over all of its calls in the step, while an agent that acts every
time keeps its task groups, unchanged."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from agl.algorithms.lightning_rl import LightningRL, compute_advantages, prior_from_history
from agl.errors import UsageError
from agl.types import Transition


def tr(rid: str, agent: str, final: float, group: str, index: int, inter: float = 0.0) -> Transition:
    return Transition(
        rollout_id=rid,
        attempt=1,
        index=index,
        agent=agent,
        group_id=group,
        prompt_ids=(1,),
        response_ids=(2,),
        final_reward=final,
        intermediate_reward=inter,
        reward=final + inter,
    )


def rescue_step() -> list[Transition]:
    ts = []
    for g, finals, rescued in (("A", [1.0, 0.0, 1.0, 0.0], 1.0), ("B", [0.0, 1.0, 0.0, 1.0], 0.0)):
        for i, r in enumerate(finals):
            final = rescued if i == 3 else r
            ts.append(tr(f"{g}{i}", "writer", final, g, 0))
            if i == 3:  # the rewriter acts after the writer's failed query, in one rollout of four
                ts.append(tr(f"{g}{i}", "rewriter", final, g, 1))
    return ts


def test_auto_gives_a_sometimes_agent_the_step_baseline() -> None:
    ts = rescue_step()
    adv, stats = compute_advantages(ts, LightningRL(), per_agent=True)
    rewriter = [a for t, a in zip(ts, adv, strict=True) if t.agent == "rewriter"]
    assert stats["agent_baselines"] == {"writer": "group", "rewriter": "step"}
    assert rewriter[0] > 0.0 > rewriter[1], "the rescue is credited, the failed repair blamed"
    # the writer, acting every time, is normalised per task group exactly as before
    fixed, _ = compute_advantages(ts, LightningRL(agent_baseline="group"), per_agent=True)
    writer = [i for i, t in enumerate(ts) if t.agent == "writer"]
    assert [adv[i] for i in writer] == [fixed[i] for i in writer]
    # under per-task groups the rewriter has one call per group: nothing to learn from
    assert [a for t, a in zip(ts, fixed, strict=True) if t.agent == "rewriter"] == [0.0, 0.0]
    assert stats["incomplete_groups"] == 0, "a step-wide group is not an incomplete task group"


def test_step_baseline_uses_the_agents_own_outcome() -> None:
    """Equal final rewards, different intermediate rewards (AIR's penalty on the query the rewriter
    wrote that failed): the step baseline still separates the rewriter's calls."""
    ts = []
    for t in rescue_step():
        if t.rollout_id in ("A3", "B3"):  # neither repair rescued its rollout
            inter = -1.0 if t.agent == "rewriter" and t.group_id == "B" else 0.0
            t = t.model_copy(update={"final_reward": 0.0, "intermediate_reward": inter, "reward": inter})
        ts.append(t)
    adv, _ = compute_advantages(ts, LightningRL(), per_agent=True, include_intermediate=None)
    rewriter = [a for t, a in zip(ts, adv, strict=True) if t.agent == "rewriter"]
    assert rewriter[0] > 0.0 > rewriter[1]


def failed_repairs_step() -> list[Transition]:
    """Both of the step's repairs failed alike: the rewriter's calls have no spread in the step."""
    return [t.model_copy(update={"final_reward": 0.0, "reward": 0.0}) if t.rollout_id in ("A3", "B3") else t
            for t in rescue_step()]  # fmt: skip


def test_auto_falls_back_to_the_agents_last_steps_when_the_step_has_no_spread() -> None:
    ts = failed_repairs_step()
    alone, stats = compute_advantages(ts, LightningRL(agent_baseline="step"), per_agent=True)
    rewriter = [i for i, t in enumerate(ts) if t.agent == "rewriter"]
    assert [alone[i] for i in rewriter] == [0.0, 0.0] and stats["agent_baselines"]["rewriter"] == "step"
    assert stats["agent_returns"]["rewriter"] == (2, 0.0, 0.0)
    # its last steps rescued half of its repairs: two failures this step are below its own baseline
    adv, stats = compute_advantages(ts, LightningRL(), per_agent=True, prior={"rewriter": (0.5, 0.5)})
    assert stats["agent_baselines"]["rewriter"] == "running"
    assert [adv[i] for i in rewriter] == pytest.approx([-1.0, -1.0], rel=1e-5)
    # the writer, acting every time, keeps its task groups whatever the prior says
    writer = [i for i, t in enumerate(ts) if t.agent == "writer"]
    base, _ = compute_advantages(ts, LightningRL(), per_agent=True)
    assert [adv[i] for i in writer] == [base[i] for i in writer]
    # no fallback where the step has a spread, under an explicit rule, or with a prior of no spread
    spread, _ = compute_advantages(
        rescue_step(), LightningRL(), per_agent=True, prior={"rewriter": (0.9, 0.1)}
    )
    assert spread == compute_advantages(rescue_step(), LightningRL(), per_agent=True)[0]
    adv, stats = compute_advantages(
        ts, LightningRL(agent_baseline="step"), per_agent=True, prior={"rewriter": (0.5, 0.5)}
    )
    assert [adv[i] for i in rewriter] == [0.0, 0.0] and stats["agent_baselines"]["rewriter"] == "step"


def test_with_no_history_a_flat_sometimes_agent_gets_its_task_groups_shared_baseline() -> None:
    """A run's first step of failed repairs (no prior), or a prior of no spread, or no running
    baseline: the rewriter's calls are compared with every rollout of their task groups, all agents'
    returns — the advantages a shared policy gives them — so the failed repair in a group where
    others succeeded still trains; where those groups are flat too, nothing does."""
    ts = failed_repairs_step()
    rewriter = [i for i, t in enumerate(ts) if t.agent == "rewriter"]
    shared, _ = compute_advantages(ts, LightningRL())
    for cfg, prior in (
        (LightningRL(), None),
        (LightningRL(), (1.0, 0.0)),
        (LightningRL(running_window=0), (0.5, 0.5)),
    ):
        adv, stats = compute_advantages(ts, cfg, per_agent=True, prior=prior and {"rewriter": prior})
        assert stats["agent_baselines"] == {"writer": "group", "rewriter": "task"}
        assert [adv[i] for i in rewriter] == [shared[i] for i in rewriter]
        assert all(adv[i] < 0.0 for i in rewriter), "both failed where half of their groups succeeded"
    # the writer's advantages are its own groups' whatever the rewriter gets
    writer = [i for i, t in enumerate(ts) if t.agent == "writer"]
    step, _ = compute_advantages(ts, LightningRL(agent_baseline="step"), per_agent=True)
    group, _ = compute_advantages(ts, LightningRL(agent_baseline="group"), per_agent=True)
    assert [adv[i] for i in writer] == [group[i] for i in writer] != [step[i] for i in writer]
    # every rollout of the rewriter's groups failed alike: nothing to learn from, not even shared
    flat = [t.model_copy(update={"final_reward": 0.0, "reward": 0.0}) for t in ts]
    adv, stats = compute_advantages(flat, LightningRL(), per_agent=True)
    assert adv == [0.0] * len(flat) and stats["agent_baselines"]["rewriter"] == "step"


def test_a_repair_agent_acting_in_all_of_one_tasks_rollouts_is_still_a_sometimes_agent() -> None:
    """The rewriter repaired (and failed) in every rollout of task B and never acted in task A: its
    only group is whole and flat. Under ``auto`` it is compared over the step and its last steps, as
    when it acts in some of a group's rollouts; the writer, acting in every rollout, keeps its groups."""
    ts = []
    for g, finals in (("A", [1.0, 0.0, 1.0, 0.0]), ("B", [0.0, 0.0, 0.0, 0.0])):
        for i, r in enumerate(finals):
            ts.append(tr(f"{g}{i}", "writer", r, g, 0))
            if g == "B":
                ts.append(tr(f"{g}{i}", "rewriter", r, g, 1))
    adv, stats = compute_advantages(ts, LightningRL(), per_agent=True, prior={"rewriter": (0.5, 0.5)})
    assert stats["agent_baselines"] == {"writer": "group", "rewriter": "running"}
    assert [a for t, a in zip(ts, adv, strict=True) if t.agent == "rewriter"] == pytest.approx(
        [-1.0] * 4, rel=1e-5
    )
    fixed, stats = compute_advantages(
        ts, LightningRL(agent_baseline="group"), per_agent=True, prior={"rewriter": (0.5, 0.5)}
    )
    assert stats["agent_baselines"]["rewriter"] == "group"
    assert [a for t, a in zip(ts, fixed, strict=True) if t.agent == "rewriter"] == [0.0] * 4
    writer = [i for i, t in enumerate(ts) if t.agent == "writer"]
    assert [adv[i] for i in writer] == [fixed[i] for i in writer]


def test_prior_pools_the_agents_last_steps_from_the_records() -> None:
    history = [
        {"step": 0, "return_n/rewriter": 2, "return_mean/rewriter": 1.0, "return_std/rewriter": 0.0},
        {"step": 1, "return_n/rewriter": 2, "return_mean/rewriter": 0.0, "return_std/rewriter": 0.0},
        {"step": 2, "return_n/writer": 8, "return_mean/writer": 0.5, "return_std/writer": 0.5},
        {"step": 3, "return_n/rewriter": 4, "return_mean/rewriter": 0.5, "return_std/rewriter": 0.5},
    ]
    prior = prior_from_history(history)
    # rewriter: 8 calls, values {1, 1, 0, 0, and 4 of mean .5 std .5} -> mean .5, E[g^2] = (2 + 0 + 4 * .5) / 8
    assert prior["rewriter"] == pytest.approx((0.5, 0.5)) and prior["writer"] == pytest.approx((0.5, 0.5))
    assert prior_from_history(history, window=1)["rewriter"] == pytest.approx((0.5, 0.5))
    assert prior_from_history(history[:2], window=1)["rewriter"] == (0.0, 0.0)
    assert prior_from_history([]) == {}


def test_explicit_rules_and_validation() -> None:
    ts = rescue_step()
    _, stats = compute_advantages(ts, LightningRL(agent_baseline="step"), per_agent=True)
    assert stats["agent_baselines"] == {"writer": "step", "rewriter": "step"}
    _, shared = compute_advantages(ts, LightningRL())
    assert "agent_baselines" not in shared, "a shared policy keeps GRPO's task groups"
    with pytest.raises(UsageError, match="agent_baseline"):
        LightningRL(agent_baseline="sometimes")
    for bad in (-1, 1.5, True):
        with pytest.raises(UsageError, match="running_window"):
            LightningRL(running_window=bad)


def fit_writer_rewriter(
    tmp_path: Any, repair: Callable[[str, int], float | None], *, steps: int, rule: str = "auto"
) -> list[dict[str, Any]]:
    """``Trainer.fit`` on a tiny model, an adapter per agent, tasks "rescuable" and "lost", groups of
    four: the writer acts in every rollout; ``repair(task, member)`` (the rollout's number for its task,
    from 1) is the rollout's reward after the rewriter acted, or None where the writer's query "worked"
    (reward ``member % 2``, no repair). The step records."""
    pytest.importorskip("torch")
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    import openai

    import agl
    from agl.trainer.trainer import load_tokenizer
    from tests.test_adapter_per_agent import AGENTS, tiny_model

    seen: dict[str, int] = {}
    lock = threading.Lock()

    def app(task: dict, resources: agl.Resources) -> float:
        llm = resources.llm
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "x")
        msgs = [{"role": "user", "content": task["q"]}]
        with lock:
            seen[task["q"]] = seen.get(task["q"], 0) + 1
            member = seen[task["q"]]
        with agl.agent("writer"):
            client.chat.completions.create(model=llm.model, messages=msgs, max_tokens=4)
        outcome = repair(task["q"], member)
        if outcome is None:
            return float(member % 2)
        with agl.agent("rewriter"):  # the writer's query "failed": the rewriter repairs it
            client.chat.completions.create(model=llm.model, messages=msgs, max_tokens=4)
        return outcome

    trainer = agl.Trainer(
        LightningRL(group_size=4, lora_r=4, lora_alpha=8, learning_rate=1e-2, mixed_precision="no",
                    agent_baseline=rule),
        model=tiny_model(),
        agents=AGENTS,
        serving=agl.Serving(
            tokenizer=load_tokenizer(), runners=2, run_dir=tmp_path / "run", progress=False, store="memory://"
        ),
        loop=agl.LoopConfig(adapter_per_agent=True, steps=steps, tasks_per_step=2, val_before=False),
    )  # fmt: skip
    agl.instrument("openai")
    try:
        trainer.fit(app, [{"q": "rescuable"}, {"q": "lost"}])
    finally:
        agl.uninstrument()
    return list(trainer.history)


@pytest.mark.parametrize("rule", ["auto", "group"])
def test_a_repair_agent_acting_once_in_four_trains(tmp_path, rule: str) -> None:
    """The rewriter acts in one rollout of each group of four. Under ``auto`` its adapter gets a
    non-zero update on both of its calls; under per-task groups it trains nothing (the gap issue 56
    names)."""

    def repair(task: str, member: int) -> float | None:
        return (1.0 if task == "rescuable" else 0.0) if member == 1 else None

    (rec,) = fit_writer_rewriter(tmp_path, repair, steps=1, rule=rule)
    assert rec["step_baseline/writer"] == 0.0
    assert rec["trained_transitions/writer"] == 8.0 and rec["grad_norm/writer"] > 0.0
    if rule == "auto":
        assert rec["step_baseline/rewriter"] == 1.0
        assert rec["trained_transitions/rewriter"] == 2.0
        assert rec["grad_norm/rewriter"] > 0.0
    else:
        assert rec["step_baseline/rewriter"] == 0.0
        assert not rec.get("grad_norm/rewriter")


def test_a_step_of_failed_repairs_still_trains_the_repair_agent(tmp_path) -> None:
    """Two steps: the first rescues one of the rewriter's two repairs, the second fails both alike, so
    the step leaves it no spread; ``auto`` compares them with its first step (from the run's records)
    and its adapter still gets a non-zero update."""

    def repair(task: str, member: int) -> float | None:
        if member % 4 != 1:  # one repair per group of four; only the first step's "rescuable" one works
            return None
        return 1.0 if task == "rescuable" and member == 1 else 0.0

    first, second = fit_writer_rewriter(tmp_path, repair, steps=2)
    assert first["running_baseline/rewriter"] == 0.0 and first["return_n/rewriter"] == 2
    assert first["return_mean/rewriter"] == pytest.approx(0.5)
    assert second["return_std/rewriter"] == 0.0, "both repairs of the second step failed alike"
    assert second["running_baseline/rewriter"] == 1.0 and second["step_baseline/rewriter"] == 1.0
    assert second["trained_transitions/rewriter"] == 2.0 and second["grad_norm/rewriter"] > 0.0
    assert second["running_baseline/writer"] == 0.0 and second["step_baseline/writer"] == 0.0


def test_a_first_step_of_failed_repairs_trains_the_repair_agent_against_its_task_groups(tmp_path) -> None:
    """A run's first step: both repairs fail alike and there is no earlier step, so the rewriter is
    compared with every rollout of its task groups (one of which succeeded in each): its adapter
    still gets a non-zero update, on both calls."""

    def repair(task: str, member: int) -> float | None:
        return 0.0 if member == 1 else None

    (rec,) = fit_writer_rewriter(tmp_path, repair, steps=1)
    assert rec["return_std/rewriter"] == 0.0 and rec["return_n/rewriter"] == 2
    assert rec["task_baseline/rewriter"] == 1.0 and rec["step_baseline/rewriter"] == 0.0
    assert rec["trained_transitions/rewriter"] == 2.0 and rec["grad_norm/rewriter"] > 0.0
    assert rec["task_baseline/writer"] == 0.0 and rec["trained_transitions/writer"] == 8.0
