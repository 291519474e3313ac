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
    "merge_stats",
    "merge_transitions",
    "per_call_trajectories",
    "token_advantages",
]

#: why a call did not extend an open sequence of its agent (see :func:`_break_cause`)
BREAK_CAUSES = ("retokenised", "edited", "rerendered", "truncated", "diverged")


class Segment(_Model):
    """One LLM call inside a trajectory: its response occupies ``completion_ids[start:end]``."""

    transition: int  #: index into the transitions given to ``merge_transitions``
    start: int
    end: int
    span_id: str | None = None
    reward: float = 0.0
    intermediate_reward: float = 0.0
    final_reward: float = 0.0
    #: why this call started a new sequence although its agent had one open (one of
    #: :data:`BREAK_CAUSES`); None when it extended a sequence or was its agent's first call
    break_cause: str | None = None


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
    last: Transition

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


def _segment(t: Transition, index: int, start: int, cause: str | None = None) -> Segment:
    return Segment(
        transition=index,
        start=start,
        end=start + len(t.response_ids),
        span_id=t.span_id,
        reward=t.reward,
        intermediate_reward=t.intermediate_reward,
        final_reward=t.final_reward,
        break_cause=cause,
    )


def _start(t: Transition, index: int, cause: str | None = None) -> _Open:
    lps = list(t.response_logprobs) if t.response_logprobs is not None else None
    return _Open(
        prompt=list(t.prompt_ids),
        completion=list(t.response_ids),
        mask=[1] * len(t.response_ids),
        logprobs=lps,
        segments=[_segment(t, index, 0, cause)],
        exact=t.exact,
        first=t,
        last=t,
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
    seq.last = t


def _message_key(m: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a chat message when a framework re-sends it: role, text, tool calls (name and
    arguments; ids and empty fields vary between clients)."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    calls = m.get("tool_calls")
    calls_key = tuple(
        (str(fn.get("name")), str(fn.get("arguments")))
        for tc in (calls if isinstance(calls, list) else [])
        if isinstance(tc, dict)
        for fn in [tc.get("function") if isinstance(tc.get("function"), dict) else tc]
    )
    return (m.get("role"), content or "", calls_key)


def _opening(messages: Sequence[dict[str, Any]]) -> tuple[tuple[Any, ...], ...]:
    """A conversation's opening: its messages up to and including the first user message."""
    out = []
    for m in messages:
        out.append(_message_key(m))
        if m.get("role") == "user":
            break
    return tuple(out)


def _break_cause(open_seqs: list[_Open], t: Transition) -> str:
    """Why ``t`` extends none of its agent's open sequences, as far as the recorded calls show:

    - ``retokenised``: its ids (or a sequence's) were re-tokenised from messages, not the engine's;
    - ``edited``: its messages re-send a sequence's last call unchanged followed by the assistant's
      reply and more, but the reply's text is not what the model produced (the framework appended an
      observation, stripped whitespace or reasoning);
    - ``rerendered``: as ``edited`` but the reply re-sent as produced, and still the ids differ: the
      chat template renders the earlier turns differently from how they were sampled (a template
      that drops reasoning or reformats tool calls, a changed template);
    - ``truncated``: it opens like a sequence's conversation (same system prompt and first user
      message; without messages, the same first prompt ids) and goes on, but no longer carries its
      whole history (cut or summarised);
    - ``diverged``: anything else, a new conversation (a fresh prompt, another system prompt, the
      same prompt asked again)."""
    if not t.exact or any(not s.exact for s in open_seqs):
        return "retokenised"
    if t.messages:
        keys = [_message_key(m) for m in t.messages]
        for s in open_seqs:
            prev = [_message_key(m) for m in s.last.messages]
            if (
                prev
                and len(keys) > len(prev)
                and keys[: len(prev)] == prev
                and keys[len(prev)][0] == "assistant"
            ):
                _, text, calls = keys[len(prev)]
                sampled = s.last.response_text
                return "edited" if not calls and sampled is not None and text != sampled else "rerendered"
        opening = _opening(t.messages)
        if len(opening) < len(keys) and any(
            s.first.messages and _opening(s.first.messages) == opening for s in open_seqs
        ):
            return "truncated"
        return "diverged"
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


def _group(transitions: Sequence[Transition], stats: MergeStats) -> list[_Open]:
    """The merge itself (shared by :func:`merge_transitions` and :func:`merge_stats`): each call, in
    call order, extends the longest open sequence of its (rollout, attempt, agent) whose ids it
    continues, else starts a new one (a break, counted by cause, when the agent had one open)."""
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
        cause = None
        if seqs:
            cause = _break_cause(seqs, t)
            stats.breaks[cause] = stats.breaks.get(cause, 0) + 1
        seq = _start(t, i, cause)
        seqs.append(seq)
        all_seqs.append(seq)
    stats.sequences += len(all_seqs)
    stats.tokens_merged += sum(s.full_len() for s in all_seqs)
    return all_seqs


def merge_transitions(
    transitions: Sequence[Transition], stats: MergeStats | None = None
) -> tuple[list[Trajectory], MergeStats]:
    """Merge each (rollout, attempt, agent)'s calls, in call order, into as few sequences as exact
    prefix extension allows. A call extends the open sequence of its agent whose ids it continues
    (the longest, when an agent runs several conversations); otherwise it starts a new sequence.
    Every transition lands in exactly one segment. Returns the trajectories (in order of their first
    call) and the statistics."""
    stats = stats if stats is not None else MergeStats()
    return [_finish(s) for s in _group(transitions, stats)], stats


def merge_stats(transitions: Sequence[Transition], stats: MergeStats | None = None) -> MergeStats:
    """What :func:`merge_transitions` would do (merge rate, tokens saved, breaks by cause), without
    building the trajectories: cheap enough for the adapter to count on every attempt."""
    stats = stats if stats is not None else MergeStats()
    _group(transitions, stats)
    return stats


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
