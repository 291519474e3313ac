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

AIR must never be a way to score without solving the task (a shaped penalty on failing SQL once taught
a writer to answer every question with ``COUNT(*)``, a query that never fails: docs/results.md). Two guards, applied per
rollout by :meth:`AIR.shape` after the rules have fired:

- **caps**: a rollout's AIR bonuses together are at most ``cap × reward_scale``, its penalties at most
  that much in magnitude (scaled down proportionally), where ``reward_scale`` is the task reward's
  range. With ``cap < 1`` no amount of shaping is worth as much as solving the task, and avoiding every
  penalty is worth at most ``cap`` of it;
- **outcome gating** (``gate="success"``): bonuses count only on rollouts whose final (task) reward
  reaches ``success_at`` — shaping then ranks successful rollouts, never replaces success. Penalties
  still apply everywhere: they say which call failed.

:func:`reward_breakdown` splits a batch's reward into its task part and its AIR/intermediate part, so a
run's metrics show how much of a reward gain came from each. What a call is credited with once its
rewards are known (its credited return) is :mod:`agl.adapter.credit`'s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from agl.errors import UsageError

if TYPE_CHECKING:
    from agl.types import Span, Transition

__all__ = ["AIR", "GATES", "RULES", "plugin_rewards", "reward_breakdown", "reward_split"]

log = logging.getLogger(__name__)

#: The built-in rules, in the order they are documented.
RULES: tuple[str, ...] = ("tool_error", "tool_success", "exception", "malformed_tool_call")
#: ``AIR.gate`` values: ``"none"`` (AIR counts on every rollout), ``"success"`` (bonuses count only on
#: rollouts whose final reward is at least ``success_at``) or ``"judge"`` (bonuses count only on rollouts
#: whose judge score is at least ``success_at``; applied by the trainer's reward assembly,
#: :mod:`agl.trainer.rewarding`, once the judge has scored the group — the adapter leaves them as they are).
GATES: tuple[str, ...] = ("none", "success", "judge")


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

    Guards (see the module docstring; applied by :meth:`shape`, plugins' rewards included): ``cap``
    bounds a rollout's total bonus, and separately its total penalty, to ``cap × reward_scale``
    (``None``: no cap; must be below 1 so shaping is never worth a solved task); ``gate="success"``
    keeps bonuses only on rollouts whose final reward is at least ``success_at`` (default: the top of
    the task reward's range, ``reward_scale``).
    """

    tool_error: float | None = -0.1
    tool_success: float | None = 0.0
    exception: float | None = -0.1
    malformed_tool_call: float | None = -0.1
    enabled: bool = True
    use_plugins: bool = True
    cap: float | None = 0.5
    reward_scale: float = 1.0
    gate: str = "none"
    success_at: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in RULES or f.name in ("cap", "success_at", "reward_scale"):
                if value is None and f.name != "reward_scale":
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise UsageError(f"AIR.{f.name} must be a finite number or None, got {value!r}")
            elif f.name == "gate":
                if value not in GATES:
                    raise UsageError(f"AIR.gate must be one of {', '.join(GATES)}, got {value!r}")
            elif not isinstance(value, bool):
                raise UsageError(f"AIR.{f.name} must be True or False, got {value!r}")
        if self.cap is not None and not 0 <= self.cap < 1:
            raise UsageError(
                f"AIR.cap must be in [0, 1): shaping worth a whole task reward could replace solving it; "
                f"got {self.cap!r}"
            )
        if self.reward_scale <= 0:
            raise UsageError(f"AIR.reward_scale must be > 0, got {self.reward_scale!r}")

    def shape(self, air: Sequence[float], final_reward: float) -> list[float]:
        """One rollout's AIR rewards (one per LLM call, as the rules and plugins gave them) after the
        outcome gate and the caps: what credit assignment adds to each call's return."""
        out = [float(x) for x in air]
        if not self.enabled:
            return [0.0] * len(out)
        if self.gate == "success":
            threshold = self.reward_scale if self.success_at is None else self.success_at
            if final_reward < threshold:
                out = [min(x, 0.0) for x in out]
        if self.cap is not None:
            limit = self.cap * self.reward_scale
            pos = sum(x for x in out if x > 0)
            neg = -sum(x for x in out if x < 0)
            fp = limit / pos if pos > limit else 1.0
            fn = limit / neg if neg > limit else 1.0
            out = [x * fp if x > 0 else x * fn if x < 0 else 0.0 for x in out]
        return out

    def gate_on(self, air: Sequence[float], verdict: float) -> list[float]:
        """``gate="judge"``: one rollout's (already capped) AIR with its bonuses dropped when the judge's
        ``verdict`` is below ``success_at`` (default: the top of the range); penalties are kept."""
        threshold = self.reward_scale if self.success_at is None else self.success_at
        return [float(x) if verdict >= threshold or x < 0 else 0.0 for x in air]

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


def reward_breakdown(transitions: Sequence[Any]) -> dict[str, float | None]:
    """How a batch's reward splits between the task and AIR (per rollout, averaged over rollouts):
    ``task_reward`` (the final reward), ``air_reward`` (the rollout's intermediate rewards summed over
    its transitions — AIR after its guards, plus any the agent emitted), ``air_bonus``/``air_penalty``
    (their positive and negative parts) and ``air_share`` (``|air| / (|task| + |air|)`` summed over
    rollouts: how much of the signal is shaping). Comparing two steps' breakdowns says how much of a
    gain came from AIR rather than from solving more tasks."""
    by_rollout: dict[tuple[str, int], list[Any]] = {}
    for t in transitions:
        by_rollout.setdefault((t.rollout_id, t.attempt), []).append(t)
    if not by_rollout:
        return {
            "task_reward": None,
            "air_reward": None,
            "air_bonus": None,
            "air_penalty": None,
            "air_share": None,
        }
    task, air, bonus, penalty = [], [], [], []
    for ts in by_rollout.values():
        task.append(float(ts[0].final_reward))
        inter = [float(t.intermediate_reward) for t in ts]
        air.append(sum(inter))
        bonus.append(sum(x for x in inter if x > 0))
        penalty.append(sum(x for x in inter if x < 0))
    n = len(task)
    mass = sum(abs(x) for x in task) + sum(abs(x) for x in air)
    return {
        "task_reward": sum(task) / n,
        "air_reward": sum(air) / n,
        "air_bonus": sum(bonus) / n,
        "air_penalty": sum(penalty) / n,
        "air_share": (sum(abs(x) for x in air) / mass) if mass else 0.0,
    }


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


def reward_split(transitions: Sequence[Transition], history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The step's reward split into task and AIR parts (:func:`agl.adapter.air_rules.reward_breakdown`), and
    each part's gain since the first training step: how much of a reward gain is shaping."""
    out: dict[str, Any] = dict(reward_breakdown(transitions))
    first = next((h for h in history if h.get("task_reward") is not None), None)
    if first is not None and out["task_reward"] is not None:
        out["task_reward_gain"] = out["task_reward"] - first["task_reward"]
        out["air_reward_gain"] = out["air_reward"] - first["air_reward"]
    return out
