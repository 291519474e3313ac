"""Groups that know their size: a GRPO group is trained only when enough of its members count.

A member that failed on the infrastructure (``failure_kind == "infra"``) or finished without a reward
while no default reward was asked for reaches no update (:meth:`agl.trainer.steps.Steps.adapt` leaves it
out): its zero would be no verdict. What remains of a group is its *effective* size; a group whose
effective size is under ``LightningRL.min_group_fraction`` of ``group_size`` is dropped whole — never
trained against a baseline of a few survivors — and counted in ``dropped_groups``. A member counts when
its rollout reached the update: it ended ``task`` (a reward, good or bad), ``agent`` (its own code
failed: AIR penalises the call that caused it) or ``no_reward`` with ``Adapter(missing_reward=...)`` set.

Branch groups (:mod:`agl.trainer.branching`) and transitions without a group are left as they are: their
size is not ``group_size``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from agl import semconv as sc
from agl.types import Transition

__all__ = ["viable_groups"]


def viable_groups(
    transitions: Sequence[Transition], group_size: int, min_fraction: float
) -> tuple[list[Transition], dict[str, Any]]:
    """The transitions of the groups with at least ``ceil(min_fraction * group_size)`` members (distinct
    rollouts), in the given order, and the step's figures: ``effective_group_size`` (mean over the
    groups), ``effective_group_size_min``, ``dropped_groups`` and ``dropped_group_ids``."""
    members: dict[str, set[str]] = {}
    for t in transitions:
        if t.group_id is not None and sc.BRANCH_GROUP_MARK not in t.group_id:
            members.setdefault(t.group_id, set()).add(t.rollout_id)
    floor = max(1, math.ceil(min_fraction * group_size - 1e-9)) if min_fraction > 0 else 0
    dropped = sorted(g for g, rs in members.items() if len(rs) < floor)
    sizes = [len(rs) for rs in members.values()]
    gone = set(dropped)
    kept = [t for t in transitions if t.group_id not in gone]
    return kept, {
        "effective_group_size": (sum(sizes) / len(sizes)) if sizes else None,
        "effective_group_size_min": min(sizes) if sizes else None,
        "dropped_groups": len(dropped),
        "dropped_group_ids": dropped,
    }
