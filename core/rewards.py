"""Automatic Intermediate Rewards (AIR, DESIGN §8): rewards read off the trace, not emitted by the agent.

A final reward says how a whole rollout went; it cannot say *which* LLM call went wrong. Many failures
are visible in the spans themselves — a tool that raised, an exception in the agent's code, a tool call
the model wrote with unparsable arguments — and each of them was caused by one LLM call. AIR turns those
signals into small intermediate rewards on the transition that caused them, so credit assignment can
tell a careless call from a good one even when two rollouts end with the same final reward.

This module decides *how much* each signal is worth (:class:`AIR`, the rule weights) and asks plugins
for more rules; :mod:`agl.adapter` decides *which* transition each signal lands on (the tool call's
issuer, or the LLM call that precedes the span). The attachment rules are documented in
docs/architecture.md §8.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agl.types import Span

__all__ = ["AIR", "RULES", "plugin_rewards"]

log = logging.getLogger(__name__)

#: The built-in rules, in the order they are documented.
RULES: tuple[str, ...] = ("tool_error", "tool_success", "exception", "malformed_tool_call")


@dataclass(frozen=True)
class AIR:
    """Weights of the built-in AIR rules; a weight of ``0`` or ``None`` switches its rule off.

    - ``tool_error``: an ``execute_tool`` span with ERROR status, credited to the LLM call that issued
      the tool call (matched by ``gen_ai.tool.call.id``, else the latest call that ended before the tool
      started).
    - ``tool_success``: an ``execute_tool`` span that did not fail, credited the same way (a small bonus
      for a well-formed call; off by default).
    - ``exception``: an ``agl.exception`` span, or a non-tool span with ERROR status and an
      ``exception`` event raised there (not merely propagated from a failing child), credited to the
      LLM call that ended before the exception.
    - ``malformed_tool_call``: a tool call in an LLM response whose ``arguments`` is not valid JSON,
      credited to that call itself (skipped when a failing tool span already penalised that call id).

    ``enabled=False`` turns every rule off, plugins included; ``use_plugins=False`` keeps the built-in
    rules and ignores ``agl_intermediate_reward`` plugins.
    """

    tool_error: float | None = -0.1
    tool_success: float | None = 0.0
    exception: float | None = -0.1
    malformed_tool_call: float | None = -0.1
    enabled: bool = True
    use_plugins: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in RULES:
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"AIR.{f.name} must be a finite number or None, got {value!r}")
            elif not isinstance(value, bool):
                raise ValueError(f"AIR.{f.name} must be True or False, got {value!r}")

    def weight(self, rule: str) -> float:
        """The weight of a built-in rule, 0.0 when the rule (or AIR) is switched off."""
        if not self.enabled:
            return 0.0
        value = getattr(self, rule)
        return 0.0 if value is None else float(value)

    @classmethod
    def off(cls) -> AIR:
        """No automatic rewards at all: only what the agent emitted counts."""
        return cls(enabled=False)


def _hook_caller() -> Any | None:
    """The ``agl_intermediate_reward`` hook, or None when no plugin implements it (or no plugin system)."""
    try:
        from agl.plugins import get_plugin_manager
    except ImportError:  # pragma: no cover - the plugin system ships with agl; be lenient anyway
        return None
    hook = getattr(get_plugin_manager().hook, "agl_intermediate_reward", None)
    if hook is None or not hook.get_hookimpls():
        return None
    return hook


def plugin_rewards(spans: Sequence[Span], *, errors: list[str] | None = None) -> list[tuple[int, float]]:
    """Ask every ``agl_intermediate_reward`` plugin about every span: ``(index in spans, reward)`` pairs.

    All implementations are called for each span and their non-None answers are added. A plugin that
    raises or answers something other than a finite number is skipped for that span and reported in
    ``errors`` (and logged), so one faulty rule never stops training.
    """
    hook = _hook_caller()
    if hook is None:
        return []
    out: list[tuple[int, float]] = []
    for i, span in enumerate(spans):
        try:
            results = hook(span=span, spans=spans)
        except Exception as exc:  # a plugin bug must not stop the adapter; it is counted and logged
            msg = f"agl_intermediate_reward plugin failed on span {span.span_id} ({span.name}): {exc!r}"
            log.warning(msg)
            if errors is not None:
                errors.append(msg)
            continue
        if not isinstance(results, list):
            results = [results]
        total = 0.0
        found = False
        for value in results:
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                msg = f"agl_intermediate_reward plugin returned {value!r} for span {span.span_id}; ignored"
                log.warning(msg)
                if errors is not None:
                    errors.append(msg)
                continue
            total += float(value)
            found = True
        if found:
            out.append((i, total))
    return out
