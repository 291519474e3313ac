"""agl.Judge on real rollouts: the judge model is agl's scripted backend behind the judge's own gateway."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from judge_helpers import run_group, scores_from_answers

import agl
from agl import semconv as sc
from agl.gateway.testing import ScriptedBackend, reply
from agl.judge import JudgeUnavailable

pytest.importorskip("openai")  # the judged agents call the gateway with the openai client


def judge_of(script: Any, tmp_path: Any, **kw: Any) -> agl.Judge:
    backend = ScriptedBackend(script, accept_any_model=True, on_exhausted="error")
    return agl.Judge(backend=backend, model="judge-model", backoff_s=0.01, **kw).open(tmp_path / "judge")


def test_relative_scores_reach_the_right_rollouts_and_are_recorded(agl_gateway: Any, tmp_path: Any) -> None:
    rollouts = run_group(agl_gateway, ["ro-3", "ro-7", "ro-5"], "g1")
    judge = judge_of(scores_from_answers, tmp_path)
    try:
        report = judge.score(agl_gateway.store, rollouts)
        assert report.scores == {"ro-3": 0.3, "ro-7": 0.7, "ro-5": 0.5}
        assert report.calls == 1 and report.groups == 1 and report.groups_skipped == 0
        assert report.prompt_tokens > 0 and report.completion_tokens > 0
        # every score traces back to the judge call that made it: a rollout in the judge store
        jid = report.judge_rollouts["ro-7"]
        jr = judge.store.get_rollout(jid)
        assert jr.status == "succeeded" and jr.metadata["agl.judge"]["judged"] == ["ro-3", "ro-7", "ro-5"]
        spans = judge.store.query_spans(rollout_id=jid)
        chat = [s for s in spans if s.name == sc.SPAN_CHAT]
        assert chat and "answer 7" in chat[0].attributes[sc.GEN_AI_INPUT_MESSAGES]
        obj = [json.loads(s.attributes[sc.AGL_OBJECT_JSON]) for s in spans if s.name == sc.SPAN_OBJECT]
        assert obj[0]["scores"][1][0] == 0.7 and obj[0]["judged"][1] == "ro-7"
    finally:
        judge.close()


def test_malformed_reply_is_repaired_once(agl_gateway: Any, tmp_path: Any) -> None:
    rollouts = run_group(agl_gateway, ["ro-2", "ro-4"], "g1")
    good = json.dumps({"scores": [{"id": "t1", "score": 0.1, "reason": "x"}, {"id": "t2", "score": 0.9}]})
    judge = judge_of(["Sure! Here are the scores: t1 is good", good], tmp_path)
    try:
        report = judge.score(agl_gateway.store, rollouts)
        assert report.repairs == 1 and report.calls == 2
        assert report.scores == {"ro-2": 0.1, "ro-4": 0.9}
    finally:
        judge.close()


@pytest.mark.parametrize(
    "bad",
    [
        '{"scores": [{"id": "t1", "score": 0.5}]}',
        '{"scores": [{"id": "t1", "score": 1.5}, {"id": "t2", "score": 0}]}',
    ],
)
def test_malformed_twice_skips_the_group_and_counts_it(agl_gateway: Any, tmp_path: Any, bad: str) -> None:
    rollouts = run_group(agl_gateway, ["ro-2", "ro-4"], "g1")
    judge = judge_of([bad, bad], tmp_path)
    try:
        report = judge.score(agl_gateway.store, rollouts)
        assert report.scores == {} and report.groups_skipped == 1
        assert sorted(report.skipped_rollouts) == ["ro-2", "ro-4"]
        (jr,) = judge.store.query_rollouts(mode="test")
        assert jr.status == "failed"
    finally:
        judge.close()


def test_cache_hits_on_a_rerun(agl_gateway: Any, tmp_path: Any) -> None:
    rollouts = run_group(agl_gateway, ["ro-1", "ro-6"], "g1")
    first = judge_of(scores_from_answers, tmp_path)
    try:
        a = first.score(agl_gateway.store, rollouts)
    finally:
        first.close()
    second = judge_of(["never asked"], tmp_path)
    try:
        b = second.score(agl_gateway.store, rollouts)
        assert b.calls == 0 and b.cache_hits == 1 and b.scores == a.scores == {"ro-1": 0.1, "ro-6": 0.6}
        assert b.judge_rollouts == a.judge_rollouts
    finally:
        second.close()
    other_rubric = judge_of(scores_from_answers, tmp_path, rubric="Only brevity matters.")
    try:
        assert other_rubric.score(agl_gateway.store, rollouts).calls == 1  # the rubric is in the key
    finally:
        other_rubric.close()


def test_absolute_mode_is_one_call_per_rollout_with_the_reference(agl_gateway: Any, tmp_path: Any) -> None:
    rollouts = run_group(agl_gateway, ["ro-7", "ro-2"], "g1")
    seen: list[str] = []

    def exact(request: Any) -> str:
        prompt = request.messages[-1]["content"]
        seen.append(prompt)
        ref = re.search(r"Reference answer:\n(\d+)", prompt).group(1)
        got = re.findall(r"answer (\d+)", prompt)[-1]
        return json.dumps({"scores": [{"id": "t1", "score": float(got == ref), "reason": "match"}]})

    judge = judge_of(exact, tmp_path, mode="absolute", reference="answer")
    try:
        report = judge.score(agl_gateway.store, rollouts)
        assert report.calls == 2 and report.scores == {"ro-7": 1.0, "ro-2": 0.0}
        assert all("Reference answer:\n7" in p for p in seen)
    finally:
        judge.close()


def test_failing_endpoint_is_retried_then_fails_loudly(agl_gateway: Any, tmp_path: Any) -> None:
    rollouts = run_group(agl_gateway, ["ro-1", "ro-2"], "g1")
    judge = judge_of([reply(error="upstream down")], tmp_path, retries=2)
    judge.backend_arg.on_exhausted = "repeat"
    try:
        with pytest.raises(JudgeUnavailable, match="failed 3 times"):
            judge.score(agl_gateway.store, rollouts)
        assert judge.backend_arg.calls == 3
    finally:
        judge.close()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="mode"):
        agl.Judge(base_url="http://127.0.0.1:1/v1", mode="pairwise")
    with pytest.raises(ValueError, match="exactly one"):
        agl.Judge()
    with pytest.raises(ValueError, match="rubric"):
        agl.Judge(base_url="http://127.0.0.1:1/v1", rubric=" ")
