"""Which reward span is an attempt's final reward, and where the others land: the one definition the
adapter, the trainer and the dashboard share.

An attempt's final reward is its last primary ``agl.reward`` span with a finite numeric value. "Last" is
the total order :func:`_reward_key` ``(end_ns, seq, start_ns, span_id)``: the span that ended last, ties
broken by the store's emission order, then by start time and span id, so the answer never depends on
the order the spans were read in. Stale spans (of a lost or timed-out attempt) never count. Every other
valid reward span is intermediate: it is attached to the LLM call before it (same agent preferred).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agl import semconv as sc
from agl.adapter.spans import _seq
from agl.types import Span

if TYPE_CHECKING:
    from agl.adapter.spans import _Locator, _Tree
    from agl.adapter.stats import AdapterStats

__all__ = ["RewardSelection", "final_reward", "select_rewards"]


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() not in ("false", "0", "no", "")
    return bool(v)


def _reward_key(s: Span) -> tuple[int, int, int, str]:
    """Order of reward spans: the last to end is the final reward (ties: emission order, then start
    time and span id, so equal keys never depend on reading order)."""
    return (s.end_ns, _seq(s), s.start_ns, s.span_id)


def _is_reward(s: Span) -> bool:
    return s.name == sc.SPAN_REWARD or s.attributes.get(sc.GEN_AI_OPERATION_NAME) == sc.SPAN_REWARD


def _value(s: Span) -> float | None:
    value = s.attributes.get(sc.AGL_REWARD_VALUE)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


@dataclass
class RewardSelection:
    """The reward spans of one attempt sorted out: positions refer to the sequence given."""

    final: float | None = None  #: the final reward, None when no primary reward span was valid
    final_at: int = -1  #: position of the final reward's span (-1: none)
    intermediate: list[tuple[float, int]] = field(default_factory=list)  #: (value, position), in order
    invalid: int = 0  #: reward spans without a finite numeric value


def select_rewards(spans: Sequence[Span]) -> RewardSelection:
    """Sort already-chosen reward spans into the final reward and the intermediate ones."""
    out = RewardSelection()
    best: tuple[int, int, int, str] | None = None
    primary: list[tuple[float, int]] = []
    for pos, s in enumerate(spans):
        value = _value(s)
        if value is None:
            out.invalid += 1
        elif not _truthy(s.attributes.get(sc.AGL_REWARD_PRIMARY, True)):
            out.intermediate.append((value, pos))
        else:
            primary.append((value, pos))
            key = _reward_key(s)
            if best is None or key > best:
                best, out.final, out.final_at = key, value, pos
    # primary rewards that are not the final one count as intermediate, after the emitted ones
    out.intermediate.extend((value, pos) for value, pos in primary if pos != out.final_at)
    return out


def final_reward(spans: Iterable[Span]) -> float | None:
    """The final reward of one attempt (see the module docstring), None when it has none. Spans that
    are not rewards and stale spans are skipped, so an attempt's whole span list may be given."""
    rewards = [s for s in spans if not s.stale and _is_reward(s)]
    return select_rewards(rewards).final


def attach_rewards(
    tree: _Tree, n_calls: int, locate: _Locator, st: AdapterStats
) -> tuple[list[float], float | None]:
    """(intermediate reward per call, final reward or None) for one attempt's tree: the final reward as
    :func:`select_rewards` picks it; every other valid reward is added to the call before it."""
    S = tree.S
    inter = [0.0] * n_calls
    sel = select_rewards([S[i] for i in tree.rewards])
    st.reward_spans += len(tree.rewards)
    st.invalid_rewards += sel.invalid
    for value, pos in sel.intermediate:
        i = tree.rewards[pos]
        k = locate.before(S[i].start_ns, tree.agent_of(i))
        if k < 0:
            st.unattached_rewards += 1
            continue
        inter[k] += value
        st.intermediate_rewards += 1
    if sel.final is None:
        st.missing_final_reward += 1
    return inter, sel.final
