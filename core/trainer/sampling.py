"""Dynamic sampling (DAPO, Yu et al. 2025): more rounds of fresh tasks while a step's groups teach nothing.

A group whose rollouts all score the same has zero advantage; a step of such groups is a wasted update.
:func:`resample` draws fresh tasks for up to ``LoopConfig.dynamic_sampling`` extra rounds, as many as
the informative rate so far says are needed, until ``want`` groups have any reward variance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from agl.types import Rollout, Task, Transition

if TYPE_CHECKING:
    from agl.trainer.steps import Steps

__all__ = ["informative_groups", "resample"]


def informative_groups(
    ids: Sequence[str], transitions: dict[str, list[Transition]], algorithm: Any
) -> tuple[list[str], int]:
    """The groups among ``ids``' rollouts whose rewards differ (in the order drawn), and how many
    groups there are: the statistic the advantages use, so "informative" means a gradient."""
    from agl.algorithms.lightning_rl import group_statistics

    stats = group_statistics([t for rid in ids for t in transitions.get(rid, [])], algorithm)
    return [gid for gid, gs in stats.items() if not gs.zero_variance], len(stats)


def resample(
    steps: Steps,
    algorithm: Any,
    rounds_max: int,
    step: int,
    want: int,
    version: int,
    ids: list[str],
    transitions: dict[str, list[Transition]],
    rewards: dict[str, float],
    finished: list[Rollout],
    bar: Any,
    draw: Callable[[int], list[Task]],
) -> tuple[list[str], dict[str, Any]]:
    """Up to ``rounds_max`` rounds of ``draw(k)`` fresh tasks, enqueued on ``version`` and collected into ``transitions``,
    ``rewards`` and ``finished`` (updated in place). Returns every training rollout id and the sampling
    metrics, with the groups to train on (``kept_groups``)."""
    informative, n_groups = informative_groups(ids, transitions, algorithm)
    rounds = 0
    while len(informative) < want and rounds < rounds_max:
        rounds += 1
        rate = max(len(informative), 1) / max(n_groups, 1)
        k = min(want, math.ceil((want - len(informative)) / rate))
        more = steps.enqueue(draw(k), version, step, algorithm.group_size, group_suffix=f"r{rounds}")
        new_ts, new_rewards, new_finished = steps.collect(more, bar, f"step {step} round {rounds}")
        transitions.update(new_ts)
        rewards.update(new_rewards)
        finished.extend(new_finished)
        ids = ids + more
        informative, n_groups = informative_groups(ids, transitions, algorithm)
    return ids, {
        "kept_groups": informative[:want],
        "groups": n_groups,
        "zero_variance_groups": n_groups - len(informative),
        "trained_groups": len(informative[:want]),
        "resample_rounds": rounds,
    }
