"""Credit assignment (DESIGN §8): a rollout's rewards → the credited return of each of its LLM calls.

A rollout ``i`` has one final reward ``R_i`` and, on its transitions ``j = 1..n_i`` (in call order),
intermediate rewards ``r_ij`` (the ones the agent emitted plus AIR's, :mod:`agl.adapter.air_rules`).
The **credited return** ``G_ij`` is what call ``j`` is credited with, under one of two rules
(:data:`CREDITS`):

- ``identical``  : ``G_ij = R_i + r_ij`` (``G_ij = R_i``, the paper's rule, with
  ``include_intermediate=False`` or when there are no intermediate rewards);
- ``discounted`` : ``G_ij = r_ij + gamma * G_i,j+1`` with ``G_i,n_i+1 = R_i``.

``Transition.reward`` holds ``G_ij`` (a credited return, not a raw reward; the field keeps its name):
the adapter credits each rollout once, when it builds the transitions (:meth:`agl.Adapter.returns`),
the trainer's reward assembly credits a judge-rescored rollout again with the same rule
(:mod:`agl.trainer.rewarding`), and LightningRL normalises those returns into advantages
(:mod:`agl.algorithms.lightning_rl`), or recomputes them here when asked to. This module is the one
implementation all three call, and :func:`check_credit` the one check of a rule's name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

from agl.errors import UsageError

if TYPE_CHECKING:
    from agl.types import Transition

__all__ = ["CREDITS", "Credit", "check_credit", "credit_returns", "credit_transitions", "rollout_positions"]

#: a credit rule's name: ``identical`` (``G_j = R + r_j``) or ``discounted`` (``G_j = r_j + gamma * G_j+1``)
Credit = Literal["identical", "discounted"]
#: the credit rules, in the order they are documented
CREDITS: tuple[str, ...] = get_args(Credit)


def check_credit(credit: Any, where: str = "credit") -> str:
    """``credit`` when it names a rule of :data:`CREDITS`, else a UsageError naming ``where``."""
    if credit not in CREDITS:
        raise UsageError(f"{where} must be one of {', '.join(CREDITS)}, got {credit!r}")
    return str(credit)


def _rule(credit: Any, gamma: float) -> tuple[str, float]:
    """The rule's name and discount: from a name (None: ``identical``) or from a configuration that has
    ``.credit`` and ``.gamma`` (a :class:`agl.algorithms.LightningRL`)."""
    if credit is None:
        return "identical", gamma
    if isinstance(credit, str):
        return check_credit(credit), gamma
    return check_credit(credit.credit), float(credit.gamma)


def credit_returns(
    final_reward: float,
    intermediate: Sequence[float],
    credit: Any = "identical",
    gamma: float = 1.0,
    *,
    include_intermediate: bool = True,
) -> list[float]:
    """The credited return ``G_j`` of each transition of ONE rollout, in call order.

    ``intermediate[j]`` is the intermediate reward of the rollout's j-th transition (0 when none).
    ``credit`` is a rule name (:data:`CREDITS`) with its ``gamma``, or a configuration that has
    ``.credit`` and ``.gamma`` (a :class:`agl.algorithms.LightningRL`; None for the defaults). With
    ``include_intermediate=False`` intermediate rewards are ignored (the paper's identical rule).
    """
    rule, gamma = _rule(credit, gamma)
    big_r = float(final_reward)
    if not include_intermediate:
        intermediate = [0.0] * len(intermediate)
    if rule == "identical":
        return [big_r + float(r) for r in intermediate]
    g, out = big_r, [0.0] * len(intermediate)
    for j in range(len(intermediate) - 1, -1, -1):
        g = float(intermediate[j]) + float(gamma) * g
        out[j] = g
    return out


def rollout_positions(transitions: Sequence[Transition]) -> dict[tuple[str, int], list[int]]:
    """Positions of each rollout attempt's transitions, in call (``index``) order. A rollout attempt
    has one final reward and one group, and each of its calls appears once: anything else is a
    UsageError, since its returns could not be credited."""
    groups: dict[tuple[str, int], list[int]] = {}
    for pos, t in enumerate(transitions):
        groups.setdefault((t.rollout_id, t.attempt), []).append(pos)
    for (rid, att), positions in groups.items():
        positions.sort(key=lambda p: transitions[p].index)
        seen: set[int] = set()
        first = transitions[positions[0]]
        for p in positions:
            t = transitions[p]
            if t.index in seen:
                raise UsageError(
                    f"rollout {rid!r} attempt {att} has two transitions with index {t.index}; "
                    "each LLM call must appear once"
                )
            seen.add(t.index)
            if t.final_reward != first.final_reward:
                raise UsageError(
                    f"rollout {rid!r} attempt {att} has transitions with different final rewards "
                    f"({first.final_reward!r} and {t.final_reward!r}); a rollout has one final reward"
                )
            if t.group_id != first.group_id:
                raise UsageError(
                    f"rollout {rid!r} attempt {att} has transitions in different groups "
                    f"({first.group_id!r} and {t.group_id!r})"
                )
    return groups


def credit_transitions(
    transitions: Sequence[Transition],
    credit: Any = "identical",
    gamma: float = 1.0,
    *,
    include_intermediate: bool | None = True,
) -> tuple[list[float], dict[tuple[str, int], list[int]]]:
    """Each transition's credited return (same order), by :func:`credit_returns` over each rollout
    attempt, and the positions of each attempt's transitions (:func:`rollout_positions`).
    ``include_intermediate=None`` takes the returns already on the transitions (``Transition.reward``,
    as the adapter credited them) instead of crediting them again."""
    by_rollout = rollout_positions(transitions)
    if include_intermediate is None:
        return [t.reward for t in transitions], by_rollout
    returns = [0.0] * len(transitions)
    for positions in by_rollout.values():
        ts = [transitions[p] for p in positions]
        g = credit_returns(
            ts[0].final_reward,
            [t.intermediate_reward for t in ts],
            credit,
            gamma,
            include_intermediate=include_intermediate,
        )
        for p, value in zip(positions, g, strict=True):
            returns[p] = value
    return returns, by_rollout
