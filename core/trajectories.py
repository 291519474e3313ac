"""Multi-turn merging: one token sequence per agent conversation (DESIGN §8.1a).

An agent that makes six LLM calls in one conversation re-sends its growing history each time: as
per-call transitions, the update encodes the shared prefix six times. When call k+1's prompt ids start
with call k's prompt + response ids *exactly* (the gateway recorded both, so this is a fact about
tokens, not a guess), call k+1 extends call k's sequence: the tokens in between (tool results, the next
user turn) become context with loss mask 0, and each response is a segment with mask 1, its own
recorded log-probs and its own advantage. For a causal LM each response token then sees exactly the
context it saw when sampled, so the loss on the merged sequence equals the per-call loss, computed in
one forward pass.

Merging never crosses an agent (each framework agent has its own sequences, which is what a
multi-agent app needs and what per-conversation merging in other RL stacks cannot know) nor an
attempt. When the prefix breaks (re-tokenised calls, history truncation, summarisation, another
system prompt), a new sequence starts and the break is counted by cause.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import model_validator

from agl.types import Transition, _Model

__all__ = [
    "MergeStats",
    "Segment",
    "Trajectory",
    "merge_transitions",
    "per_call_trajectories",
    "token_advantages",
]

#: why a call did not extend an open sequence of its agent
BREAK_CAUSES = ("retokenised", "truncated", "diverged")


class Segment(_Model):
    """One LLM call inside a trajectory: its response occupies ``completion_ids[start:end]``."""

    transition: int  #: index into the transitions given to ``merge_transitions``
    start: int
    end: int
    span_id: str | None = None
    reward: float = 0.0
    intermediate_reward: float = 0.0
    final_reward: float = 0.0


class Trajectory(_Model):
    """An agent's conversation as one sequence: ``prompt_ids`` (the first call's prompt) followed by
    ``completion_ids`` (every later token); ``loss_mask`` is 1 on the model's own response tokens."""

    rollout_id: str
    attempt: int
    group_id: str | None = None
    agent: str | None = None
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    #: the behaviour policy's log-prob per completion token (0.0 on context); None if any call lacks them
    logprobs: tuple[float, ...] | None = None
    segments: tuple[Segment, ...]
    exact: bool = True

    @model_validator(mode="after")
    def _v_lengths(self) -> Trajectory:
        n = len(self.completion_ids)
        if len(self.loss_mask) != n or (self.logprobs is not None and len(self.logprobs) != n):
            raise ValueError("loss_mask and logprobs must have one entry per completion token")
        return self

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def response_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class MergeStats:
    """What merging did: how many calls extended a sequence and how many tokens that saved."""

    calls: int = 0
    sequences: int = 0
    merged_calls: int = 0  #: calls that extended an open sequence
    tokens_per_call: int = 0  #: tokens the per-call form would encode
    tokens_merged: int = 0  #: tokens the merged form encodes
    breaks: dict[str, int] = field(default_factory=dict)

    @property
    def merge_rate(self) -> float:
        """Share of calls after an agent's first that extended a sequence."""
        could = self.calls - self.sequences + sum(self.breaks.values())
        return self.merged_calls / could if could else 0.0

    @property
    def tokens_saved(self) -> int:
        return self.tokens_per_call - self.tokens_merged

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "sequences": self.sequences,
            "merged_calls": self.merged_calls,
            "merge_rate": self.merge_rate,
            "tokens_per_call": self.tokens_per_call,
            "tokens_merged": self.tokens_merged,
            "tokens_saved": self.tokens_saved,
            **{f"breaks_{cause}": self.breaks.get(cause, 0) for cause in BREAK_CAUSES},
        }


@dataclass
class _Open:
    """A sequence being built: its full ids so far and its parts."""

    prompt: list[int]
    completion: list[int]
    mask: list[int]
    logprobs: list[float] | None
    segments: list[Segment]
    exact: bool
    first: Transition

    def full_len(self) -> int:
        return len(self.prompt) + len(self.completion)

    def extends(self, prompt_ids: Sequence[int]) -> bool:
        n = self.full_len()
        if len(prompt_ids) < n:
            return False
        p = len(self.prompt)
        return tuple(prompt_ids[:p]) == tuple(self.prompt) and tuple(prompt_ids[p:n]) == tuple(
            self.completion
        )


def _segment(t: Transition, index: int, start: int) -> Segment:
    return Segment(
        transition=index,
        start=start,
        end=start + len(t.response_ids),
        span_id=t.span_id,
        reward=t.reward,
        intermediate_reward=t.intermediate_reward,
        final_reward=t.final_reward,
    )


def _start(t: Transition, index: int) -> _Open:
    lps = list(t.response_logprobs) if t.response_logprobs is not None else None
    return _Open(
        prompt=list(t.prompt_ids),
        completion=list(t.response_ids),
        mask=[1] * len(t.response_ids),
        logprobs=lps,
        segments=[_segment(t, index, 0)],
        exact=t.exact,
        first=t,
    )


def _extend(seq: _Open, t: Transition, index: int) -> None:
    context = list(t.prompt_ids[seq.full_len() :])
    seq.completion.extend(context)
    seq.mask.extend([0] * len(context))
    start = len(seq.completion)
    seq.completion.extend(t.response_ids)
    seq.mask.extend([1] * len(t.response_ids))
    if seq.logprobs is not None and t.response_logprobs is not None:
        seq.logprobs.extend([0.0] * len(context))
        seq.logprobs.extend(t.response_logprobs)
    else:
        seq.logprobs = None
    seq.segments.append(_segment(t, index, start))
    seq.exact = seq.exact and t.exact


def _break_cause(open_seqs: list[_Open], t: Transition) -> str:
    """``retokenised``: ids not recorded by the engine; ``truncated``: the call starts like a
    conversation of the agent but no longer carries its whole history (cut or summarised);
    ``diverged``: anything else (another system prompt or template, an independent conversation)."""
    if not t.exact or any(not s.exact for s in open_seqs):
        return "retokenised"
    if any(tuple(t.prompt_ids[: len(s.prompt)]) == tuple(s.prompt) for s in open_seqs):
        return "truncated"
    return "diverged"


def _finish(seq: _Open) -> Trajectory:
    t = seq.first
    return Trajectory(
        rollout_id=t.rollout_id,
        attempt=t.attempt,
        group_id=t.group_id,
        agent=t.agent,
        prompt_ids=tuple(seq.prompt),
        completion_ids=tuple(seq.completion),
        loss_mask=tuple(seq.mask),
        logprobs=tuple(seq.logprobs) if seq.logprobs is not None else None,
        segments=tuple(seq.segments),
        exact=seq.exact,
    )


def merge_transitions(
    transitions: Sequence[Transition], stats: MergeStats | None = None
) -> tuple[list[Trajectory], MergeStats]:
    """Merge each (rollout, attempt, agent)'s calls, in call order, into as few sequences as exact
    prefix extension allows. A call extends the open sequence of its agent whose ids it continues
    (the longest, when an agent runs several conversations); otherwise it starts a new sequence.
    Every transition lands in exactly one segment. Returns the trajectories (in order of their first
    call) and the statistics."""
    stats = stats if stats is not None else MergeStats()
    order = sorted(range(len(transitions)), key=lambda i: (transitions[i].index, i))
    open_by_key: dict[tuple[str, int, str | None], list[_Open]] = {}
    all_seqs: list[_Open] = []
    for i in order:
        t = transitions[i]
        stats.calls += 1
        stats.tokens_per_call += len(t.prompt_ids) + len(t.response_ids)
        key = (t.rollout_id, t.attempt, t.agent)
        seqs = open_by_key.setdefault(key, [])
        target = max((s for s in seqs if s.extends(t.prompt_ids)), key=lambda s: s.full_len(), default=None)
        if target is not None:
            _extend(target, t, i)
            stats.merged_calls += 1
            continue
        if seqs:
            cause = _break_cause(seqs, t)
            stats.breaks[cause] = stats.breaks.get(cause, 0) + 1
        seq = _start(t, i)
        seqs.append(seq)
        all_seqs.append(seq)
    out = [_finish(s) for s in all_seqs]
    stats.sequences += len(out)
    stats.tokens_merged += sum(tr.tokens for tr in out)
    return out, stats


def per_call_trajectories(
    transitions: Sequence[Transition], stats: MergeStats | None = None
) -> tuple[list[Trajectory], MergeStats]:
    """The per-call form in the same type: one single-segment trajectory per transition (what
    ``merge_turns=False`` trains on, and the baseline the merged form is compared with)."""
    stats = stats if stats is not None else MergeStats()
    out = [_finish(_start(t, i)) for i, t in enumerate(transitions)]
    n = sum(tr.tokens for tr in out)
    stats.calls += len(out)
    stats.sequences += len(out)
    stats.tokens_per_call += n
    stats.tokens_merged += n
    return out, stats


def token_advantages(trajectory: Trajectory, advantages: Sequence[float]) -> list[float]:
    """Per completion token: the advantage of the segment (call) that produced it, 0 on context.
    ``advantages`` are per transition, in the order given to ``merge_transitions``, so LightningRL's
    credit (and AIR) stays per call."""
    out = [0.0] * len(trajectory.completion_ids)
    for seg in trajectory.segments:
        a = float(advantages[seg.transition])
        for k in range(seg.start, seg.end):
            out[k] = a
    return out
