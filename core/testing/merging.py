"""Merging assertions: what multi-turn merging (``agl.adapter.trajectories``) makes of an agent's calls."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agl.adapter.trajectories import MergeStats, Trajectory, merge_transitions
from agl.types import Transition

__all__ = ["Merged", "assert_merged"]


@dataclass
class Merged:
    """What :func:`assert_merged` found, for further assertions."""

    trajectories: list[Trajectory]
    stats: MergeStats
    sequences: dict[str | None, int]  #: agent -> how many sequences its calls make
    #: agent -> the break causes of its calls that started a new sequence, in call order
    breaks: dict[str | None, list[str]]


def assert_merged(
    transitions: Sequence[Transition], sequences: Mapping[str | None, int] | None = None
) -> Merged:
    """Merge ``transitions`` (one or more attempts) and assert what must hold for any app: every call
    is in exactly one sequence, a sequence holds the calls of one agent of one attempt, and each call
    saw exactly the sequence's tokens before its response (its prompt ids) and produced its segment.
    With ``sequences`` (agent -> count, summed over the attempts), also assert how many sequences each
    agent's calls make: one per agent conversation whose turns re-send their history exactly.
    """
    trajs, stats = merge_transitions(transitions)
    seen = Counter(seg.transition for tr in trajs for seg in tr.segments)
    assert sorted(seen) == list(range(len(transitions))) and set(seen.values()) <= {1}, (
        "every call must be in exactly one sequence"
    )
    breaks: dict[str | None, list[str]] = {}
    for tr in trajs:
        full = tr.prompt_ids + tr.completion_ids
        for seg in tr.segments:
            t = transitions[seg.transition]
            assert (t.rollout_id, t.attempt, t.agent) == (tr.rollout_id, tr.attempt, tr.agent), (
                f"call {t.index} of agent {t.agent!r} is in a sequence of {tr.agent!r}"
            )
            assert full[: len(tr.prompt_ids) + seg.start] == t.prompt_ids, (
                f"call {t.index} of {t.agent!r}: its prompt is not the sequence before its response"
            )
            assert tr.completion_ids[seg.start : seg.end] == t.response_ids
            assert all(tr.loss_mask[seg.start : seg.end])
            if seg.break_cause is not None:
                breaks.setdefault(t.agent, []).append(seg.break_cause)
    assert sum(sum(tr.loss_mask) for tr in trajs) == sum(len(t.response_ids) for t in transitions)
    counts = dict(Counter(tr.agent for tr in trajs))
    if sequences is not None:
        assert counts == dict(sequences), f"sequences per agent: {counts}, expected {dict(sequences)}"
    return Merged(trajs, stats, counts, breaks)
