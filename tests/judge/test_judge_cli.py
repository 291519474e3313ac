"""``agl judge`` against a store of real rollouts, the judge endpoint a real agl gateway (scripted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from judge_helpers import run_group, scores_from_answers

from agl import semconv as sc
from agl.cli import main
from agl.gateway.testing import ScriptedBackend, serve_gateway
from agl.judge.record import META_KEY

pytest.importorskip("openai")  # the judged agents call the gateway with the openai client


@pytest.fixture
def judge_url() -> Any:
    with serve_gateway(ScriptedBackend(scores_from_answers, accept_any_model=True)) as url:
        yield url


def test_agl_judge_writes_judge_spans_beside_the_rollouts(
    agl_gateway: Any, judge_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_group(agl_gateway, ["ro-3", "ro-8"], "g1")
    run_group(agl_gateway, ["ro-5"], "g2")
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Higher numbers are better.\n")
    url = f"sqlite:///{tmp_path / 'agl.db'}"
    args = ["judge", "--store", url, "--base-url", judge_url, "--model", "j", "--rubric", str(rubric)]
    assert main([*args, "--json"]) == 0
    rows = {r["rollout_id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert {k: v["score"] for k, v in rows.items()} == {"ro-3": 0.3, "ro-8": 0.8, "ro-5": 0.5}
    store = agl_gateway.store
    judged = [r for r in store.query_rollouts(mode="test") if META_KEY in r.metadata]
    assert len(judged) == 2 and all(r.status == "succeeded" for r in judged)  # one call per group
    spans = store.query_spans(rollout_id=rows["ro-8"]["judge_rollout_id"])
    assert {s.name for s in spans} >= {sc.SPAN_CHAT, sc.SPAN_OBJECT}
    # a second run skips the judge's own rollouts and scores the same three again
    assert main([*args, "--json"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_agl_judge_refuses_a_store_it_cannot_write(
    judge_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("x")
    bad = "sqlite:////proc/agl-judge/cannot.db"
    rc = main(["judge", "--store", bad, "--base-url", judge_url, "--model", "j", "--rubric", str(rubric)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("agl judge: error: cannot open the store") and err.count("\n") == 1


def test_agl_judge_bad_rubric_is_one_line(
    judge_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    rc = main(["judge", "--store", url, "--base-url", judge_url, "--model", "j", "--rubric", "/nope.txt"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot read the rubric file /nope.txt" in err and err.count("\n") == 1
