"""The step interface: what a schedule (synchronous or asynchronous) does to the run, and nothing more.

A step of either schedule is made of the same moves — publish a resources version, push the policy's
weights to the engine, enqueue rollouts, collect them (adapting each as it finishes), assemble their
rewards, update the policy, write the step's record, checkpoint — and the schedules differ only in how
they order and overlap them. :class:`Steps` is those moves over one :class:`~agl.trainer.Trainer`'s
run, plus the read-only views of the run a schedule needs (its loop settings, algorithm, history,
the policy's update step, the engine's busy clock). The schedules (:mod:`agl.trainer.sync`,
:mod:`agl.trainer.async_loop`), dynamic sampling (:mod:`agl.trainer.sampling`), branching
(:mod:`agl.trainer.branching`) and ``Trainer.dev`` work through it and never reach into the Trainer
(``tests/test_layout.py`` checks the schedules hold no Trainer at all). It reads the Trainer's public
attributes only (its store, environment, adapter, policy, algorithm, checks, rewards and configs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl import semconv as sc
from agl.adapter.air_rules import reward_split
from agl.algorithms.lightning_rl import prior_from_history
from agl.gateway.seeds import rollout_place, rollout_seed
from agl.run.metrics import engine_share, mean, rollouts_postfix
from agl.run.record import CHECKPOINT_FILE
from agl.trainer.heldout import held_out_record
from agl.trainer.order import TaskOrder
from agl.trainer.pipeline import REQUEUED_FROM_KEY, cancel_rollouts
from agl.trainer.state import read_state, write_state
from agl.types import NewRollout, Rollout, Task, Transition

if TYPE_CHECKING:
    from agl.config import LoopConfig
    from agl.trainer.trainer import Trainer

__all__ = ["INFRA_RETRY_KEY", "Steps", "agent_rewards"]

#: the rewards for doing nothing counted per step, and what the first one's warning says
_FOR_NOTHING = {
    "rewarded_without_calls": "rewarded > 0 without making any LLM call",
    "rewarded_truncated": "rewarded > 0 for a reply cut at max_tokens",
    "default_rewards": "its reward is the adapter's missing_reward, not one the agent reported",
}

#: a requeued rollout's metadata: how many of its place's rollouts failed on the infrastructure before it
INFRA_RETRY_KEY = "agl.infra_retry"

log = logging.getLogger("agl.trainer")


class Steps:
    """publish, push, enqueue, collect, update, checkpoint and the saved state of one Trainer's run."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer
        #: failure counts of the rollouts collected since :meth:`take_failures` last ran
        self.failures: dict[str, int] = {}
        self._warned: set[str] = set()  # the rewards-for-nothing already warned about (once each)

    # ------------------------------------------------------------------ the run, read-only
    @property
    def store(self) -> Any:
        return self.t.store

    @property
    def loop(self) -> LoopConfig:
        """The run's loop settings (steps, tasks per step, staleness, seed, ...)."""
        return self.t.loop

    @property
    def algorithm(self) -> Any:
        """The run's algorithm (a :class:`agl.LightningRL`: its group size and group statistics)."""
        return self.t.algorithm

    @property
    def group_size(self) -> int:
        """Rollouts per training task: the GRPO group."""
        return int(self.t.algorithm.group_size)

    @property
    def rollout_config(self) -> Any:
        """The per-rollout limits the store keeps (timeout, lease, attempts)."""
        return self.t.rollout_config

    @property
    def agent_fn(self) -> Any:
        """The rollout function of the run (branching reads its replay contract)."""
        return self.t.agent_fn

    @property
    def history(self) -> list[dict[str, Any]]:
        """The metrics records written so far (one per step)."""
        return self.t.history

    @property
    def global_step(self) -> int:
        """The policy's update step (how many updates it has taken)."""
        return int(self.t.policy.global_step)

    @property
    def serves_pushed_weights(self) -> bool:
        """Whether the engine serves the weights :meth:`push` sends (the embedded and vLLM ones; not a
        scripted or hosted one), so the served version on each call can be trusted."""
        env = self.t.env
        return env is not None and bool(env.serves_pushed_weights)

    def engine_busy(self) -> float | None:
        """The in-process engine's busy clock in seconds (None without one)."""
        return self.t.env.engine_busy_s() if self.t.env is not None else None

    def engine_share(self, busy0: float | None, step_s: float) -> dict[str, float]:
        """``engine_busy_s``/``engine_idle_s`` of a step that began at busy clock ``busy0``
        (:func:`agl.run.metrics.engine_share`)."""
        return engine_share(busy0, self.t.env, step_s)

    # ------------------------------------------------------------------------- serving
    def publish(self) -> int:
        """Publish a resources snapshot (the gateway, the model, the sampling); returns its version, the
        step's weight version."""
        assert self.t.env is not None
        return self.t.env.publish(self.t.config.sampling)

    def push(self, version: int) -> float:
        """Push the policy's weights to the engine as ``version``; returns the seconds it took."""
        return self.t.sync_weights(version)

    # ------------------------------------------------------------------------ rollouts
    def enqueue(
        self,
        tasks: Sequence[Task],
        version: int,
        step: int,
        repeat: int,
        group_suffix: str = "",
        extra: dict[str, Any] | None = None,
    ) -> list[str]:
        """``repeat`` rollouts of each task pinned to ``version``, one group per task; returns their ids.
        A task drawn again in a later sampling round of the same step is a group of its own. ``extra``
        goes into every rollout's metadata (a greedy held-out check's temperature, agl.trainer.heldout)."""
        rollouts = [
            NewRollout.from_task(
                task,
                group_id=f"{task.id}-s{step}{group_suffix}",
                resources_version=version,
                config=self.t.rollout_config,
                metadata={
                    "step": step,
                    **self.seeded(step, i, member, group_suffix, task.mode),
                    **(extra or {}),
                },
            )
            for i, task in enumerate(tasks)
            for member in range(repeat)
        ]
        return [r.id for r in self.store.enqueue(rollouts)] if rollouts else []

    def seeded(self, step: int, task: int, member: int, round_: str, mode: str) -> dict[str, Any]:
        """A rollout's seed and place (:mod:`agl.gateway.seeds`): from the run's seed and where the rollout sits
        in the step (the task's position in the draw, the group member), never from the order runners
        claim or finish rollouts in; the gateway derives each call's seed from it."""
        place = rollout_place(step, task, member, round_, mode)
        return {sc.ROLLOUT_SEED_KEY: rollout_seed(self.t.loop.seed, place), sc.ROLLOUT_PLACE_KEY: place}

    def reward(self, rollout: Rollout, transitions: list[Transition]) -> float:
        """A rollout's reward: its final reward as the adapter defines it (one definition)."""
        if transitions:
            return transitions[0].final_reward
        return float(self.t.adapter.rollout_reward(self.store, rollout))

    def adapt(self, rollout: Rollout) -> tuple[list[Transition], float | None]:
        """A finished rollout's transitions and reward: none for a cancelled one, nor for one that
        failed on the infrastructure (:func:`agl.adapter.failures.failure_kind`): its zero is no verdict
        on the policy, so it never reaches a reward, a group baseline or the update."""
        if rollout.status == "cancelled":
            return [], None
        ts = self.t.adapter.from_store(self.store, [rollout])
        kind = self.t.adapter.failure_kind(self.store, rollout)
        if kind != "task":
            self._count(f"errored_rollouts/{kind}")
        if kind == "infra" or (kind == "no_reward" and not self._scored_without_reward()):
            return [], None  # no verdict: out of the rewards, the groups and the update
        reward = self.reward(rollout, ts)
        self._flag_for_nothing(rollout, kind, ts, reward)
        return ts, reward

    def _scored_without_reward(self) -> bool:
        """Whether a rollout that reported no reward still gets a verdict: the user set the adapter's
        ``missing_reward`` explicitly, or a judge scores the run's rollouts (``reward="judge"`` or a mix
        with a judge weight above 0), whose score is that rollout's reward."""
        return self.t.adapter.missing_reward is not None or self.t.rewarding.weights.get("judge", 0.0) > 0

    def _count(self, key: str) -> None:
        self.failures[key] = self.failures.get(key, 0) + 1

    def _flag_for_nothing(self, rollout: Rollout, kind: str, ts: list[Transition], reward: float) -> None:
        """Count the rewards that may be for doing nothing — rewarded without any LLM call, rewarded for a
        reply cut at ``max_tokens``, a default reward (``missing_reward``) — warning the first time each."""
        found = {
            "rewarded_without_calls": reward > 0 and not ts,
            "rewarded_truncated": reward > 0 and bool(ts) and ts[-1].truncated,
            "default_rewards": kind == "no_reward",
        }
        for key, hit in found.items():
            if not hit:
                continue
            self._count(key)
            if key not in self._warned:
                self._warned.add(key)
                log.warning(
                    "agl trainer: rollout %s: %s (counted per step as %s; a reward for doing nothing?)",
                    rollout.id,
                    _FOR_NOTHING[key],
                    key,
                )

    def requeue(self, rollout: Rollout) -> str | None:
        """A new rollout in the place of ``rollout``, which failed on the infrastructure: the same task,
        group, weights (the synchronous schedule's pinned version; the asynchronous one pins none) and
        seed place (so a reproducible run stays reproducible: its calls get the seeds the failed one's
        got), its metadata naming the rollout it replaces (``REQUEUED_FROM_KEY``), while ``RolloutSettings.infra_retries`` allows; its id, else
        None (the budget is spent: the rollout stays out of the step)."""
        tries = int(rollout.metadata.get(INFRA_RETRY_KEY, 0))
        if tries >= self.t.rollout.infra_retries:
            return None
        again = NewRollout(
            task_id=rollout.task_id,
            input=rollout.input,
            mode=rollout.mode,
            group_id=rollout.group_id,
            resources_version=rollout.resources_version,
            config=rollout.config,
            metadata={**rollout.metadata, INFRA_RETRY_KEY: tries + 1, REQUEUED_FROM_KEY: rollout.id},
        )
        self.failures["requeued_rollouts"] = self.failures.get("requeued_rollouts", 0) + 1
        log.info(
            "agl trainer: rollout %s failed on the infrastructure; requeued (try %d)", rollout.id, tries + 1
        )
        return str(self.store.enqueue([again])[0].id)

    def retry(self, rollout: Rollout) -> str | None:
        """:meth:`requeue` ``rollout`` when it failed on the infrastructure; its replacement's id, else
        None. A cancelled rollout is never requeued, whatever its earlier attempts were (the trainer
        cancelled it: it no longer wants it). Both schedules call this on every terminal rollout."""
        if rollout.status == "cancelled" or self.t.adapter.failure_kind(self.store, rollout) != "infra":
            return None
        return self.requeue(rollout)

    def take_failures(self) -> dict[str, int]:
        """The counts since the last call (``errored_rollouts/<kind>``, ``requeued_rollouts`` and the
        rewards for doing nothing), for the step's record; every key is present, zero when none."""
        out = {f"errored_rollouts/{k}": 0 for k in ("infra", "agent", "no_reward")}
        out |= {k: 0 for k in ("requeued_rollouts", *_FOR_NOTHING)}
        out.update({k: v for k, v in self.failures.items() if k in out})
        self.failures = {}
        return out

    def collect(
        self, ids: Sequence[str], bar: Any, label: str
    ) -> tuple[dict[str, list[Transition]], dict[str, float], list[Rollout]]:
        """Wait for rollouts, adapting each as it finishes; the bar shows the live mean reward. Rollouts
        still running after ``LoopConfig.step_timeout_s`` are cancelled."""
        pending = set(ids)
        transitions: dict[str, list[Transition]] = {}
        rewards: dict[str, float] = {}
        finished: list[Rollout] = []
        timeout_s = self.t.loop.step_timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        slot: dict[str, str] = {}  # a requeued rollout -> the rollout whose place it takes
        while pending:
            done = [
                r for r in self.store.wait_for_rollouts(sorted(pending), timeout_s=0.5) if r.id in pending
            ]
            for r in done:
                pending.discard(r.id)
                key = slot.get(r.id, r.id)
                transitions[key], reward = self.adapt(r)
                if reward is not None:
                    rewards[key] = reward
                again = self.retry(r)
                if again is not None:
                    pending.add(again)
                    slot[again] = key
                else:
                    finished.append(r)
            if bar is not None and done:
                bar.set_postfix(rollouts_postfix(len(ids), finished, rewards), refresh=True)
            if deadline is not None and time.monotonic() > deadline and pending:
                log.warning(
                    "agl trainer: %s: %d rollouts did not finish in time; cancelling them",
                    label,
                    len(pending),
                )
                cancel_rollouts(self.store, list(pending))
                deadline = None
        return transitions, rewards, finished

    @contextlib.contextmanager
    def adapting(self, step: int) -> Iterator[None]:
        """Around a step's collection: the adapter's counts over it are checked on leaving
        (:meth:`agl.trainer.checks.StepChecks.adapted`: a step whose calls could not be adapted says
        why)."""
        adapter = self.t.adapter
        before = adapter.stats.copy()
        yield
        self.t.checks.adapted(step, adapter.stats.since(before), adapter.agents)

    # ------------------------------------------------------------------------- rewards
    def assemble(
        self, ids: Sequence[str], transitions: dict[str, list[Transition]], rewards: dict[str, float]
    ) -> tuple[dict[str, list[Transition]], dict[str, float], dict[str, Any]]:
        """The step's training rollouts rescored (task, judge or mixed: :mod:`agl.trainer.rewarding`);
        new ``transitions`` and ``rewards`` maps and the ``judge_*`` metrics."""
        return self.t.rewarding.assemble(self.store, ids, transitions, rewards)

    def monitor(
        self,
        step: int,
        ids: Sequence[str],
        val_ids: Sequence[str],
        transitions: Mapping[str, list[Transition]],
        record: Mapping[str, Any],
    ) -> dict[str, Any]:
        """The reward-hacking monitors' metrics and warnings for the step (:mod:`agl.trainer.monitors`)."""
        return self.t.rewarding.monitor(self.store, step, ids, val_ids, transitions, record, self.history)

    # -------------------------------------------------------------------------- record
    @staticmethod
    def trained(ids: Sequence[str], transitions: Mapping[str, list[Transition]]) -> list[Transition]:
        """The transitions of the rollouts ``ids``, in that order: what the step trains on."""
        return [x for rid in ids for x in transitions.get(rid, [])]

    def val_record(self, val_ids: Sequence[str], rewards: Mapping[str, float], tasks: int) -> dict[str, Any]:
        """The held-out part of a step's record: ``val_reward`` (the mean over the held-out rollouts
        that finished with a reward), ``val_rollouts``, ``val_tasks`` and how they were decoded
        (:func:`agl.trainer.heldout.held_out_record`)."""
        return held_out_record(val_ids, rewards, tasks, self.loop.val_samples)

    def train_record(
        self,
        ids: Sequence[str],
        transitions: Mapping[str, list[Transition]],
        rewards: Mapping[str, float],
        failed: int,
    ) -> dict[str, Any]:
        """The training part of a step's record, the same for both schedules: ``train_reward``,
        ``rollouts``, ``rollouts_failed`` (``failed``), ``transitions``, ``exact_token_ratio``, the
        reward's task/AIR split (:func:`agl.adapter.air_rules.reward_split`) and, with a LoRA per
        agent, ``train_reward/<lora>``."""
        train_ts = self.trained(ids, transitions)
        exact = sum(1 for x in train_ts if x.exact) / len(train_ts) if train_ts else None
        return {
            "train_reward": mean([rewards[r] for r in ids if r in rewards]),
            "rollouts": len(ids),
            "rollouts_failed": failed,
            "transitions": len(train_ts),
            "exact_token_ratio": exact,
            **self.take_failures(),  # errored rollouts by kind, requeued ones, rewards for nothing
            **reward_split(train_ts, self.history),
            **agent_rewards(self.t.agent_loras, ids, transitions, rewards),
        }

    # -------------------------------------------------------------------------- update
    def viable(self, step: int, train_ts: list[Transition], record: dict[str, Any]) -> list[Transition]:
        """The groups with enough members (``LightningRL.min_group_fraction``); the dropped ones are
        counted in ``record`` and named in a warning."""
        viable = getattr(self.t.algorithm, "viable_groups", None)
        if viable is None:
            return train_ts
        kept, groups = viable(train_ts)
        dropped = groups.pop("dropped_group_ids")
        if dropped:
            log.warning(
                "agl trainer: step %d: %d group(s) dropped, too few members counted (min_group_fraction): %s",
                step,
                len(dropped),
                ", ".join(dropped[:5]) + (" ..." if len(dropped) > 5 else ""),
            )
        record.update(groups)
        return kept

    def update(self, train_ts: list[Transition], *, on_policy: bool = True) -> dict[str, Any]:
        """Advantages and one policy update over a step's transitions; returns their metrics.
        ``on_policy=False`` (older weights served some calls) skips the on-policy ratio check."""
        t = self.t
        if not train_ts:
            return {}
        if not t.behaviour_logprobs:
            train_ts = [x.model_copy(update={"response_logprobs": None}) for x in train_ts]
        # GRPO groups per agent with a LoRA per agent (each agent's weights are compared alone); an
        # agent the step leaves without spread is compared with its own last steps (the records' returns)
        per_agent: dict[str, Any] = {}
        if t.agent_loras:
            window = getattr(t.algorithm, "running_window", 0)
            per_agent = {
                "per_agent": True,
                "prior": prior_from_history(t.history, window) if window else None,
            }
        advantages, adv_stats = t.algorithm.compute_advantages(train_ts, **per_agent)
        # decoupled PPO when asked for, and always under mixed precision: the engine's log-probs are
        # not the autocast update's (bf16 rounding differs with every shape), so the ratio is taken
        # against the update's own log-probs and the mismatch is a bounded weight, not a clip
        precision = getattr(t.policy, "precision", "no")
        # likewise for an engine whose numerics are not the policy's (vLLM, or the embedded engine in
        # another dtype): the run environment knows which engine serves
        engine = t.env.engine_differs(t.policy) if t.behaviour_logprobs else None
        decoupled = t.loop.off_policy == "tis" or precision != "no" or engine is not None
        tis = {"tis_cap": t.loop.tis_cap} if decoupled else {}
        update = t.policy.step(train_ts, advantages, **tis)
        if on_policy:
            t.checks.on_policy(
                update.get("behaviour_ratio_dev"), t.config, precision, decoupled, engine=engine
            )
        # the update's metrics under their final names (PolicyUpdate.step names them for the record)
        # with an adapter per agent: which baseline each agent got (step: all its calls in the step,
        # alone or against its last steps; task: against its task groups' rollouts) and its returns,
        # which later steps' running baseline pools
        baselines: dict[str, float] = {}
        for agent, rule in adv_stats.get("agent_baselines", {}).items():
            baselines[f"step_baseline/{agent}"] = float(rule in ("step", "running"))
            baselines[f"running_baseline/{agent}"] = float(rule == "running")
            baselines[f"task_baseline/{agent}"] = float(rule == "task")
        for agent, (n, mu, std) in adv_stats.get("agent_returns", {}).items():
            baselines.update({f"return_n/{agent}": n, f"return_mean/{agent}": mu, f"return_std/{agent}": std})
        return {
            "zero_variance_groups": adv_stats["zero_variance_groups"],
            "groups": adv_stats["groups"],
            **baselines,
            **update,
        }

    # ------------------------------------------------------------------- checkpoint, state
    def checkpoint(self, order: TaskOrder, extra: dict[str, Any] | None = None) -> None:
        """Save the policy, then the run's state (the task order and ``extra``) atomically."""
        path = self.t.policy.save_checkpoint()
        # which loop step the folder holds (its name counts updates; a step without one adds none),
        # so `agl export model --step/--best` finds the held-out check of these weights
        done = (extra or {}).get("next_step")
        marker = {"step": done, "update_step": self.t.policy.global_step}
        (Path(path) / CHECKPOINT_FILE).write_text(json.dumps(marker))
        for card in Path(path).glob("**/README.md"):  # peft's blank template ("More Information Needed")
            card.unlink()
        state = {
            "checkpoint": str(Path(path).resolve()),
            "step": self.t.policy.global_step,
            **order.state(),
            **(extra or {}),
        }
        write_state(self.t.run_dir, state)

    def state(self) -> dict[str, Any] | None:
        """The saved state to resume from: None unless ``resume=True`` and a checkpoint exists."""
        return read_state(self.t.run_dir) if self.t.loop.resume else None

    def restore(self, state: dict[str, Any], order: TaskOrder) -> tuple[int, int]:
        """Reload the checkpoint ``state`` names into the policy and the task order; drop the metrics of
        steps after it (their updates died with the process). Returns (the policy's update step, the
        step to continue from)."""
        global_step = self.t.policy.load_checkpoint(state["checkpoint"])
        start = int(state.get("next_step", global_step))
        order.restore(state)
        self.t.metrics.load()
        self.t.metrics.truncate(start)
        return global_step, start

    def cancel_live(self, keep: Any = None) -> None:
        """Cancel the rollouts a crashed run left queued or running, except those ``keep(rollout)``
        says the schedule picks up again."""
        live = self.store.query_rollouts(status=["queued", "running"])
        cancel_rollouts(self.store, [r.id for r in live if keep is None or not keep(r)])


def agent_rewards(
    agent_loras: Mapping[str, str],
    ids: Sequence[str],
    transitions: Mapping[str, list[Transition]],
    rewards: Mapping[str, float],
) -> dict[str, float]:
    """With a LoRA per agent (``{agent: LoRA name}``): ``train_reward/<lora>``, the mean reward of the
    rollouts among ``ids`` in which that agent made a trained call."""
    out: dict[str, float] = {}
    for agent, name in agent_loras.items():
        seen = [
            rewards[r] for r in ids if r in rewards and any(t.agent == agent for t in transitions.get(r, []))
        ]
        if seen:
            out[f"train_reward/{name}"] = float(sum(seen) / len(seen))
    return out
