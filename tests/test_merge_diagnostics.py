"""Multi-turn merging diagnostics on real recorded spans: ``adapter.stats``, ``agl transitions`` and
``agl export --form trajectories``.

A two-agent app runs through agl's Runner against agl's real gateway (scripted backend, SmolLM2
tokenizer, SQLite store) with the real openai client: the writer holds one growing conversation (a
tool call, the tool's result, a follow-up question), so its calls extend one another exactly; the
checker asks a fresh question each time (a new conversation: ``diverged``) and once re-asks its
first question with the answer left out (``truncated``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.adapter import Adapter  # noqa: E402
from agl.adapter.trajectories import Trajectory  # noqa: E402
from agl.cli import main  # noqa: E402
from agl.gateway.testing import tool_call  # noqa: E402
from agl.reports.export import export  # noqa: E402
from agl.store import open as open_store  # noqa: E402
from agl.tracing import provider as tracing  # noqa: E402
from agl.types import LLM, NewRollout  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def agl_policy() -> Any:
    """The writer looks something up first, then answers; the checker approves."""

    def policy(request: Any) -> Any:
        system = request.messages[0]["content"]
        if "checker" in system:
            return "Looks fine."
        if request.messages[-1]["role"] == "user" and len(request.messages) == 2:
            return tool_call("lookup", {"q": request.messages[-1]["content"]})
        return f"Answer {len(request.messages)}"

    return policy


@pytest.fixture(autouse=True)
def _instrumented() -> Iterator[None]:
    agl.instrument("openai")
    yield
    agl.uninstrument()
    tracing.reset_tracing()


def _agent(name: str) -> Any:
    return tracing.get_tracer("tests.agent").start_as_current_span(
        sc.SPAN_INVOKE_AGENT,
        attributes={sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT, sc.GEN_AI_AGENT_NAME: name},
    )


def _ask(client: Any, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model="scripted", messages=messages, max_tokens=128, **kw)


def app(task: dict[str, Any], resources: agl.Resources) -> float:
    llm = resources.llm
    assert llm is not None
    client = openai.OpenAI(base_url=llm.base_url, api_key="x")
    with _agent("writer"):
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": "You are the writer."},
            {"role": "user", "content": task["q"]},
        ]
        out = _ask(client, msgs, tools=TOOLS).choices[0].message
        msgs.append(out.model_dump(exclude_none=True))
        msgs.append({"role": "tool", "tool_call_id": out.tool_calls[0].id, "content": "42"})
        out = _ask(client, msgs, tools=TOOLS).choices[0].message
        msgs += [{"role": "assistant", "content": out.content}, {"role": "user", "content": "Sure?"}]
        answer = _ask(client, msgs, tools=TOOLS).choices[0].message.content
    with _agent("checker"):
        first = [
            {"role": "system", "content": "You are the checker."},
            {"role": "user", "content": "Check A"},
        ]
        _ask(client, first)
        _ask(client, [first[0], {"role": "user", "content": "Check B"}])  # a new conversation
        _ask(client, [*first, {"role": "user", "content": "Again"}])  # A again, its answer left out
    return 1.0 if "Answer" in (answer or "") else 0.0


@pytest.fixture
def recorded(agl_gateway: Any, tmp_path: Any) -> tuple[str, list[str]]:
    """Two rollouts of one group run by agl's Runner; returns the store URL and the rollout ids."""
    from agl.runner.runner import Runner

    store = agl_gateway.store
    store.add_resources({"main": LLM(base_url=str(agl_gateway), model="scripted")})
    rollouts = store.enqueue([NewRollout(input={"q": f"What is {i} * 6?"}, group_id="g") for i in range(2)])
    ids = [r.id for r in rollouts]
    stats = Runner(app, store, concurrency=1, timeout_s=60).run(max_rollouts=len(ids))
    done = store.wait_for_rollouts(ids, timeout_s=30)
    assert [r.status for r in done] == ["succeeded"] * 2, stats.errors
    return f"sqlite:///{tmp_path / 'agl.db'}", ids  # agl_store's file


def test_adapter_stats_count_merges_tokens_saved_and_breaks(
    recorded: tuple[str, list[str]], agl_gateway: Any
) -> None:
    _, ids = recorded
    adapter = Adapter()
    ts = adapter.from_store(agl_gateway.store, ids)
    assert [t.agent for t in ts if t.rollout_id == ids[0]] == ["writer"] * 3 + ["checker"] * 3
    st = adapter.stats
    # per rollout: the writer's 3 calls make 1 sequence; the checker's 3 calls make 3
    assert (st.transitions, st.sequences, st.merged_calls) == (12, 8, 4)
    assert st.prefix_breaks == {"diverged": 2, "truncated": 2}
    assert st.merge_rate == pytest.approx(4 / 8)
    writer = [t for t in ts if t.rollout_id == ids[0] and t.agent == "writer"]
    per_call = sum(len(t.prompt_ids) + len(t.response_ids) for t in writer)
    merged = len(writer[-1].prompt_ids) + len(writer[-1].response_ids)
    assert st.tokens_saved == 2 * (per_call - merged) > 0
    assert st.tokens_per_call - st.tokens_merged == st.tokens_saved
    d = st.as_dict()
    assert (d["merge_rate"], d["tokens_saved"], d["prefix_breaks"]) == (
        st.merge_rate,
        st.tokens_saved,
        {"diverged": 2, "truncated": 2},
    )
    # the per-attempt stats are the last rollout's share; since() subtracts the break dict too
    assert adapter.last_stats.sequences == 4 and adapter.last_stats.prefix_breaks == {
        "diverged": 1,
        "truncated": 1,
    }
    before = adapter.stats.copy()
    only_writer = Adapter(agents=["writer"])
    only_writer.from_store(agl_gateway.store, ids[:1])
    assert (only_writer.stats.sequences, only_writer.stats.merge_rate, only_writer.stats.prefix_breaks) == (
        1,
        1.0,
        {},
    )
    adapter.from_store(agl_gateway.store, ids[:1])
    since = adapter.stats.since(before)
    assert (since.sequences, since.merged_calls, since.prefix_breaks) == (
        4,
        2,
        {"diverged": 1, "truncated": 1},
    )


def test_transitions_command_shows_the_merge(
    recorded: tuple[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, ids = recorded
    assert main(["transitions", ids[0], "--store", url]) == 0
    text = capsys.readouterr().out
    assert "merged: 6 call(s) -> 4 sequence(s), merge rate 0.50" in text
    assert "prefix breaks: diverged=1, truncated=1" in text
    lines = [line for line in text.splitlines() if line.startswith("#")]
    assert [line.split("seq=")[1].split()[0] for line in lines] == ["0", "0", "0", "1", "2", "3"]
    assert "(break: diverged)" in lines[4] and "(break: truncated)" in lines[5]
    assert "break" not in lines[1] and "break" not in lines[3]


def test_export_writes_merged_trajectories(
    recorded: tuple[str, list[str]], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    url, ids = recorded
    per_call, merged = tmp_path / "calls.jsonl", tmp_path / "trajs.jsonl"
    assert main(["export", "--store", url, "--format", "transitions", "--out", str(per_call)]) == 0
    capsys.readouterr()
    args = [
        "export",
        "--store",
        url,
        "--format",
        "transitions",
        "--form",
        "trajectories",
        "--out",
        str(merged),
    ]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "wrote 8 trajectories record(s)" in err and "from 2 rollout(s), 12 transition(s)" in err
    assert "merged 12 call(s) into 8 sequence(s): merge rate 0.50" in err
    assert "prefix breaks: diverged=2, truncated=2" in err
    calls = {(r["rollout_id"], r["index"]): r for r in map(json.loads, per_call.read_text().splitlines())}
    recs = [json.loads(line) for line in merged.read_text().splitlines()]
    assert len(recs) == 8
    for rec in recs:
        traj = Trajectory.model_validate({k: v for k, v in rec.items() if k != "advantages"})
        assert len(rec["advantages"]) == len(traj.segments)
        full = list(traj.prompt_ids + traj.completion_ids)
        for seg, adv in zip(traj.segments, rec["advantages"], strict=True):
            call = calls[(traj.rollout_id, seg.transition)]
            assert call["agent"] == traj.agent and call["span_id"] == seg.span_id
            assert list(traj.completion_ids[seg.start : seg.end]) == call["response_ids"]
            assert (
                traj.logprobs is not None
                and list(traj.logprobs[seg.start : seg.end]) == call["response_logprobs"]
            )
            assert adv == pytest.approx(call["advantage"]) and seg.reward == call["reward"]
            # the call saw exactly the sequence's tokens before its response
            n = len(traj.prompt_ids) + seg.start
            assert full[:n] == call["prompt_ids"]
        assert sum(traj.loss_mask) == sum(seg.end - seg.start for seg in traj.segments)
    writers = [r for r in recs if r["agent"] == "writer"]
    assert len(writers) == 2 and all(len(r["segments"]) == 3 for r in writers)
    causes = sorted(s["break_cause"] or "" for r in recs if r["agent"] == "checker" for s in r["segments"])
    assert causes == ["", "", "diverged", "diverged", "truncated", "truncated"]


def test_export_form_bad_input_is_one_clear_line(
    recorded: tuple[str, list[str]], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = recorded
    out = tmp_path / "keep.jsonl"
    out.write_text("keep me\n")
    rc = main(["export", "--store", url, "--format", "sft", "--form", "trajectories", "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "agl export: error: --form trajectories applies to --format transitions only "
        "(sft records are one per LLM call)"
    )
    assert out.read_text() == "keep me\n"
    assert [p for p in os.listdir(tmp_path) if p.startswith(".agl-export")] == []
    with pytest.raises(SystemExit):
        main(["export", "--store", url, "--format", "transitions", "--form", "merged", "--out", str(out)])
    assert "invalid choice: 'merged'" in capsys.readouterr().err
    store = open_store(url)
    try:
        with pytest.raises(ValueError, match="unknown export form 'per-call'"):
            export(store, "transitions", str(out), form="per-call")
        with pytest.raises(ValueError, match="applies to --format transitions only"):
            export(store, "dpo", str(out), form="trajectories")
        res = export(store, "transitions", str(tmp_path / "t.jsonl"), form="trajectories")
    finally:
        store.close()
    assert out.read_text() == "keep me\n"
    assert (res.records, res.transitions) == (8, 12) and res.merge is not None and res.merge.merged_calls == 4
