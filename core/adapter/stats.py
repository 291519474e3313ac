"""What the adapter saw, skipped and repaired (:class:`AdapterStats`), so a run can see how trustworthy
its training data is."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["AdapterStats"]


@dataclass
class AdapterStats:
    """What the adapter saw, skipped and repaired. Cumulative over an :class:`Adapter`'s calls."""

    attempts: int = 0  #: attempts turned into transitions
    spans: int = 0  #: spans given
    duplicates: int = 0  #: copies of a span already seen (same trace_id + span_id), dropped
    stale: int = 0  #: spans the store marked stale (lost/timed-out attempt), dropped
    other_attempt: int = 0  #: spans of another rollout or attempt than the one adapted, dropped
    orphans: int = 0  #: spans whose parent is missing, re-attached to their trace's root
    cycles: int = 0  #: parent cycles broken (malformed parent ids)
    relinked: int = 0  #: server chat spans with no parent joined to their client span by response id
    llm_calls: int = 0  #: LLM calls found (before agent selection)
    transitions: int = 0  #: transitions produced
    exact: int = 0  #: ... of which with engine token ids
    retokenised: int = 0  #: ... of which re-tokenised from messages
    unselected: int = 0  #: LLM calls of agents not selected
    #: selected agents' calls another agent's adapter (or the base model) served: their behaviour
    #: policy is not the one being trained, so they are left out
    other_adapter: int = 0
    no_tokenizer: int = 0  #: calls that needed re-tokenising but no tokenizer was given
    retokenise_failed: int = 0  #: calls the tokenizer could not render (e.g. template errors)
    failed_calls: int = 0  #: LLM calls that errored without a response
    discarded: int = 0  #: selected calls whose output the app threw away (agl.discarded.windows), left out
    bad_messages: int = 0  #: message attributes that were not valid JSON
    logprobs_dropped: int = 0  #: logprobs whose length did not match the response ids
    reward_spans: int = 0  #: agl.reward spans read
    invalid_rewards: int = 0  #: reward spans without a finite numeric value
    missing_final_reward: int = 0  #: attempts without a primary reward (fill value used)
    intermediate_rewards: int = 0  #: emitted (non-final) rewards attached to a transition
    unattached_rewards: int = 0  #: intermediate/AIR rewards with no LLM call before them
    unselected_rewards: int = 0  #: intermediate/AIR rewards that landed on an unselected agent's call
    plugin_errors: int = 0  #: AIR plugins that raised or returned a non-number
    no_finished_attempt: int = 0  #: rollouts with no succeeded/failed attempt (from_store)
    #: LLM calls of attempts where no call had an agent span although the attempt's own spans show an
    #: agent framework was used (a span with ``agl.integration`` other than ``openai``): its hooks were
    #: bypassed or removed
    unattributed_calls: int = 0
    #: multi-turn merging of the transitions (agl.adapter.trajectories, what the update trains on): the
    #: sequences they make (one per agent conversation whose calls extend exactly), the calls that
    #: extended a sequence, and the tokens the per-call and the merged forms encode
    sequences: int = 0
    merged_calls: int = 0
    tokens_per_call: int = 0
    tokens_merged: int = 0
    #: calls that started a new sequence although their agent had one open, by cause
    #: (agl.adapter.trajectories.BREAK_CAUSES: retokenised, edited, rerendered, truncated, diverged)
    prefix_breaks: dict[str, int] = field(default_factory=dict)
    air: dict[str, int] = field(default_factory=dict)  #: AIR events per rule
    #: LLM calls per agent name ("" for calls with no agent span), before selection
    agents: dict[str, int] = field(default_factory=dict)

    def merge(self, other: AdapterStats) -> None:
        mine = self.__dict__
        for name, value in other.__dict__.items():
            if isinstance(value, dict):
                counts = mine[name]
                for k, v in value.items():
                    counts[k] = counts.get(k, 0) + v
            elif value:
                mine[name] += value

    @property
    def merge_rate(self) -> float:
        """Share of the calls that could extend their agent's sequence (every call after an agent's
        first) that did; 0.0 when there were none."""
        could = self.merged_calls + sum(self.prefix_breaks.values())
        return self.merged_calls / could if could else 0.0

    @property
    def tokens_saved(self) -> int:
        """Tokens the merged form does not encode again (``tokens_per_call - tokens_merged``)."""
        return self.tokens_per_call - self.tokens_merged

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["prefix_breaks"] = dict(self.prefix_breaks)
        out["air"] = dict(self.air)
        out["agents"] = dict(self.agents)
        out["merge_rate"] = self.merge_rate
        out["tokens_saved"] = self.tokens_saved
        return out

    def copy(self) -> AdapterStats:
        out = AdapterStats()
        out.merge(self)
        return out

    def since(self, earlier: AdapterStats) -> AdapterStats:
        """The counts added after ``earlier`` (a :meth:`copy` of these stats taken before)."""
        out = AdapterStats()
        for f in fields(self):
            now, then = getattr(self, f.name), getattr(earlier, f.name)
            if isinstance(now, dict):
                setattr(out, f.name, {k: v - then.get(k, 0) for k, v in now.items() if v != then.get(k, 0)})
            else:
                setattr(out, f.name, now - then)
        return out
