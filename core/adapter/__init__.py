"""The adapter (DESIGN §8): the spans of one attempt → ordered training :class:`~agl.types.Transition` s.

Traces from real agents are messy: spans arrive from several processes and exporters, twice, late or
without their parent; a rollout may have been retried; agents nest; tools run in parallel. The adapter
repairs what it can, never crashes on a malformed trace, never yields the same LLM call twice, and counts
everything it had to skip or guess in :class:`AdapterStats`. The rules are in docs/architecture.md §8.

One job per module: :mod:`~agl.adapter.spans` (span kinds, the repaired tree, agent attribution,
:func:`finishing_attempt`), :mod:`~agl.adapter.messages` (message parsing), :mod:`~agl.adapter.rewards`
(:func:`final_reward`, the one definition), :mod:`~agl.adapter.air_rules` (AIR: what each signal is
worth), :mod:`~agl.adapter.air` (where AIR lands), :mod:`~agl.adapter.credit` (the credited return of
each call, the one implementation), :mod:`~agl.adapter.trajectories` (multi-turn merging),
:mod:`~agl.adapter.stats` and :mod:`~agl.adapter.adapter` (:class:`Adapter`, the pipeline).
"""

from agl.adapter.adapter import Adapter
from agl.adapter.rewards import final_reward
from agl.adapter.spans import AgentSelection, agent_matcher, finishing_attempt
from agl.adapter.stats import AdapterStats

__all__ = ["Adapter", "AdapterStats", "AgentSelection", "agent_matcher", "final_reward", "finishing_attempt"]
