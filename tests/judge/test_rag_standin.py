"""The rag_agent stand-in judges answer the judge's real requests: F1 (+ seeded noise) per trajectory,
or the coarse rubric against the reference, through the judge's gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from judge_helpers import run_group

from examples.rag_agent.judge import noisy_f1_judge, rubric_judge
from examples.rag_agent.reward import reward

pytest.importorskip("openai")  # the judged agents call the gateway with the openai client


def _scores(judge: Any, store: Any, rollouts: list[Any], run_dir: Path) -> dict[str, float]:
    judge.cache_arg = False
    judge.open(run_dir)
    try:
        return judge.score(store, rollouts).scores
    finally:
        judge.close()


def test_noisy_f1_is_the_task_reward_plus_seeded_noise(agl_gateway: Any, tmp_path: Path) -> None:
    rollouts = run_group(agl_gateway, ["ro-7", "ro-3"], "g1")  # answers "answer 7" / "answer 3", gold "7"
    exact = _scores(noisy_f1_judge(0.0), agl_gateway.store, rollouts, tmp_path / "a")
    assert exact == {"ro-7": pytest.approx(reward("answer 7", "7"), abs=1e-4), "ro-3": 0.0}
    noisy = _scores(noisy_f1_judge(0.3, seed=1), agl_gateway.store, rollouts, tmp_path / "b")
    again = _scores(noisy_f1_judge(0.3, seed=1), agl_gateway.store, rollouts, tmp_path / "c")
    other = _scores(noisy_f1_judge(0.3, seed=2), agl_gateway.store, rollouts, tmp_path / "d")
    assert noisy == again and noisy != exact and noisy != other
    assert all(0.0 <= v <= 1.0 for v in noisy.values())


def test_rubric_judge_is_absolute_with_the_reference(agl_gateway: Any, tmp_path: Path) -> None:
    rollouts = run_group(agl_gateway, ["ro-7", "ro-3"], "g1")
    assert _scores(rubric_judge(), agl_gateway.store, rollouts, tmp_path) == {"ro-7": 0.5, "ro-3": 0.0}
