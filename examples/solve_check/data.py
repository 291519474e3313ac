"""learn_on_cpu's arithmetic tasks, each with a proposed answer for the checker to judge.

Each task is learn_on_cpu's ``{"question", "expression", "answer"}`` plus ``"proposal"``: the right
answer for half the tasks and a near miss (off by 1, 2 or 10, either way) for the other half, drawn
from a generator seeded by the expression, so a task's proposal never changes between runs.
"""

from __future__ import annotations

import random
from typing import Any

from examples.learn_on_cpu.data import split as arithmetic_split

__all__ = ["propose", "split"]

_MISSES = (-10, -2, -1, 1, 2, 10)


def propose(task: dict[str, Any]) -> dict[str, Any]:
    """``task`` with its proposal: right or a near miss, half and half, fixed by its expression."""
    rng = random.Random(f"solve_check:{task['expression']}")
    right = rng.random() < 0.5
    proposal = task["answer"] if right else task["answer"] + rng.choice(_MISSES)
    return {**task, "proposal": proposal}


def split(n_train: int = 200, n_val: int = 24) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """learn_on_cpu's disjoint train and held-out questions, with proposals."""
    train, val = arithmetic_split(n_train=n_train, n_val=n_val)
    return [propose(t) for t in train], [propose(t) for t in val]
