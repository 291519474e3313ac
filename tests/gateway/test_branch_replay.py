"""Branching at a call (issue 56): the gateway replays a parent rollout's calls up to the branch call
(the parent's response, no backend call) and samples the branch call afresh with the branch's own seed;
a program that is not deterministic is answered 422; bad branch requests are UsageErrors. Real gateway
over HTTP, the OpenAI SDK as client, the scripted backend (its reply depends on the call's seed, as a
sampling engine's does)."""

from __future__ import annotations

from typing import Any

import pytest
from gw_helpers import server_spans

from agl import semconv as sc
from agl.errors import UsageError
from agl.gateway.testing import ScriptedBackend, serve_gateway
from agl.trainer.branching import enqueue_branches, is_branch_group, without_replayed
from agl.types import NewRollout

openai = pytest.importorskip("openai")

WRITER, REWRITER = "Write the query.", "Fix the query."


class Script:
    """The writer always writes a failing query; the rewriter's fix depends on the call's seed."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, gen: Any) -> str:
        system = gen.messages[0]["content"]
        self.calls.append(system)
        return "SELECT nme FROM t" if system == WRITER else f"SELECT name FROM t -- {gen.seed}"


def repair(url: str, question: str, fix: str = "the column does not exist") -> str:
    """The program: the writer's query 'fails', the rewriter repairs it (deterministic given replies)."""
    client = openai.OpenAI(base_url=url, api_key="x")
    ask = [{"role": "system", "content": WRITER}, {"role": "user", "content": question}]
    query = client.chat.completions.create(model="m", messages=ask).choices[0].message.content
    fix_ask = [{"role": "system", "content": REWRITER}, {"role": "user", "content": f"{query}\n{fix}"}]
    return client.chat.completions.create(model="m", messages=fix_ask).choices[0].message.content or ""


def run_one(store: Any, url: Any, program: Any) -> str:
    claim = store.claim("test-worker")
    assert claim is not None
    rid, attempt = claim.rollout.id, claim.attempt.number
    try:
        program(url.for_rollout(rid, attempt))
    except openai.APIStatusError:
        store.finish_attempt(rid, attempt, "failed")
        raise
    store.finish_attempt(rid, attempt, "succeeded")
    return rid


def spans_by_call(store: Any, rid: str) -> dict[int, Any]:
    return {s.attributes[sc.AGL_LLM_CALL_INDEX]: s for s in server_spans(store, rid)}


def test_branches_replay_the_calls_before_the_branch_and_sample_it_afresh(store: Any) -> None:
    script = Script()
    store.enqueue([NewRollout(id="parent", group_id="q1-s0", metadata={sc.ROLLOUT_SEED_KEY: 11})])
    with serve_gateway(ScriptedBackend(script), store) as url:
        run_one(store, url, lambda u: repair(u, "names?"))
        ids = enqueue_branches(store, "parent", 1, 3, metadata={"step": 0})
        fixes = []
        for _ in ids:
            run_one(store, url, lambda u: fixes.append(repair(u, "names?")))
        stats = url.gateway.replays
    assert script.calls.count(WRITER) == 1, "the writer's call was replayed, never sent to the backend"
    assert script.calls.count(REWRITER) == 4 and stats.replayed == 3 and stats.branched == 3
    assert len(set(fixes)) == 3, "each branch samples its own continuation (its own seed)"
    parent = spans_by_call(store, "parent")
    for rid in ids:
        r = store.get_rollout(rid)
        assert r.metadata[sc.ROLLOUT_BRANCH_KEY]["parent"] == "parent"
        assert r.metadata[sc.ROLLOUT_BRANCH_KEY]["call"] == 1 and r.metadata["step"] == 0
        assert is_branch_group(r.group_id) and r.group_id.startswith("q1-s0")
        calls = spans_by_call(store, rid)
        replayed, branch = calls[0].attributes, calls[1].attributes
        assert replayed[sc.AGL_LLM_REPLAYED] and sc.AGL_LLM_BRANCH_POINT not in replayed
        for key in (sc.AGL_LLM_PROMPT_TOKEN_IDS, sc.AGL_LLM_RESPONSE_TOKEN_IDS, sc.GEN_AI_OUTPUT_MESSAGES):
            assert replayed[key] == parent[0].attributes[key], "the parent's response, exactly"
        assert branch[sc.AGL_LLM_BRANCH_POINT] and sc.AGL_LLM_REPLAYED not in branch
        assert branch[sc.AGL_LLM_PROMPT_TOKEN_IDS] == parent[1].attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS]
        assert branch[sc.AGL_LLM_SEED] != parent[1].attributes[sc.AGL_LLM_SEED]
    assert len({store.get_rollout(rid).group_id for rid in ids}) == 1, "the branches form one group"


def test_a_program_that_is_not_deterministic_is_refused_at_the_divergent_call(store: Any) -> None:
    store.enqueue([NewRollout(id="parent", metadata={sc.ROLLOUT_SEED_KEY: 3})])
    with serve_gateway(ScriptedBackend(Script()), store) as url:
        run_one(store, url, lambda u: repair(u, "names?"))
        enqueue_branches(store, "parent", 1, 2)
        with pytest.raises(
            openai.UnprocessableEntityError
        ) as err:  # another question: the replay is not the parent's
            run_one(store, url, lambda u: repair(u, "ages?"))
        assert err.value.body["code"] == "branch_replay_diverged"
        with pytest.raises(
            openai.UnprocessableEntityError, match="messages differ"
        ):  # the branch call's prompt too
            run_one(store, url, lambda u: repair(u, "names?", fix="something else"))


def test_bad_branch_requests_are_usage_errors(store: Any) -> None:
    store.enqueue([NewRollout(id="parent"), NewRollout(id="queued")])
    with serve_gateway(ScriptedBackend(Script()), store) as url:
        run_one(store, url, lambda u: repair(u, "names?"))
    with pytest.raises(UsageError, match="k >= 2"):
        enqueue_branches(store, "parent", 1, 1)
    with pytest.raises(UsageError, match=r"made the calls \[0, 1\]"):
        enqueue_branches(store, "parent", 5, 2)
    with pytest.raises(UsageError, match="no such rollout"):
        enqueue_branches(store, "nobody", 0, 2)
    with pytest.raises(UsageError, match="queued, not succeeded"):
        enqueue_branches(store, "queued", 0, 2)
    assert [r.id for r in store.query_rollouts()] == ["parent", "queued"], "nothing enqueued"


def test_replayed_calls_leave_the_branchs_transitions(store: Any) -> None:
    """The adapter turns a branch's spans into transitions; the replayed writer call is left out."""
    from agl.adapter import Adapter

    store.enqueue([NewRollout(id="parent", metadata={sc.ROLLOUT_SEED_KEY: 5})])
    with serve_gateway(ScriptedBackend(Script()), store) as url:
        run_one(store, url, lambda u: repair(u, "names?"))
        (rid,) = enqueue_branches(store, "parent", 1, 2)[:1]
        run_one(store, url, lambda u: repair(u, "names?"))
    rollout = store.get_rollout(rid)
    ts = Adapter().from_store(store, [rollout])
    kept = without_replayed(store, rollout, ts)
    assert len(ts) == 2 and len(kept) == 1
    assert kept[0].messages[0]["content"] == REWRITER
