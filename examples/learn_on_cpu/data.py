"""Arithmetic tasks whose gold answers are certainly right (computed, never written by hand).

Each task is ``{"question": "What is 7 * 4 + 9?", "expression": "7 * 4 + 9", "answer": 37}``. Train
and held-out sets come from disjoint seeds and are de-duplicated against each other.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["make_tasks", "split"]

_TEMPLATES = ("{a} * {b} + {c}", "{a} * {b} - {c}", "{a} + {b} * {c}", "({a} + {b}) * {c}")


def _evaluate(expression: str) -> int:
    from examples.learn_on_cpu.agent import calculate

    return int(calculate(expression))


def make_tasks(n: int, seed: int, exclude: set[str] | None = None) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    seen = set(exclude or ())
    out: list[dict[str, Any]] = []
    while len(out) < n:
        expr = rng.choice(_TEMPLATES).format(a=rng.randint(2, 12), b=rng.randint(2, 12), c=rng.randint(2, 30))
        if expr in seen:
            continue
        seen.add(expr)
        out.append({"question": f"What is {expr}?", "expression": expr, "answer": _evaluate(expr)})
    return out


def split(n_train: int = 200, n_val: int = 32) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Held-out tasks first (fixed seed), then training tasks that never repeat a held-out one."""
    val = make_tasks(n_val, seed=10_000)
    train = make_tasks(n_train, seed=20_000, exclude={t["expression"] for t in val})
    return train, val
