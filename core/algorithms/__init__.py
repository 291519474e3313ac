"""Training algorithms. :mod:`agl.algorithms.lightning_rl` is pure Python (credit assignment and
advantages); the torch/TRL policy update in ``agl.algorithms.update`` is imported only by the trainer,
so ``import agl.algorithms`` never pulls in torch."""

from __future__ import annotations

from agl.algorithms.lightning_rl import (
    GroupStats,
    LightningRL,
    assign_credit,
    compute_advantages,
    credit_returns,
    group_statistics,
)

__all__ = [
    "GroupStats",
    "LightningRL",
    "assign_credit",
    "compute_advantages",
    "credit_returns",
    "group_statistics",
]
