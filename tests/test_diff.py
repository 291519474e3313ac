"""``agl diff``'s matching and reasons on stores written span by span (no torch: the core env runs it).
The end-to-end case, two real training runs with an injected divergence, is in test_reproducible.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from recorded_runs import recorded_store

from agl.errors import UsageError
from agl.reports.diff import Run, diff_runs, open_run


def _store(calls: dict[str, list[dict[str, Any]]], *, path: Path | None = None) -> Any:
    """A store with one finished rollout per place, each with the given gateway calls (in order)."""
    return recorded_store(calls, path=path)


BASE = {"train:s0/t0/m0": [{"ids": [5, 6]}, {"ids": [7, 8, 9]}], "train:s0/t0/m1": [{"ids": [3]}]}


def test_identical_runs_say_so() -> None:
    result = diff_runs(Run("a", _store(BASE)), Run("b", _store(BASE)))
    assert result.identical and result.rollouts == 2 and result.calls == 3


@pytest.mark.parametrize(
    ("change", "reason", "token"),
    [
        ({"ids": [7, 4, 9], "seed": 12}, "different seed", 1),
        ({"ids": [7, 4, 9], "v": 2}, "different weights version", 1),
        ({"ids": [7, 4, 9]}, "same prompt, seed and weights version", 1),
        ({"ids": [7, 8, 9], "prompt": [1, 3]}, "different prompt", None),
        ({"ids": [7, 8, 9], "lp": [-0.5, -0.5000001, -0.5]}, "same tokens, different log-probs", 1),
    ],
)
def test_the_first_divergence_is_found_at_its_call_with_its_reason(
    change: dict[str, Any], reason: str, token: int | None
) -> None:
    other = {**BASE, "train:s0/t0/m0": [{"ids": [5, 6]}, change]}
    result = diff_runs(Run("a", _store(BASE)), Run("b", _store(other)))
    d = result.first
    assert d is not None and not result.identical
    assert (d.place, d.call, d.first_token) == ("train:s0/t0/m0", 1, token)
    assert d.reason.startswith(reason)


def test_a_missing_rollout_and_a_different_call_count() -> None:
    fewer = {"train:s0/t0/m0": BASE["train:s0/t0/m0"]}
    d = diff_runs(Run("a", _store(BASE)), Run("b", _store(fewer))).first
    assert d is not None and d.place == "train:s0/t0/m1" and "only in A" in d.reason
    more = {**BASE, "train:s0/t0/m1": [{"ids": [3]}, {"ids": [4]}]}
    d = diff_runs(Run("a", _store(BASE)), Run("b", _store(more))).first
    assert d is not None and d.call == 1 and "A made 1 LLM call(s), B 2" in d.reason


def test_open_run_refuses_what_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such run"):
        open_run(str(tmp_path / "nowhere"))
    with pytest.raises(UsageError, match="without store.db"):
        open_run(str(tmp_path))
    _store(BASE, path=tmp_path / "x.db").close()
    run = open_run(str(tmp_path / "x.db"))
    assert run.metrics is None and len(run.store.query_rollouts()) == 2
    run.store.close()
