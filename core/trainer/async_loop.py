"""Asynchronous training: the ``Trainer``'s loop when ``LoopConfig.max_staleness = k > 0``.

One step reads like the synchronous one (publish -> push -> enqueue -> collect -> update) with two
differences that keep the engine busy while the policy updates:

- **enqueue ahead**: the step tops the store up to ``(k + 1) * tasks_per_step`` outstanding groups
  (:class:`agl.trainer.pipeline.GroupPipeline`), so runners keep claiming rollouts during the update and
  the weight push; rollouts run at most ``k`` policy versions ahead of the update that trains on them;
- **collect in completion order**: the update takes the next ``tasks_per_step`` complete groups, in the
  order they completed. A group with a call served by weights older than ``current - k`` (the served
  version is on each transition, read from the gateway's span) is dropped, counted in
  ``stale_groups_dropped``, and replaced by a fresh group. So is a group with a call whose served
  version was not recorded (its gateway span lost with a killed process): it cannot be proven fresh.

A member that failed on the infrastructure (:func:`agl.adapter.failures.failure_kind` says ``infra``:
a 502, a runner that died, a timeout while its call waited on the engine) is requeued as the
synchronous schedule requeues it (:meth:`~agl.trainer.steps.Steps.retry`): the same task, group and
seed place, within ``RolloutSettings.infra_retries``; the replacement takes its place in the group,
which completes when the replacement ends. Its zero never reaches the group's baseline. A spent budget
leaves the member out (the group is then judged by ``LightningRL.min_group_fraction``).

Each step's record adds ``staleness_mean``/``staleness_max`` (updates behind this one, over the
trained transitions), ``stale_groups_dropped`` (their rollouts in ``dropped_rollout_ids``),
``trained_rollout_ids``, ``requeued_rollout_ids`` (members of the step's groups replaced after an
infrastructure failure; ``requeued_rollouts`` and ``errored_rollouts/<kind>`` count as in the
synchronous record), ``trainer_idle_s`` (waiting for complete groups) and, with the in-process
engine, ``engine_busy_s``/``engine_idle_s``.

Resume (``resume=True``) after a kill, even SIGKILL: the policy, task order and the ids of the groups
already consumed come from the last checkpoint's ``trainer_state.json`` (written atomically after the
step's metrics); metrics of steps after that checkpoint are discarded (their updates were lost with the
process) and the groups they trained are trained again. Every other group in the store is picked up:
finished ones are trained, queued ones run, and running ones a dead runner held are retried by the
store once their lease lapses. So every rollout id is trained in exactly one recorded step.

The schedule acts on the run only through :class:`~agl.trainer.steps.Steps` (it holds no Trainer).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from agl.run.metrics import mean
from agl.trainer.heldout import enqueue_held_out
from agl.trainer.order import TaskOrder
from agl.trainer.pipeline import (
    PIPELINE_KEY,
    Group,
    GroupPipeline,
    VersionLedger,
    group_lag,
    wait_for_groups,
)
from agl.trainer.steps import Steps
from agl.types import Task, Transition

__all__ = ["AsyncSchedule"]

log = logging.getLogger("agl.trainer")


class AsyncSchedule:
    """The asynchronous schedule of one ``Trainer.fit`` (see the module docstring)."""

    def __init__(self, steps: Steps, train_tasks: list[Task]) -> None:
        self.steps = steps
        self.cfg = steps.loop
        self.k = self.cfg.max_staleness
        self.train_tasks = train_tasks
        self.order = TaskOrder(len(train_tasks), self.cfg.seed)
        self.pipe = GroupPipeline(
            steps.store,
            steps.adapt,
            steps.group_size,
            steps.rollout_config,
            self.cfg.seed,
            retry=steps.retry,  # a member failed on the infrastructure runs again in its place
        )
        #: a scripted or hosted engine never serves the pushed versions: staleness is unknown there
        self.versions_known = steps.serves_pushed_weights
        self.ledger = VersionLedger()

    def budget_at(self, step: int) -> int:
        """Groups to keep outstanding at ``step``: k steps ahead, but never for steps past the last
        (their rollouts would run for nothing, beside the final held-out check)."""
        return min(self.k + 1, self.cfg.steps - step) * self.cfg.tasks_per_step

    def draw(self, n: int) -> list[Task]:
        return [self.train_tasks[i] for i in self.order.take(n)]

    # ------------------------------------------------------------------------- schedule
    def checkpoint(self, done: int) -> None:
        self.steps.checkpoint(self.order, {"next_step": done, **self.pipe.state(), **self.ledger.state()})

    def finish(self) -> None:
        """Groups still outstanding after the last step would only run for nothing: cancel them."""
        self.pipe.cancel_outstanding()

    def step(self, step: int, final: bool, val_tasks: list[Task], bar: Any) -> dict[str, Any]:
        return self._step(step, final, val_tasks)

    def _step(self, step: int, final: bool, val_tasks: list[Task]) -> dict[str, Any]:
        """publish -> push -> top up the pipeline -> take complete groups -> update -> held-out."""
        s = self.steps
        t_step = time.perf_counter()
        busy0 = s.engine_busy()
        version = s.publish()
        sync_s = s.push(version)
        self.ledger.pushed(version, s.global_step)
        if not final:
            self.pipe.fill(self.budget_at(step), step, self.draw)
        else:  # nothing trains any more: groups still running would only slow the held-out check
            self.pipe.cancel_outstanding()
        val_ids = enqueue_held_out(s, val_tasks, version, step, self.cfg.val_samples)
        record: dict[str, Any] = {"step": step, "resources_version": version, "max_staleness": self.k}
        ids: list[str] = []
        transitions: dict[str, list[Transition]] = {}
        if not final:
            ids, transitions = self._train(step, version, record)
        if val_ids:  # the held-out rollouts ran on this step's weights while the update ran
            vt, rewards, _ = s.collect(val_ids, None, f"step {step} held-out")
            transitions.update(vt)
            record.update(s.val_record(val_ids, rewards, len(val_tasks)))
        record.update(s.monitor(step, ids, val_ids, transitions, record))
        step_s = time.perf_counter() - t_step
        record.update(sync_s=sync_s, step_s=step_s)
        record.update(s.engine_share(busy0, step_s))
        return record

    def _take(self, step: int, version: int) -> tuple[list[Group], list[Group], float]:
        """The step's groups (complete, fresh enough, in completion order), the dropped ones, and the
        seconds the trainer waited for them. A dropped group is replaced at once, keeping the budget."""
        dropped: list[Group] = []

        def fresh(g: Group) -> bool:
            if not self.versions_known:
                return True
            lag = group_lag(g, self.ledger, version)  # None: not provably fresh
            return lag is not None and (lag <= self.k or self.cfg.off_policy == "tis")

        def drop(g: Group) -> None:
            dropped.append(g)
            self.pipe.enqueue(self.draw(1), step)

        t0 = time.perf_counter()
        groups = wait_for_groups(self.pipe, self.cfg.tasks_per_step, fresh, drop, self.cfg.step_timeout_s)
        return groups, dropped, time.perf_counter() - t0

    def _train(
        self, step: int, version: int, record: dict[str, Any]
    ) -> tuple[list[str], dict[str, list[Transition]]]:
        """Take the step's groups and update on them; fills ``record``; returns the trained ids and
        transitions."""
        s = self.steps
        with s.adapting(step):
            groups, dropped, idle_s = self._take(step, version)
        ids = [rid for g in groups for rid in g.ids]
        transitions = {rid: ts for g in groups for rid, ts in g.transitions.items()}
        rewards = {rid: r for g in groups for rid, r in g.rewards.items()}
        failed = sum(1 for g in groups for r in g.finished.values() if r.status != "succeeded")
        transitions, rewards, judged = s.assemble(ids, transitions, rewards)
        record.update(judged)
        train_ts = s.trained(ids, transitions)
        lags = [self.ledger.lag(x.weight_version, version) for x in train_ts] if self.versions_known else []
        lags = [x for x in lags if x is not None]
        record.update(s.train_record(ids, transitions, rewards, failed))
        record.update(
            staleness_mean=mean([float(x) for x in lags]),
            staleness_max=max(lags) if lags else None,
            stale_groups_dropped=len(dropped),
            dropped_rollout_ids=[rid for g in dropped for rid in g.ids],
            requeued_rollout_ids=[rid for g in (*groups, *dropped) for rid in g.replaced],
            trained_groups=len(groups),
            trained_rollout_ids=ids,
            trainer_idle_s=idle_s,
            rollout_s=idle_s,
        )
        train_ts = s.viable(step, train_ts, record)  # groups under min_group_fraction dropped
        record.update(s.update(train_ts, on_policy=not any(lags)))
        return ids, transitions

    # ------------------------------------------------------------------------------ resume
    def start(self) -> int:
        """With ``resume=True`` and a saved state: restore the policy, task order and consumed groups,
        keep the metrics of the checkpointed steps only, and pick up the store's outstanding groups;
        returns the step to continue from (0 otherwise)."""
        state = self.steps.state()
        if state is None:
            return 0
        global_step, start = self.steps.restore(state, self.order)
        self.ledger.restore(state, global_step)
        restored = self.pipe.restore(state)
        # held-out checks are re-run; a train group of the pipeline is kept (restored above)
        self.steps.cancel_live(keep=lambda r: r.mode == "train" and bool(r.metadata.get(PIPELINE_KEY)))
        log.info(
            "agl trainer: resumed at step %d from %s with %d outstanding groups",
            start,
            state["checkpoint"],
            restored,
        )
        return start
