"""Candidates and the beam: which prompt sets APO keeps, and which failures it shows the optimiser.

A :class:`Candidate` is one set of prompts (the initial one, ``c0``, or a rewrite of a beam member).
The beam after a round is the ``beam_width`` best of the old beam and the new children by mean
validation reward, ties going to the older candidate, so a rewrite must score strictly higher to
displace its parent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from agl.tracing.prompts import prompt_version
from agl.types import Rollout, Task

__all__ = ["Candidate", "Failure", "mean", "pick_failures", "select_beam"]

#: a training task a candidate failed: the task, its rollout, its reward
Failure = tuple[Task, Rollout, float]


@dataclass
class Candidate:
    """One set of prompts under evaluation: the initial prompts or a rewrite of a beam member."""

    id: str
    prompts: dict[str, str]
    round: int
    resources_version: int = 0
    parent: str | None = None
    edited: str | None = None  #: the prompt name this candidate rewrote (None for the initial one)
    critique: str | None = None
    val_reward: float | None = None
    val_rollouts: int = 0
    train_rewards: list[float] = field(default_factory=list)

    @property
    def versions(self) -> dict[str, str]:
        """Each prompt's content version (what the rollouts' ``agl.prompt`` spans record)."""
        return {name: prompt_version(text) for name, text in self.prompts.items()}

    @property
    def key(self) -> tuple[tuple[str, str], ...]:
        """Identity by content: two candidates with the same prompts are the same candidate."""
        return tuple(sorted(self.versions.items()))

    def record(self) -> dict[str, Any]:
        """The candidate as one line of ``candidates.jsonl``."""
        out = asdict(self)
        out["versions"] = self.versions
        return out


def mean(xs: Sequence[float]) -> float | None:
    """The mean, or None for no values (a candidate that ran nothing has no score, not zero)."""
    return float(sum(xs) / len(xs)) if xs else None


def select_beam(pool: Sequence[Candidate], width: int, age: dict[str, int]) -> list[Candidate]:
    """The ``width`` best of ``pool`` by validation reward; ``age`` (candidate id -> creation
    order) breaks ties in favour of the older candidate; unscored candidates rank last."""
    ranked = sorted(
        pool,
        key=lambda c: (-(c.val_reward if c.val_reward is not None else -math.inf), age[c.id]),
    )
    return ranked[:width]


def pick_failures(
    results: Sequence[tuple[Task, Rollout, float]], failure_below: float, limit: int
) -> list[Failure]:
    """The rollouts to critique: reward below ``failure_below`` or not succeeded, worst first."""
    failed = [m for m in results if m[2] < failure_below or m[1].status != "succeeded"]
    return sorted(failed, key=lambda m: m[2])[:limit]
