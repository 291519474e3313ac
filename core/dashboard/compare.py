"""The dashboard's comparison with a second run: where a rollout (or the whole run) parts from it.

``agl dashboard --store A --compare B`` (B: a run directory, a store file or a store URL, the forms of
``agl diff``) makes every rollout page say whether the rollout at the same place in B made the same
calls token for token, and if not, the first call where they part, the two token sequences side by side
and the likely reason. The matching and the reasons are :mod:`agl.reports.diff`'s, the same as
``agl diff A B``: nothing is re-implemented here, only turned into JSON with the tokens' text.

B is read-only and opened once at start; its rollout keys are cached (a key not yet cached is looked up
afresh, so a run still writing B is followed).
"""

from __future__ import annotations

import threading
from typing import Any

from agl.reports.diff import (
    CallView,
    Divergence,
    Run,
    diff_rollout,
    diff_runs,
    first_difference,
    keyed_rollouts,
)

__all__ = ["Comparison", "divergence_view"]

#: tokens shown before the first differing one (context), and at most after it
CONTEXT_TOKENS = 8


def _pieces(tok: Any, ids: list[int]) -> list[str] | None:
    if tok is None:
        return None
    try:
        return [str(tok.decode([i])) for i in ids]
    except Exception:  # noqa: BLE001 - an id outside the vocabulary: ids instead
        return None


def _window(ids: list[int], start: int, tokens: int) -> tuple[int, list[int]]:
    """From ``CONTEXT_TOKENS`` before ``start`` to ``tokens`` after it: (offset of the window, ids)."""
    lo = max(0, start - CONTEXT_TOKENS)
    return lo, ids[lo : start + tokens]


def _side(v: CallView | None, part: str, start: int, tokens: int, tok: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    ids = v.prompt_ids if part == "prompt" else v.response_ids
    lo, shown = _window(ids, start, tokens)
    lps = v.logprobs[lo : lo + len(shown)] if part == "response" and v.logprobs else None
    return {
        "rollout_id": v.rollout_id,
        "span_id": v.span_id,
        "seed": v.seed,
        "seed_source": v.seed_source,
        "weight_version": v.weight_version,
        "prompt_len": len(v.prompt_ids),
        "response_len": len(v.response_ids),
        "offset": lo,
        "ids": shown,
        "pieces": _pieces(tok, shown),
        "logprobs": lps,
        "more": max(0, len(ids) - lo - len(shown)),
    }


def divergence_view(d: Divergence | None, tok: Any = None, tokens: int = 32) -> dict[str, Any] | None:
    """A divergence as JSON: where, why, and both sides' token windows from the first difference.

    ``part`` says which sequences differ: ``response`` (tokens or their log-probs, from
    ``first_token``), ``prompt`` (the prompts part at ``first_token``: the difference is upstream of
    this call), or None (no call to show: the rollout is missing, the task or the reward differs).
    """
    if d is None:
        return None
    part: str | None = None
    start = 0
    if d.a is not None and d.b is not None:
        if d.first_token is not None:
            part, start = "response", d.first_token
        else:
            part, start = "prompt", first_difference(d.a.prompt_ids, d.b.prompt_ids) or 0
    return {
        "step": d.step,
        "place": d.place,
        "call": d.call,
        "reason": d.reason,
        "part": part,
        "first_token": start if part else None,
        "a": _side(d.a, part, start, tokens, tok) if part else None,
        "b": _side(d.b, part, start, tokens, tok) if part else None,
    }


class Comparison:
    """Run B, opened for the dashboard of run A: per-rollout and whole-run comparisons as JSON."""

    def __init__(self, run: Run, *, tokenizer: Any = None) -> None:
        self.run = run
        self.tokenizer = tokenizer
        self._keys: dict[tuple[Any, ...], Any] | None = None
        self._lock = threading.Lock()

    @property
    def label(self) -> str:
        return self.run.label

    def _b_keys(self) -> dict[tuple[Any, ...], Any]:
        with self._lock:
            if self._keys is None:
                self._keys = keyed_rollouts(self.run.store)
            return self._keys

    def rollout(self, store: Any, rollout_id: str, *, tokens: int = 32) -> dict[str, Any]:
        """The rollout ``rollout_id`` of ``store`` (run A) against B's rollout at the same place."""
        result, ra, rb = diff_rollout(Run("A", store), self.run, rollout_id, b_keyed=self._b_keys())
        return {
            "compare": self.label,
            "rollout_id": ra.id,
            "other_rollout_id": rb.id if rb is not None else None,
            "identical": result.first is None,
            "calls": result.calls,
            "divergence": divergence_view(result.first, self.tokenizer, tokens),
            "notes": result.notes,
        }

    def whole(
        self, store: Any, *, metrics: list[dict[str, Any]] | None = None, tokens: int = 32
    ) -> dict[str, Any]:
        """The whole run A (``store``, its ``metrics`` records when known) against B: ``agl diff A B``."""
        result = diff_runs(Run("A", store, metrics), self.run)
        return {
            "compare": self.label,
            "identical": result.identical,
            "rollouts": result.rollouts,
            "calls": result.calls,
            "divergence": divergence_view(result.first, self.tokenizer, tokens),
            "metrics": list(result.metrics) if result.metrics is not None else None,
            "notes": result.notes,
        }

    def close(self) -> None:
        self.run.store.close()
