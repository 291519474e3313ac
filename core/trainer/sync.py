"""The synchronous schedule: each step's rollouts run on that step's weights, then the update.

One step: publish -> push -> enqueue (``group_size`` rollouts per training task, plus the held-out
tasks) -> collect (with dynamic sampling's extra rounds, :mod:`agl.trainer.sampling`) -> assemble the
rewards (task, judge or mixed: :mod:`agl.trainer.rewarding`) -> update -> the monitors. Every trained
call was served by the weights pushed at the start of the step, which ``prove_calls`` checks when the
engine serves the pushed weights.

The schedule acts on the run only through :class:`~agl.trainer.steps.Steps` (it holds no Trainer).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from agl.run.served import prove_calls
from agl.trainer.branching import Branching
from agl.trainer.heldout import enqueue_held_out
from agl.trainer.order import TaskOrder
from agl.trainer.sampling import resample
from agl.trainer.steps import Steps
from agl.types import Task, Transition

__all__ = ["SyncSchedule"]

log = logging.getLogger("agl.trainer")


class SyncSchedule:
    """The synchronous schedule of one ``Trainer.fit`` (see the module docstring)."""

    def __init__(self, steps: Steps, train_tasks: list[Task]) -> None:
        self.steps = steps
        self.cfg = steps.loop
        self.train_tasks = train_tasks
        self.order = TaskOrder(len(train_tasks), self.cfg.seed)
        #: K continuations at the call of an agent left without a signal (agl.trainer.branching)
        self.branching = Branching(self.cfg.branches, steps.agent_fn) if self.cfg.branches else None

    def draw(self, k: int) -> list[Task]:
        return [self.train_tasks[i] for i in self.order.take(k)]

    def start(self) -> int:
        state = self.steps.state()
        if state is None:
            return 0
        _, start = self.steps.restore(state, self.order)
        self.steps.cancel_live()  # rollouts a crashed run left: this step enqueues its own again
        log.info("agl trainer: resumed at step %d from %s", start, state["checkpoint"])
        return start

    def checkpoint(self, done: int) -> None:
        self.steps.checkpoint(self.order, {"next_step": done})

    def finish(self) -> None:
        """Nothing outlives a synchronous step."""

    def step(self, step: int, final: bool, val_tasks: list[Task], bar: Any) -> dict[str, Any]:
        """publish -> push -> enqueue -> collect -> adapt -> update; the step's metrics record (a final
        step only measures the held-out reward)."""
        s = self.steps
        batch = [] if final else self.draw(self.cfg.tasks_per_step)
        t_step = time.perf_counter()
        busy0 = s.engine_busy()
        version = s.publish()
        sync_s = s.push(version)
        ids = s.enqueue(batch, version, step, s.group_size)
        val_ids = enqueue_held_out(s, val_tasks, version, step, self.cfg.val_samples)
        t0 = time.perf_counter()
        with s.adapting(step):
            transitions, rewards, finished = s.collect(ids + val_ids, bar, f"step {step}")
            sampled: dict[str, Any] = {}
            if batch and self.cfg.dynamic_sampling:
                ids, sampled = resample(
                    s,
                    s.algorithm,
                    self.cfg.dynamic_sampling,
                    step,
                    len(batch),
                    version,
                    ids,
                    transitions,
                    rewards,
                    finished,
                    bar,
                    self.draw,
                )
            branched: dict[str, Any] = {}
            if batch and self.branching is not None:
                collected = (transitions, rewards, finished)
                ids, branched = self.branching.after_collect(s, step, version, ids, collected, bar, sampled)
            rollout_s = time.perf_counter() - t0
        record: dict[str, Any] = {"step": step, "resources_version": version, **branched}
        if batch:  # judge scores -> the trained reward, judge-gated AIR (agl.trainer.rewarding)
            transitions, rewards, judged = s.assemble(ids, transitions, rewards)
            record.update(judged)
        if val_ids:
            record.update(s.val_record(val_ids, rewards, len(val_tasks)))
        if batch:
            self._train(step, version, ids, transitions, rewards, finished, sampled, record)
        # the reward-hacking monitors' metrics and warnings (agl.trainer.monitors)
        record.update(s.monitor(step, ids if batch else [], val_ids, transitions, record))
        record.update(rollout_s=rollout_s, sync_s=sync_s, step_s=time.perf_counter() - t_step)
        record.update(s.engine_share(busy0, record["step_s"]))
        return record

    def _train(
        self,
        step: int,
        version: int,
        ids: list[str],
        transitions: dict[str, list[Transition]],
        rewards: dict[str, float],
        finished: list[Any],
        sampled: dict[str, Any],
        record: dict[str, Any],
    ) -> None:
        """The step's training metrics and its update, into ``record``."""
        s = self.steps
        train_ids = set(ids)
        train_ts = s.trained(ids, transitions)
        if s.serves_pushed_weights:  # all ran after this step's push
            prove_calls(train_ts, {version}, f"step {step}")
        failed = sum(1 for r in finished if r.id in train_ids and r.status != "succeeded")
        record.update(s.train_record(ids, transitions, rewards, failed))
        train_ts = s.viable(step, train_ts, record)  # groups under min_group_fraction dropped
        if sampled:
            keep = set(sampled.pop("kept_groups"))
            # nothing informative after every round: the update still runs (it skips zero advantages),
            # so the step count, schedule and checkpoints stay in step with `step`
            record.update(s.update([x for x in train_ts if x.group_id in keep] or train_ts))
            record.update(sampled)  # groups counted over every round, not only the ones trained
        else:
            record.update(s.update(train_ts))
