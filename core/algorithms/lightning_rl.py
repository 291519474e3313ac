"""LightningRL: credit assignment and group-normalised advantages (DESIGN §8).

LightningRL reduces a multi-call agent run to single-call RL: each LLM call (a :class:`Transition`)
becomes one training sequence whose tokens share one advantage. This module holds the small, exact
part of the method — the credit rule's configuration and from returns to advantages (GRPO-style group
normalisation). The returns themselves (*credit assignment*) come from :mod:`agl.adapter.credit`, the
one implementation the adapter and the trainer's reward assembly use too. It is pure Python so it can
be checked by hand values and run anywhere; the torch/TRL policy update lives in
:mod:`agl.algorithms.update` and only the trainer imports it.

Notation, for the rollouts ``i`` of one group, their transitions ``j = 1..n_i`` in call order, final
reward ``R_i`` and intermediate rewards ``r_ij``:

- ``identical``  : ``G_ij = R_i + r_ij``  (``G_ij = R_i``, the paper's rule, with
  ``include_intermediate=False`` or when there are no intermediate rewards)
- ``discounted`` : ``G_ij = r_ij + gamma * G_i,j+1`` with ``G_i,n_i+1 = R_i``
- ``rollout`` advantages : ``A_ij = (G_ij - mean_i R_i) / (std_i R_i + eps)``
- ``transition`` advantages : ``A_ij = (G_ij - mean_kl G_kl) / (std_kl G_kl + eps)``

``std`` is the sample standard deviation (n-1, as TRL's GRPO uses), ``eps = 1e-6``, and without
``normalize_std`` the division is dropped.

With an adapter per agent (``per_agent=True``) each agent is compared with itself. An agent that acts
in every rollout of its groups is normalised per task group as above (``agent_baseline="group"``). An
agent that acts only sometimes — a repair, fallback or critic agent that runs after a failure — has
groups that hold one or two of its calls and no spread by construction — or, where it ran in every
rollout of one hard task and in none of the others, one whole group that failed alike (a branch group, K continuations
at one of its calls from :mod:`agl.trainer.branching`, is compared within itself on the agent's
credited returns, as below), so under
``agent_baseline="auto"`` (the default) it is normalised over all of its calls in the step instead
(``"step"``; for the whole-but-flat case too, while an agent acting in every rollout of the step
keeps its task groups): ``A_ij = (G_ij - mean G) / (std G + eps)`` over that agent's credited returns ``G``,
intermediate rewards included (its own outcome: AIR's penalty on a failed query it wrote, or a reward
the app emits for it). Mixing tasks in one baseline is the price; it is paid only by agents whose task
groups cannot carry a signal. When even the step leaves such an agent no spread (one call, or all of
its calls scored alike: every repair failed the same way), ``"auto"`` compares its calls with its own
earlier steps instead (``"running"``): ``A_ij = (G_ij - m) / (s + eps)`` with ``m``, ``s`` the mean
and std of its credited returns pooled over its last ``running_window`` steps (``prior``, which the
trainer reads from the run's metrics, so a resumed run has the same; ``running_window=0``: no fallback). A step of failed repairs then
pushes the agent away from them, where the step alone would have left it untouched. Where it has no
such history either (a run's first step), its calls are compared with every rollout of their task
groups, all agents' returns (``"task"``: what a shared policy gives them), so a failed repair in a
group where other rollouts succeeded still gets a negative update. The rule each agent
got is reported per step (``agent_baselines``). A group whose statistic has no spread (fewer than two
values, or a std below ``ZERO_STD``) carries no learning signal: all its advantages are 0 and it is
counted in ``zero_variance_groups``. docs/architecture.md §8 works through examples by hand.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal

from agl.adapter.credit import Credit, check_credit, credit_returns, credit_transitions
from agl.config import UpdateSettings, check_number
from agl.errors import UsageError
from agl.semconv import BRANCH_GROUP_MARK

if TYPE_CHECKING:
    from agl.types import Transition

__all__ = [
    "EPS",
    "ZERO_STD",
    "GroupStats",
    "LightningRL",
    "agent_baseline",
    "assign_credit",
    "compute_advantages",
    "credit_returns",
    "group_statistics",
    "iter_groups",
    "prior_from_history",
]

#: Added to the std before dividing, so tiny-but-nonzero spreads do not explode.
EPS = 1e-6
#: A std below this is treated as zero: the group has no signal.
ZERO_STD = 1e-9
#: Steps an agent's running baseline pools by default (``LightningRL.running_window``).
RUNNING_WINDOW = 4

AdvantageLevel = Literal["rollout", "transition"]
AgentBaseline = Literal["auto", "group", "step"]


@dataclass
class LightningRL(UpdateSettings):
    """The LightningRL configuration: credit assignment, advantages and the policy-update settings.

    Only ``credit``, ``gamma``, ``advantage_level``, ``normalize_std`` and ``group_size`` are used
    here; the update fields (and their defaults) come from :class:`agl.config.UpdateSettings` and
    configure the token-level PPO-clip update in :mod:`agl.algorithms.update`.
    """

    credit: Credit = field(
        default="identical",
        metadata={"help": "credit assignment: every call gets the final return, or discounted per call"},
    )
    gamma: float = field(default=1.0, metadata={"help": "discount of the 'discounted' credit"})
    advantage_level: AdvantageLevel = field(
        default="rollout", metadata={"help": "GRPO's baseline over rollouts or over transitions"}
    )
    normalize_std: bool = field(default=True, metadata={"help": "divide advantages by the group's std"})
    group_size: int = field(default=4, metadata={"help": "rollouts per task: the GRPO group"})
    agent_baseline: AgentBaseline = field(
        default="auto",
        metadata={
            "help": "with an adapter per agent, what an agent's calls are compared with: its task groups "
            "('group'), all its calls in the step ('step'), or 'auto': 'group' for an agent that acts in "
            "every rollout, 'step' for one that acts only sometimes, and its own last steps ('running') "
            "when the step leaves it no spread"
        },
    )
    running_window: int = field(
        default=RUNNING_WINDOW,
        metadata={
            "help": "under agent_baseline='auto': the last N steps of its own an agent's calls are compared "
            "with when the step leaves them no spread (0: none, they train nothing that step)"
        },
    )

    def __post_init__(self) -> None:
        check_credit(self.credit, "LightningRL.credit")
        if self.advantage_level not in ("rollout", "transition"):
            raise UsageError(
                f"LightningRL.advantage_level must be 'rollout' or 'transition', got {self.advantage_level!r}"
            )
        if self.agent_baseline not in ("auto", "group", "step"):
            raise UsageError(
                f"LightningRL.agent_baseline must be 'auto', 'group' or 'step', got {self.agent_baseline!r}"
            )
        check_number("LightningRL", "gamma", self.gamma, lo=0.0, hi=1.0)
        value = self.group_size
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"LightningRL.group_size must be an integer >= 1, got {value!r}")
        window = self.running_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise UsageError(f"LightningRL.running_window must be an integer >= 0, got {window!r}")
        if not isinstance(self.normalize_std, bool):
            raise UsageError(f"LightningRL.normalize_std must be True or False, got {self.normalize_std!r}")
        self._validate_update("LightningRL")

    # Convenience: the same pure functions, bound to this configuration.
    def assign_credit(
        self, transitions: Sequence[Transition], *, include_intermediate: bool = True
    ) -> list[Transition]:
        return assign_credit(transitions, self, include_intermediate=include_intermediate)

    def compute_advantages(
        self,
        transitions: Sequence[Transition],
        *,
        include_intermediate: bool | None = None,
        per_agent: bool = False,
        prior: Mapping[str, tuple[float, float]] | None = None,
    ) -> tuple[list[float], dict[str, Any]]:
        """Advantages from the returns the adapter already credited (``Transition.reward``: an
        ``Adapter(algorithm=self)`` credits them under this configuration), not credited again. Pass
        ``include_intermediate=True``/``False`` to recompute them from ``final_reward`` and
        ``intermediate_reward`` instead (see :func:`compute_advantages`)."""
        return compute_advantages(
            transitions, self, include_intermediate=include_intermediate, per_agent=per_agent, prior=prior
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ------------------------------------------------------------------------------------ credit


def assign_credit(
    transitions: Sequence[Transition],
    cfg: LightningRL | None = None,
    *,
    include_intermediate: bool = True,
) -> list[Transition]:
    """Copies of ``transitions`` (same order) whose ``reward`` is the credited return ``G_ij``
    (:func:`agl.adapter.credit.credit_transitions` under ``cfg``'s rule).

    Transitions are grouped by ``(rollout_id, attempt)`` and ordered by ``index``; ``final_reward`` and
    ``intermediate_reward`` are the inputs, nothing else is read.
    """
    returns, _ = credit_transitions(transitions, cfg or _DEFAULT, include_intermediate=include_intermediate)
    return [t.model_copy(update={"reward": g}) for t, g in zip(transitions, returns, strict=True)]


# ------------------------------------------------------------------------------------ advantages


@dataclass(frozen=True)
class GroupStats:
    """The statistic a group is normalised by, and whether it carries any signal."""

    group_id: str
    rollouts: int
    transitions: int
    mean: float
    std: float
    zero_variance: bool
    final_reward_mean: float
    #: "group" (one task's rollouts), "step" (all of one agent's calls in the step), "running" (those
    #: calls against the agent's last steps), "task" (its calls against every rollout of their task
    #: groups, all agents' returns) or "branch" (one agent's calls in the K continuations of one of its
    #: calls: agl.trainer.branching)
    baseline: str = "group"
    #: the agent whose calls these are, with an adapter per agent
    agent: str | None = None


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    if n == 0:
        return 0.0, 0.0
    mean = math.fsum(values) / n
    if n < 2:
        return mean, 0.0
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var)


def _group_key(t: Transition) -> str:
    # A rollout with no group is compared with nothing: it forms a group of its own.
    return t.group_id if t.group_id is not None else f"rollout:{t.rollout_id}#{t.attempt}"


def _statistics(
    transitions: Sequence[Transition],
    returns: Sequence[float],
    by_rollout: dict[tuple[str, int], list[int]],
    cfg: LightningRL,
) -> tuple[dict[str, GroupStats], dict[str, list[int]]]:
    members: dict[str, list[tuple[str, int]]] = {}
    for key, positions in by_rollout.items():
        members.setdefault(_group_key(transitions[positions[0]]), []).append(key)
    stats: dict[str, GroupStats] = {}
    positions_of: dict[str, list[int]] = {}
    for gid, keys in members.items():
        positions = [p for k in keys for p in by_rollout[k]]
        finals = [transitions[by_rollout[k][0]].final_reward for k in keys]
        if cfg.advantage_level == "rollout":
            mean, std = _mean_std(finals)
            n_values = len(finals)
        else:
            mean, std = _mean_std([returns[p] for p in positions])
            n_values = len(positions)
        stats[gid] = GroupStats(
            group_id=gid,
            rollouts=len(keys),
            transitions=len(positions),
            mean=mean,
            std=std,
            zero_variance=n_values < 2 or std < ZERO_STD,
            final_reward_mean=math.fsum(finals) / len(finals),
        )
        positions_of[gid] = positions
    return stats, positions_of


def _agent_statistics(
    transitions: Sequence[Transition],
    returns: Sequence[float],
    by_rollout: dict[tuple[str, int], list[int]],
    cfg: LightningRL,
    prior: Mapping[str, tuple[float, float]] | None = None,
) -> tuple[dict[str, GroupStats], dict[str, list[int]]]:
    """:func:`_statistics` per agent: groups keyed ``<group>@<agent>``, each over the agent's calls in
    the group's rollouts (a rollout in which the agent made no call is not in its group); or, for an
    agent under the ``"step"`` baseline (:func:`agent_baseline`), one group ``step@<agent>`` over all
    of its calls in the step — against ``prior[agent]`` (mean, std of its earlier steps) under
    ``"auto"`` when the step gives them no spread."""
    parts: dict[str, dict[tuple[str, int], list[int]]] = {}
    for key, positions in by_rollout.items():
        for p in positions:
            parts.setdefault(transitions[p].agent or "", {}).setdefault(key, []).append(p)
    sizes: dict[str, int] = {}
    for positions in by_rollout.values():
        gid = _group_key(transitions[positions[0]])
        sizes[gid] = sizes.get(gid, 0) + 1
    stats: dict[str, GroupStats] = {}
    positions_of: dict[str, list[int]] = {}
    for agent, whole in parts.items():
        # a branch group's members share the agent's prompt (agl.trainer.branching): compared together,
        # on the agent's credited returns (its own outcome, as under the step baseline)
        branches: dict[str, dict[tuple[str, int], list[int]]] = {}
        for k, ps in whole.items():
            if _is_branch(transitions[ps[0]]):
                branches.setdefault(_group_key(transitions[ps[0]]), {})[k] = ps
        for gid, members in branches.items():
            key = f"{gid}@{agent}"
            gs, positions_of[key] = _step_statistics(key, transitions, returns, members)
            stats[key] = replace(gs, agent=agent, baseline="branch")
        part = {k: ps for k, ps in whole.items() if not _is_branch(transitions[ps[0]])}
        if not part:
            continue
        rule = agent_baseline(cfg.agent_baseline, transitions, part, sizes)
        s, pos = _statistics(transitions, returns, part, cfg) if rule == "group" else ({}, {})
        if rule == "group" and _flat_sometimes(cfg, s, part, by_rollout, transitions):
            rule = "step"
        if rule == "step":
            key = f"step@{agent}"
            step, positions = _step_statistics(key, transitions, returns, part)
            step = _running(replace(step, agent=agent), cfg, (prior or {}).get(agent))
            # the step group, or, where it and the agent's history are flat, its task groups whole
            groups, members = _task(agent, cfg, step, transitions, returns, part, by_rollout) or (
                {key: step},
                {key: positions},
            )
            stats.update(groups)
            positions_of.update(members)
            continue
        for gid, gs in s.items():
            key = f"{gid}@{agent}"
            stats[key] = replace(gs, group_id=key, agent=agent)
            positions_of[key] = pos[gid]
    return stats, positions_of


def _flat_sometimes(
    cfg: LightningRL,
    groups: dict[str, GroupStats],
    part: dict[tuple[str, int], list[int]],
    by_rollout: dict[tuple[str, int], list[int]],
    transitions: Sequence[Transition],
) -> bool:
    """Under ``"auto"``: an agent that acted in every rollout of its task groups but not in every
    rollout of the step (a repair agent that ran in all of one hard task's rollouts) and whose groups
    all have no spread — compared over its calls in the step (and its last steps) instead, as when it
    acts in some of a group's rollouts. An agent acting in every rollout of the step keeps its groups."""
    if cfg.agent_baseline != "auto" or not all(gs.zero_variance for gs in groups.values()):
        return False
    step_rollouts = sum(1 for ps in by_rollout.values() if not _is_branch(transitions[ps[0]]))
    return len(part) < step_rollouts


def _running(step: GroupStats, cfg: LightningRL, prior: tuple[float, float] | None) -> GroupStats:
    """``step`` (an agent's calls in the step, no spread) against the agent's own earlier steps when
    ``"auto"`` falls back to them and they have a spread; else ``step`` unchanged."""
    off = cfg.agent_baseline != "auto" or cfg.running_window == 0
    if not step.zero_variance or off or prior is None or prior[1] < ZERO_STD:
        return step
    return replace(step, mean=prior[0], std=prior[1], zero_variance=False, baseline="running")


def _task(
    agent: str,
    cfg: LightningRL,
    step: GroupStats,
    transitions: Sequence[Transition],
    returns: Sequence[float],
    part: dict[tuple[str, int], list[int]],
    by_rollout: dict[tuple[str, int], list[int]],
) -> tuple[dict[str, GroupStats], dict[str, list[int]]] | None:
    """The last fallback under ``"auto"``, for an agent that neither the step nor its own last steps
    give a spread (a run's first step of failed repairs): its calls against every rollout of their
    task groups, all agents' returns (``"task"``: what a shared policy gives them; a repair in a
    failed rollout of a group where others succeeded is pushed away from). None where ``step`` has a
    spread, the rule is explicit, or the task groups are flat too (nothing to learn from)."""
    if not step.zero_variance or cfg.agent_baseline != "auto":
        return None
    mine: dict[str, list[int]] = {}
    for ps in part.values():
        mine.setdefault(_group_key(transitions[ps[0]]), []).extend(ps)
    rollouts = {
        k: ps
        for k, ps in by_rollout.items()
        if not _is_branch(transitions[ps[0]]) and _group_key(transitions[ps[0]]) in mine
    }
    whole, _ = _statistics(transitions, returns, rollouts, cfg)
    if all(gs.zero_variance for gs in whole.values()):
        return None
    stats = {
        f"{gid}@{agent}": replace(gs, group_id=f"{gid}@{agent}", agent=agent, baseline="task")
        for gid, gs in whole.items()
    }
    return stats, {f"{gid}@{agent}": mine[gid] for gid in whole}


def prior_from_history(
    history: Sequence[Mapping[str, Any]], window: int = RUNNING_WINDOW
) -> dict[str, tuple[float, float]]:
    """``{agent: (mean, std)}`` of each agent's credited returns pooled over the last ``window`` steps
    in which it acted, from the step records' ``return_n/<agent>``, ``return_mean/<agent>`` and
    ``return_std/<agent>`` (what :func:`compute_advantages` reports as ``agent_returns``); the std is
    the pooled population one."""
    seen: dict[str, list[tuple[float, float, float]]] = {}
    for record in reversed(history):
        for key, n in record.items():
            if not key.startswith("return_n/") or not n:
                continue
            agent = key.split("/", 1)[1]
            rows = seen.setdefault(agent, [])
            if len(rows) < window:
                rows.append(
                    (float(n), float(record[f"return_mean/{agent}"]), float(record[f"return_std/{agent}"]))
                )
    out: dict[str, tuple[float, float]] = {}
    for agent, rows in seen.items():
        total = math.fsum(n for n, _, _ in rows)
        mean = math.fsum(n * m for n, m, _ in rows) / total
        square = math.fsum(n * (s * s + m * m) for n, m, s in rows) / total
        out[agent] = (mean, math.sqrt(max(square - mean * mean, 0.0)))
    return out


def _agent_returns(
    transitions: Sequence[Transition], returns: Sequence[float]
) -> dict[str, tuple[int, float, float]]:
    """``{agent: (calls, mean, population std)}`` of each agent's credited returns in the step."""
    by_agent: dict[str, list[float]] = {}
    for t, g in zip(transitions, returns, strict=True):
        by_agent.setdefault(t.agent or "", []).append(g)
    out: dict[str, tuple[int, float, float]] = {}
    for agent, values in by_agent.items():
        mean = math.fsum(values) / len(values)
        out[agent] = (len(values), mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values)))
    return out


def _is_branch(t: Transition) -> bool:
    return t.group_id is not None and BRANCH_GROUP_MARK in t.group_id


def agent_baseline(
    rule: str,
    transitions: Sequence[Transition],
    part: dict[tuple[str, int], list[int]],
    group_sizes: dict[str, int],
) -> str:
    """The baseline one agent's calls get: ``rule`` unless it is ``"auto"``, which picks ``"group"``
    when the agent acted in every rollout of each of its task groups (``part``: its calls per
    rollout; ``group_sizes``: rollouts per task group in the step) and ``"step"`` otherwise."""
    if rule != "auto":
        return rule
    acted: dict[str, int] = {}
    for positions in part.values():
        gid = _group_key(transitions[positions[0]])
        acted[gid] = acted.get(gid, 0) + 1
    return "group" if all(n == group_sizes[gid] for gid, n in acted.items()) else "step"


def _step_statistics(
    key: str,
    transitions: Sequence[Transition],
    returns: Sequence[float],
    part: dict[tuple[str, int], list[int]],
) -> tuple[GroupStats, list[int]]:
    """One agent's calls in ``part`` (all of its calls in the step, or those of one branch group) as
    one group: mean/std of their credited returns."""
    positions = [p for ps in part.values() for p in ps]
    mean, std = _mean_std([returns[p] for p in positions])
    finals = [transitions[ps[0]].final_reward for ps in part.values()]
    stats = GroupStats(
        group_id=key,
        rollouts=len(part),
        transitions=len(positions),
        mean=mean,
        std=std,
        zero_variance=len(positions) < 2 or std < ZERO_STD,
        final_reward_mean=math.fsum(finals) / len(finals),
        baseline="step",
    )
    return stats, positions


def group_statistics(
    transitions: Sequence[Transition],
    cfg: LightningRL | None = None,
    *,
    include_intermediate: bool = True,
) -> dict[str, GroupStats]:
    """Per group: the mean/std the advantages are normalised by (final rewards at rollout level,
    credited returns at transition level) and whether the group has zero variance."""
    cfg = cfg or _DEFAULT
    returns, by_rollout = credit_transitions(transitions, cfg, include_intermediate=include_intermediate)
    stats, _ = _statistics(transitions, returns, by_rollout, cfg)
    return stats


def compute_advantages(
    transitions: Sequence[Transition],
    cfg: LightningRL | None = None,
    *,
    include_intermediate: bool | None = True,
    per_agent: bool = False,
    prior: Mapping[str, tuple[float, float]] | None = None,
) -> tuple[list[float], dict[str, Any]]:
    """One advantage per transition (same order as given) and batch statistics.

    Returns are recomputed from ``final_reward``/``intermediate_reward`` with ``cfg``'s credit rule, so
    the result never depends on which rule filled ``Transition.reward`` earlier; with
    ``include_intermediate=None`` the returns are ``Transition.reward`` as the adapter credited them
    (what :meth:`LightningRL.compute_advantages` uses: credit is computed once). Groups come from
    ``group_id`` (a transition without one is grouped with its own rollout only). With ``per_agent``
    (an adapter per agent) a group is one task's rollouts seen per agent: each agent's transitions are
    normalised by the statistics of that agent's rollouts in the group, since each agent trains weights
    of its own; returns are still credited over the whole rollout. An agent that acts only in some
    rollouts is compared over all of its calls in the step instead (``cfg.agent_baseline``, see the
    module's docstring); ``agent_baselines`` in the statistics says which rule each agent got, and
    ``agent_returns`` (``{agent: (calls, mean, std)}`` of its credited returns) is what a later step's
    ``prior`` pools (:func:`prior_from_history`).
    """
    cfg = cfg or _DEFAULT
    returns, by_rollout = credit_transitions(transitions, cfg, include_intermediate=include_intermediate)
    if per_agent:
        stats, positions_of = _agent_statistics(transitions, returns, by_rollout, cfg, prior)
    else:
        stats, positions_of = _statistics(transitions, returns, by_rollout, cfg)
    advantages = [0.0] * len(transitions)
    zero_groups = 0
    incomplete = 0
    baselines: dict[str, str] = {}
    for gid, gs in stats.items():
        if per_agent:
            baselines[gs.agent or ""] = gs.baseline
        if gs.baseline == "group" and gs.rollouts != cfg.group_size:
            incomplete += 1
        if gs.zero_variance:
            zero_groups += 1
            continue
        scale = gs.std + EPS if cfg.normalize_std else 1.0
        for p in positions_of[gid]:
            advantages[p] = (returns[p] - gs.mean) / scale
    n = len(transitions)
    adv_mean, adv_std = _mean_std(advantages)
    finals = [transitions[ps[0]].final_reward for ps in by_rollout.values()]
    return advantages, {
        "groups": len(stats),
        "zero_variance_groups": zero_groups,
        "zero_variance_fraction": zero_groups / len(stats) if stats else 0.0,
        "incomplete_groups": incomplete,
        "rollouts": len(by_rollout),
        "transitions": n,
        "zero_advantage_transitions": sum(1 for a in advantages if a == 0.0),
        "final_reward_mean": math.fsum(finals) / len(finals) if finals else 0.0,
        "return_mean": math.fsum(returns) / n if n else 0.0,
        "advantage_mean": adv_mean,
        "advantage_std": adv_std,
        "advantage_min": min(advantages) if n else 0.0,
        "advantage_max": max(advantages) if n else 0.0,
        **(
            {"agent_baselines": baselines, "agent_returns": _agent_returns(transitions, returns)}
            if per_agent
            else {}
        ),
    }


def iter_groups(transitions: Iterable[Transition]) -> dict[str, list[Transition]]:
    """Transitions bucketed by group (the unit GRPO compares), in first-seen order."""
    out: dict[str, list[Transition]] = {}
    for t in transitions:
        out.setdefault(_group_key(t), []).append(t)
    return out


_DEFAULT = LightningRL()
