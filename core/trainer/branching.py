"""Branching at an agent's call: K continuations from one prompt for an agent whose group is empty.

A repair, fallback or critic agent acts only after something went wrong, so in a step's GRPO groups it
has one call or none per task, and those calls carry no reward spread. When the rollout function can be
*replayed* — it is deterministic given the LLM's responses, declared with
``@agl.rollout(replayable=True)`` — the trainer gives such an agent a group of its own: it re-runs the
rollout K times from the same task, the gateway answering every call before the agent's call with the
parent's recorded response (same token ids, no model call) and sampling the agent's call afresh in
each branch with the branch's own seed; the program then finishes live. The K branches share the
agent's prompt token for token, so their transitions at that call form a GRPO group at that prompt.

**The contract** (what a rollout function promises with ``replayable=True``): given the same task and
the same LLM replies, it makes the same LLM calls in the same order with the same messages, and its
tools and reward do not depend on anything else that changes between runs (the clock, a shared counter,
a live service's state). The gateway checks it: a replayed call whose messages differ from the parent's
is answered ``422 branch_replay_diverged`` (:mod:`agl.gateway.replay`), so the branch fails loudly and is
left out. Calls the program makes concurrently are numbered in arrival order, which a replay need not
reproduce: branch only programs whose calls follow each other.

**When** (:func:`branch_points`, synchronous schedule, ``LoopConfig.branches=K``): after a step's
rollouts (and dynamic sampling's rounds) are collected, for every task group of the step and every
trained agent that made a call in *some but not all* of the group's rollouts and whose calls there have
no spread (one rollout, or equal credited returns), the first succeeded rollout in which it acted is
branched at the agent's first call in it. A function that did not opt in is never branched (one
warning). Each branch point costs K rollouts.

**What the store holds**: each branch is a rollout of its own (:func:`enqueue_branches`), in group
``<parent group>:branch:<parent id>:<call>``, its metadata naming the parent rollout, its attempt, the
branch call, the agent and the branch member (:data:`agl.semconv.ROLLOUT_BRANCH_KEY`). The replayed
calls' spans carry ``agl.llm.replayed`` and are left out of the update (their parent trains them); the
branch call's span carries ``agl.llm.branch_point``. LightningRL compares a branch group's members
with each other (per agent too: :mod:`agl.algorithms.lightning_rl`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agl import semconv as sc
from agl.errors import NotFoundError, UsageError
from agl.gateway.replay import recorded_calls
from agl.gateway.seeds import derive_seed
from agl.types import NewRollout, Rollout, Transition

if TYPE_CHECKING:
    from agl.trainer.steps import Steps

__all__ = [
    "BranchPoint",
    "Branching",
    "branch_group_id",
    "branch_points",
    "enqueue_branches",
    "is_branch_group",
    "replayable",
    "without_replayed",
]

log = logging.getLogger("agl.trainer")


@dataclass(frozen=True)
class BranchPoint:
    """Where to branch: ``agent``'s call ``call`` (its index in the attempt) of ``parent``'s ``attempt``."""

    parent: str
    attempt: int
    call: int
    agent: str


def replayable(agent: Any) -> bool:
    """Whether a rollout function declared the replay contract (``@agl.rollout(replayable=True)``)."""
    return getattr(agent, "replayable", False) is True


def is_branch_group(group_id: str | None) -> bool:
    return group_id is not None and sc.BRANCH_GROUP_MARK in group_id


def branch_group_id(parent: Rollout, call: int) -> str:
    """``<parent group>:branch:<parent id>:<call>`` (within the store's 128 characters for an id)."""
    return f"{(parent.group_id or parent.id)[:60]}{sc.BRANCH_GROUP_MARK}{parent.id[-50:]}:{call}"


def enqueue_branches(
    store: Any,
    parent: str,
    call: int,
    k: int,
    *,
    version: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> list[str]:
    """Enqueue ``k`` branches of rollout ``parent`` at its LLM call ``call`` (0-based, in the order its
    last attempt made its calls); returns their ids. Each branch reruns the parent's task in a group of
    its own; the gateway replays the calls before ``call`` and samples ``call`` afresh with the branch's
    seed (derived from the parent's seed and the branch's place when the parent was seeded). Raises
    ``UsageError`` for ``k < 2``, an unknown or unfinished parent, or a call it did not make."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise UsageError(f"branches take k >= 2 continuations, got {k!r}")
    if isinstance(call, bool) or not isinstance(call, int) or call < 0:
        raise UsageError(f"the branch call is a call index >= 0, got {call!r}")
    try:
        rollout = store.get_rollout(parent)
    except NotFoundError:
        raise UsageError(f"cannot branch rollout {parent!r}: the store has no such rollout") from None
    attempt = rollout.latest_attempt
    if rollout.status != "succeeded" or attempt is None:
        raise UsageError(f"cannot branch rollout {parent!r}: it is {rollout.status}, not succeeded")
    calls = recorded_calls(store, parent, attempt.number)
    if call not in calls:
        raise UsageError(
            f"cannot branch rollout {parent!r} at call {call}: its attempt {attempt.number} made the calls "
            f"{sorted(calls)} (numbered by the gateway, agl.llm.call_index)"
        )
    agent = calls[call].attributes.get(sc.AGL_LLM_AGENT)
    gid = branch_group_id(rollout, call)
    branches = [
        NewRollout(
            task_id=rollout.task_id,
            input=rollout.input,
            mode=rollout.mode,
            group_id=gid,
            resources_version=version,
            config=rollout.config,
            metadata={
                **(metadata or {}),
                sc.ROLLOUT_BRANCH_KEY: {
                    "parent": parent,
                    "attempt": attempt.number,
                    "call": call,
                    "agent": agent,
                    "member": member,
                },
                **_seeded(rollout, call, member),
            },
        )
        for member in range(k)
    ]
    return [r.id for r in store.enqueue(branches)]


def _seeded(parent: Rollout, call: int, member: int) -> dict[str, Any]:
    """A branch's seed and place, from its parent's and where it branches (none: parent unseeded)."""
    seed = parent.metadata.get(sc.ROLLOUT_SEED_KEY)
    if not isinstance(seed, int) or isinstance(seed, bool):
        return {}
    place = f"{parent.metadata.get(sc.ROLLOUT_PLACE_KEY, parent.id)}/b{call}/m{member}"
    return {sc.ROLLOUT_SEED_KEY: derive_seed("branch", seed, call, member), sc.ROLLOUT_PLACE_KEY: place}


def without_replayed(store: Any, rollout: Rollout, transitions: list[Transition]) -> list[Transition]:
    """A branch rollout's transitions less its replayed calls (their parent trains them)."""
    attempt = rollout.latest_attempt
    if attempt is None:
        return transitions
    replayed_ids, replayed_seeds = set(), set()
    for s in store.query_spans(rollout_id=rollout.id, attempt=attempt.number, name=sc.SPAN_CHAT):
        if s.attributes.get(sc.AGL_LLM_REPLAYED):
            replayed_ids.add(s.span_id)
            replayed_seeds.add(s.attributes.get(sc.AGL_LLM_SEED))
    replayed_seeds.discard(None)
    return [t for t in transitions if t.span_id not in replayed_ids and t.seed not in replayed_seeds]


def _agent_call(store: Any, rollout: Rollout, t: Transition) -> int | None:
    """The call index (``agl.llm.call_index``) of transition ``t`` of ``rollout``'s last attempt."""
    attempt = rollout.latest_attempt
    if attempt is None:
        return None
    for index, s in recorded_calls(store, rollout.id, attempt.number).items():
        if s.span_id == t.span_id or (t.seed is not None and s.attributes.get(sc.AGL_LLM_SEED) == t.seed):
            return index
    return None


def branch_points(
    store: Any,
    ids: Sequence[str],
    transitions: dict[str, list[Transition]],
    finished: dict[str, Rollout],
) -> list[BranchPoint]:
    """Where the step's groups leave an agent without a signal (see the module docstring)."""
    groups: dict[str, list[str]] = {}
    for rid in ids:
        r = finished.get(rid)
        if r is not None and not is_branch_group(r.group_id):
            groups.setdefault(r.group_id or rid, []).append(rid)
    points: list[BranchPoint] = []
    for rids in groups.values():
        agents = sorted({t.agent or "" for rid in rids for t in transitions.get(rid, [])})
        for agent in agents:
            mine = {rid: [t for t in transitions.get(rid, []) if (t.agent or "") == agent] for rid in rids}
            acted = [rid for rid in rids if mine[rid]]
            if not acted or len(acted) == len(rids):
                continue
            if len(acted) > 1 and len({round(t.reward, 9) for rid in acted for t in mine[rid]}) > 1:
                continue  # its calls in the group already differ: GRPO has a signal
            parent = next((rid for rid in acted if finished[rid].status == "succeeded"), None)
            if parent is None:
                continue
            r = finished[parent]
            call = _agent_call(store, r, mine[parent][0])
            if call is not None and r.latest_attempt is not None:
                points.append(BranchPoint(parent, r.latest_attempt.number, call, agent))
    return points


class Branching:
    """A synchronous run's branching (``LoopConfig.branches``), called once per step after collecting."""

    def __init__(self, k: int, agent: Any) -> None:
        self.k = k
        self.enabled = replayable(agent)
        if not self.enabled:
            log.warning(
                "agl trainer: branches=%d asks for branches, but the rollout function did not declare "
                "@agl.rollout(replayable=True) (deterministic given the LLM's responses): no branching",
                k,
            )

    def after_collect(
        self,
        steps: Steps,
        step: int,
        version: int,
        ids: list[str],
        collected: tuple[dict[str, list[Transition]], dict[str, float], list[Rollout]],
        bar: Any,
        sampled: dict[str, Any],
    ) -> tuple[list[str], dict[str, Any]]:
        """Branch the step's empty groups, collect the branches into ``collected`` (in place), and
        return every training rollout id with the branching metrics. Groups dynamic sampling keeps
        (``sampled["kept_groups"]``) gain the branch groups."""
        if not self.enabled:
            return ids, {"branch_points": 0}
        transitions, rewards, finished = collected
        by_id = {r.id: r for r in finished}
        points = branch_points(steps.store, ids, transitions, by_id)
        new: list[str] = []
        for p in points:
            new += enqueue_branches(
                steps.store, p.parent, p.call, self.k, version=version, metadata={"step": step}
            )
        if not new:
            return ids, {"branch_points": 0}
        ts, rw, fin = steps.collect(new, bar, f"step {step} branches")
        for r in fin:
            ts[r.id] = without_replayed(steps.store, r, ts.get(r.id, []))
        transitions.update(ts)
        rewards.update(rw)
        finished.extend(fin)
        gids = {r.group_id for r in fin if r.group_id}
        if "kept_groups" in sampled:
            sampled["kept_groups"] = list(sampled["kept_groups"]) + sorted(gids)
        spread = sum(1 for g in gids if len({rw[r.id] for r in fin if r.group_id == g and r.id in rw}) > 1)
        return ids + new, {
            "branch_points": len(points),
            "branch_rollouts": len(new),
            "branch_failed": sum(1 for r in fin if r.status != "succeeded"),
            "branch_transitions": sum(len(ts[r.id]) for r in fin),
            "branch_groups_with_spread": spread,
            **{
                f"branch_points/{a}": sum(1 for p in points if p.agent == a)
                for a in {p.agent for p in points}
            },
        }
