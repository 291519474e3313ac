"""The held-out check's decoding: how its rollouts are decoded and what its figures say.

One setting, ``LoopConfig.val_samples``, written once here for both schedules:

- ``0`` (the default): **greedy**. One rollout per held-out task, every call of it decoded at
  temperature 0 whatever the program asks (the rollout's metadata carries
  :data:`agl.semconv.ROLLOUT_TEMPERATURE_KEY`, which the gateway forces, :mod:`agl.gateway.seeds`).
  Deployed agents and benchmarks are scored this way, and a greedy figure does not move with the draw:
  a sampled one of 20 tasks at temperature 1.0 can read 0.05 for a model that answers 13 of them
  greedily. The gateway reads the temperature from the run's store, as it reads the rollout's seed: an
  external gateway started without the store cannot, and serves what the program asks (its spans then
  lack ``agl.llm.temperature_source``).
- ``K >= 1``: **sampled**. K rollouts per task at the run's own sampling (``RunConfig.temperature``);
  ``val_reward`` is the mean over all K x tasks rollouts and ``val_pass_at_k`` the mean over tasks of
  the best of their K rewards (pass@K for 0/1 rewards). ``val_samples=1`` is the check as it was before
  this setting existed.

Every check's record says which (``val_decoding``: ``"greedy"`` or ``"sampled"``, ``val_samples``), and
so do the run's summary, its plot and its trackers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agl import semconv as sc
from agl.types import Task

if TYPE_CHECKING:
    from agl.trainer.steps import Steps

__all__ = ["GREEDY_TEMPERATURE", "decoding", "enqueue_held_out", "held_out_record"]

#: the temperature a greedy held-out rollout's calls are decoded at
GREEDY_TEMPERATURE = 0.0


def decoding(val_samples: int) -> str:
    """``"greedy"`` for ``val_samples == 0``, else ``"sampled"``."""
    return "greedy" if val_samples == 0 else "sampled"


def enqueue_held_out(
    steps: Steps, tasks: Sequence[Task], version: int, step: int, val_samples: int
) -> list[str]:
    """The held-out rollouts of one check, pinned to ``version``: one greedy rollout per task, or
    ``val_samples`` sampled ones (task-major: task i's are ``ids[i*k:(i+1)*k]``)."""
    if val_samples == 0:
        return steps.enqueue(tasks, version, step, 1, extra={sc.ROLLOUT_TEMPERATURE_KEY: GREEDY_TEMPERATURE})
    return steps.enqueue(tasks, version, step, val_samples)


def held_out_record(
    ids: Sequence[str], rewards: dict[str, float], n_tasks: int, val_samples: int
) -> dict[str, Any]:
    """A check's metrics: ``val_reward`` (the mean over the rollouts with a reward), ``val_rollouts``,
    ``val_tasks``, ``val_decoding``, ``val_samples`` and, sampled, ``val_pass_at_k`` (over the tasks with
    at least one reward)."""
    k = max(val_samples, 1)
    got = [rewards[r] for r in ids if r in rewards]
    record: dict[str, Any] = {
        "val_reward": float(sum(got) / len(got)) if got else None,
        "val_rollouts": len(got),
        "val_tasks": n_tasks,
        "val_decoding": decoding(val_samples),
        "val_samples": k,
    }
    if val_samples:
        best = [
            max(rs)
            for i in range(0, len(ids), k)
            if (rs := [rewards[r] for r in ids[i : i + k] if r in rewards])
        ]
        record["val_pass_at_k"] = float(sum(best) / len(best)) if best else None
    return record
