"""``TaskOrder``: which training tasks each step of a run takes.

Every task once per shuffled pass, from a seeded RNG whose state is saved with a checkpoint, so a
resumed run draws the same tasks the uninterrupted run would have.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["TaskOrder"]


class TaskOrder:
    """Which training tasks each step takes: every task once per shuffled pass, seeded, resumable."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.rng = random.Random(seed)
        self.order: list[int] = []

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if not self.order:
                self.order = list(range(self.n))
                self.rng.shuffle(self.order)
            out.append(self.order.pop())
        return out

    def state(self) -> dict[str, Any]:
        return {"order": list(self.order), "rng": _rng_json(self.rng.getstate())}

    def restore(self, state: dict[str, Any]) -> None:
        self.order = list(state.get("order", []))
        self.rng.setstate(_rng_state(state["rng"]))


def _rng_json(state: Any) -> Any:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_state(data: Any) -> Any:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)
