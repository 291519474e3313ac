"""The trainer's reward assembly with a judge: which reward a rollout is trained on, AIR gated on the
judge's verdict, and the reward-hacking monitors fed every step.

``reward`` is ``"task"`` (the agent's own reward, today's behaviour), ``"judge"`` (the judge's score)
or a mix ``{"task": 0.7, "judge": 0.3}`` (weights >= 0, normalised to sum 1). A rollout the judge
skipped (malformed twice) has no judge score: when the judge's weight is above 0 it is left out of the
update and counted (``judge_rollouts_unscored``) — it is never given a made-up score.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agl import semconv as sc
from agl.errors import UsageError

__all__ = ["RewardAssembly", "parse_reward", "reported_task_rewards"]


def parse_reward(reward: Any) -> dict[str, float]:
    """``"task"``/``"judge"``/``{"task": w, "judge": w}`` as normalised weights, or ValueError."""
    if reward in ("task", "judge"):
        return {reward: 1.0}
    if isinstance(reward, Mapping) and reward and set(reward) <= {"task", "judge"}:
        ws = {k: v for k, v in reward.items()}
        if all(not isinstance(v, bool) and isinstance(v, (int, float)) and v >= 0 for v in ws.values()):
            total = float(sum(ws.values()))
            if total > 0:
                return {k: float(v) / total for k, v in ws.items() if v}
    raise UsageError(
        f'reward must be "task", "judge" or {{"task": w, "judge": w}} with weights >= 0, got {reward!r}'
    )


def reported_task_rewards(
    store: Any, rollouts: Sequence[Any], rewards: Mapping[str, float]
) -> dict[str, float]:
    """The task reward of each rollout whose agent reported one, before any judge mixing. A rollout
    without a reward span carries the adapter's ``missing_reward`` fill, which is no verdict: an agent
    without a grader must not read as diverging from its judge."""
    from agl.reports.inspect import final_reward_of

    return {
        r.id: rewards[r.id] for r in rollouts if r.id in rewards and final_reward_of(store, r) is not None
    }


class RewardAssembly:
    """What the trainer's hook calls: :meth:`assemble` after a step's rollouts are collected,
    :meth:`monitor` once the step's record is built."""

    def __init__(self, judge: Any = None, reward: Any = "task", monitors: Any = True) -> None:
        from agl.trainer.monitors import Monitors, Thresholds

        self.weights = parse_reward(reward)
        if "judge" in self.weights and judge is None:
            raise UsageError(f"reward={reward!r} needs judge=agl.Judge(...)")
        self.judge = judge
        self.air: Any = None  # the adapter's AIR, set by open()
        if monitors is True:
            monitors = Monitors()
        elif isinstance(monitors, Thresholds):
            monitors = Monitors(monitors)
        self.monitors = monitors or None
        self._judged: dict[str, float] = {}
        self._task: dict[str, float] = {}
        self.adapter: Any = None  # the run's adapter, set by open(): its AIR and its credit rule

    def open(self, run_dir: Any, adapter: Any) -> None:
        """Start the judge (its gateway, store and cache under ``run_dir``). From the run's ``adapter``:
        its AIR, whose ``gate="judge"`` this assembly applies, and its credit rule
        (:meth:`agl.Adapter.returns`), with which a rescored rollout's returns are credited again."""
        air = getattr(adapter, "air", None)
        if air is not None and getattr(air, "gate", None) == "judge" and self.judge is None:
            raise UsageError('AIR(gate="judge") needs Trainer(judge=agl.Judge(...))')
        self.air, self.adapter = air, adapter
        if self.judge is not None:
            self.judge.open(run_dir)

    def close(self) -> None:
        if self.judge is not None:
            self.judge.close()

    def assemble(
        self, store: Any, ids: Sequence[str], transitions: dict[str, list[Any]], rewards: dict[str, float]
    ) -> tuple[dict[str, list[Any]], dict[str, float], dict[str, Any]]:
        """The step's training rollouts rescored: judged, mixed, AIR judge-gated. Returns new
        ``transitions`` and ``rewards`` maps and the ``judge_*`` metrics (cost included)."""
        self._judged, self._task = {}, {}
        if self.judge is None:
            return transitions, rewards, {}
        rollouts = [r for r in store.query_rollouts(ids=list(ids)) if r.id in rewards]
        report = self.judge.score(store, rollouts)
        self._judged = dict(report.scores)
        self._task = reported_task_rewards(store, rollouts, rewards)
        metrics = report.metrics()
        task = [rewards[r] for r in ids if r in rewards]
        judged = [report.scores[r] for r in ids if r in report.scores]
        metrics["train_task_reward"] = sum(task) / len(task) if task else None
        metrics["judge_reward"] = sum(judged) / len(judged) if judged else None
        new_ts, new_rewards, unscored = dict(transitions), dict(rewards), 0
        for rid in ids:
            if rid not in rewards:
                continue
            if "judge" in self.weights and rid not in report.scores:
                new_ts[rid], unscored = [], unscored + 1
                new_rewards.pop(rid)
                continue
            value = self._mix(rewards[rid], report.scores.get(rid))
            new_rewards[rid] = value
            new_ts[rid] = self._rescore(transitions.get(rid, []), value, report.scores.get(rid))
        metrics["judge_rollouts_unscored"] = unscored
        return new_ts, new_rewards, metrics

    def _mix(self, task: float, judge: float | None) -> float:
        return self.weights.get("task", 0.0) * task + self.weights.get("judge", 0.0) * (judge or 0.0)

    def _rescore(self, ts: Sequence[Any], value: float, verdict: float | None) -> list[Any]:
        """One rollout's transitions (in call order) with the assembled final reward, judge-gated AIR,
        and ``reward`` — the credited return the update normalises — credited again from them with the
        adapter's rule (:meth:`agl.Adapter.returns`: :func:`agl.adapter.credit.credit_returns`, the
        function the adapter credited the task's reward with): a rescored rollout trains on its new one."""
        inter = [t.intermediate_reward for t in ts]
        if self.air is not None and getattr(self.air, "gate", None) == "judge" and verdict is not None:
            inter = list(self.air.gate_on(inter, verdict))
        returns = self.adapter.returns(value, inter)
        return [
            t.model_copy(update={"final_reward": value, "intermediate_reward": i, "reward": g})
            for t, i, g in zip(ts, inter, returns, strict=True)
        ]

    def monitor(
        self,
        store: Any,
        step: int,
        ids: Sequence[str],
        val_ids: Sequence[str],
        transitions: Mapping[str, list[Any]],
        record: Mapping[str, Any],
        history: Sequence[Mapping[str, Any]],
    ) -> dict[str, Any]:
        """The monitors' metrics and warnings for this step (empty when monitors are off)."""
        if self.monitors is None:
            return {}
        from agl.trainer.monitors import StepData

        train = {rid: transitions.get(rid, []) for rid in ids}
        rollouts = store.query_rollouts(ids=list(ids)) if ids else []
        tools = {
            rid: len(store.query_spans(rollout_id=rid, name=sc.SPAN_EXECUTE_TOOL, include_stale=False))
            for rid in ids
        }
        data = StepData(
            step=step,
            transitions={r: ts for r, ts in train.items() if ts},
            task_of={r.id: r.task_id for r in rollouts},
            tool_calls=tools,
            judge=self._judged,
            task=self._task,
            val_ids=list(val_ids),
        )
        return self.monitors.observe(data, record, history)
