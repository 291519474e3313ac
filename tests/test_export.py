"""Exports (transitions / SFT / DPO JSONL) and the ``agl transitions`` inspection command, run through
the real ``agl`` CLI entry point against a real SQLite store."""

from __future__ import annotations

import json
import os
import random

import pytest

from agl import semconv as sc
from agl.cli import main
from agl.reports.export import dpo_records, export, sft_records
from agl.store import open as open_store
from agl.types import NewRollout, Span, SpanStatus, Transition

PROMPT = [{"role": "user", "content": "What is 6*7?"}]


def _hex(rng: random.Random, n: int) -> str:
    return "".join(f"{rng.randrange(1, 256):02x}" for _ in range(n))


def run_rollout(store, rollout_id: str, calls: list[tuple[str, str, list[int]]], reward: float | None, **kw):
    """Claim ``rollout_id`` and record its spans: one agent per call, each call an exact gateway span."""
    claim = store.claim("w", timeout_s=0)
    assert claim is not None and claim.rollout.id == rollout_id
    rng = random.Random(rollout_id)
    trace = _hex(rng, 16)
    spans = []
    t = 1_000

    def span(name, start, end, parent=None, attrs=None, status="UNSET"):
        s = Span(
            trace_id=trace,
            span_id=_hex(rng, 8),
            parent_id=parent.span_id if parent is not None else None,
            name=name,
            start_ns=start,
            end_ns=end,
            status=SpanStatus(code=status),
            attributes=attrs or {},
            rollout_id=rollout_id,
            attempt=claim.attempt.number,
        )
        spans.append(s)
        return s

    root = span(sc.SPAN_ROLLOUT, 0, 10**6)
    for agent, text, response_ids in calls:
        ag = span(
            sc.SPAN_INVOKE_AGENT,
            t,
            t + 500,
            root,
            {sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT, sc.GEN_AI_AGENT_NAME: agent},
        )
        span(
            sc.SPAN_CHAT,
            t + 10,
            t + 100,
            ag,
            {
                sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT,
                sc.AGL_SIDE: sc.SIDE_SERVER,
                sc.GEN_AI_INPUT_MESSAGES: json.dumps(PROMPT),
                sc.GEN_AI_OUTPUT_MESSAGES: json.dumps(
                    [kw.get("output") or {"role": "assistant", "content": text}]
                ),
                **({sc.GEN_AI_TOOL_DEFINITIONS: json.dumps(kw["tools"])} if kw.get("tools") else {}),
                sc.AGL_LLM_PROMPT_TOKEN_IDS: [1, 2, 3],
                sc.AGL_LLM_RESPONSE_TOKEN_IDS: response_ids,
                sc.AGL_LLM_RESPONSE_LOGPROBS: [-0.5] * len(response_ids),
                **({sc.AGL_LLM_ADAPTER: kw["served"][agent]} if agent in kw.get("served", {}) else {}),
            },
        )
        if kw.get("tool_error") == agent:
            span(
                sc.SPAN_EXECUTE_TOOL,
                t + 200,
                t + 300,
                ag,
                {sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL},
                "ERROR",
            )
        t += 1000
    if reward is not None:
        span(sc.SPAN_REWARD, t, t, root, {sc.AGL_REWARD_VALUE: reward, sc.AGL_REWARD_PRIMARY: True})
    store.add_spans(spans)
    store.finish_attempt(rollout_id, claim.attempt.number, "succeeded")


@pytest.fixture()
def db(tmp_path):
    """A SQLite store with one group of three rollouts (rewards 1, 0, 0.5) and one ungrouped rollout."""
    path = tmp_path / "agl.db"
    url = f"sqlite:///{path}"
    store = open_store(url)
    ids = ["ro-good", "ro-bad", "ro-mid", "ro-solo"]
    store.enqueue([NewRollout(id=i, group_id="g1" if i != "ro-solo" else None) for i in ids])
    run_rollout(store, "ro-good", [("writer", "42", [42, 0]), ("checker", "ok", [7])], 1.0)
    run_rollout(
        store, "ro-bad", [("writer", "41", [41, 0]), ("checker", "no", [8])], 0.0, tool_error="checker"
    )
    run_rollout(store, "ro-mid", [("writer", "42.0", [42, 1, 0])], 0.5)
    run_rollout(store, "ro-solo", [("writer", "?", [9])], None)
    store.close()
    return url


def read(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_export_transitions_with_advantages(db, tmp_path, capsys) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["export", "--store", db, "--format", "transitions", "--out", str(out)]) == 0
    recs = read(out)
    assert len(recs) == 6
    by = {(r["rollout_id"], r["index"]): r for r in recs}
    assert by[("ro-good", 0)]["response_ids"] == [42, 0] and by[("ro-good", 0)]["agent"] == "writer"
    # the failing tool penalised ro-bad's checker call (its second transition)
    assert by[("ro-bad", 1)]["intermediate_reward"] == pytest.approx(-0.1)
    assert by[("ro-bad", 0)]["intermediate_reward"] == 0.0
    # group g1: finals 1, 0, 0.5 -> mean 0.5, std 0.5; ro-good's returns are 1.0 -> advantage ~1
    assert by[("ro-good", 0)]["advantage"] == pytest.approx(1.0, abs=1e-4)
    assert by[("ro-bad", 1)]["advantage"] == pytest.approx(-1.2, abs=1e-4)
    assert by[("ro-solo", 0)]["advantage"] == 0.0 and by[("ro-solo", 0)]["final_reward"] == 0.0
    for r in recs:
        Transition.model_validate({k: v for k, v in r.items() if k != "advantage"})
    assert "wrote 6 transitions record(s)" in capsys.readouterr().err


def test_export_sft_respects_agents_and_min_reward(db, tmp_path) -> None:
    out = tmp_path / "sft.jsonl"
    rc = main(
        [
            "export",
            "--store",
            db,
            "--format",
            "sft",
            "--agents",
            "writer",
            "--min-reward",
            "0.5",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    recs = read(out)
    assert sorted(r["rollout_id"] for r in recs) == ["ro-good", "ro-mid"]
    good = next(r for r in recs if r["rollout_id"] == "ro-good")
    assert good["messages"] == [*PROMPT, {"role": "assistant", "content": "42"}]
    assert good["agent"] == "writer" and good["response_ids"] == [42, 0]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


def test_export_sft_writes_tool_calls_and_the_tools_schema(tmp_path) -> None:
    """A tool-call turn is exported as OpenAI ``tool_calls`` (not JSON text in ``content``), with the
    tools the model was offered, and the exact token ids the gateway recorded."""
    url = f"sqlite:///{tmp_path / 'tools.db'}"
    store = open_store(url)
    store.enqueue([NewRollout(id="ro-tool", group_id="g")])
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'},
    }
    output = {"role": "assistant", "content": None, "tool_calls": [call]}
    run_rollout(store, "ro-tool", [("solver", "", [5, 6, 0])], 1.0, output=output, tools=TOOLS)
    store.close()
    out = tmp_path / "sft.jsonl"
    assert main(["export", "--store", url, "--format", "sft", "--out", str(out)]) == 0
    (rec,) = read(out)
    assert rec["messages"] == [*PROMPT, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert rec["tools"] == TOOLS
    assert rec["prompt_ids"] == [1, 2, 3] and rec["response_ids"] == [5, 6, 0]


def test_export_dpo_best_vs_worst(db, tmp_path) -> None:
    out = tmp_path / "dpo.jsonl"
    assert (
        main(["export", "--store", db, "--format", "dpo", "--agents-regex", "wri.*", "--out", str(out)]) == 0
    )
    (rec,) = read(out)
    assert rec["prompt"] == PROMPT
    assert rec["chosen"] == [{"role": "assistant", "content": "42"}]
    assert rec["rejected"] == [{"role": "assistant", "content": "41"}]
    assert (rec["chosen_rollout_id"], rec["rejected_rollout_id"]) == ("ro-good", "ro-bad")
    assert (rec["chosen_reward"], rec["rejected_reward"]) == (1.0, 0.0)


def test_dpo_skips_ties_single_groups_and_prompt_mismatch() -> None:
    def t(rid, group, final, messages=PROMPT, text="x"):
        return Transition(
            rollout_id=rid,
            attempt=1,
            group_id=group,
            index=0,
            prompt_ids=(1,),
            response_ids=(2,),
            final_reward=final,
            messages=tuple(messages),
            response_text=text,
        )

    from agl.reports.export import ExportResult

    res = ExportResult()
    recs = dpo_records(
        [
            t("a", "tie", 1.0),
            t("b", "tie", 1.0),
            t("c", "one", 1.0),
            t("d", "mismatch", 1.0),
            t("e", "mismatch", 0.0, [{"role": "user", "content": "other"}]),
            t("f", None, 1.0),
        ],
        result=res,
    )
    assert recs == []
    assert res.skipped == {
        "no_reward_spread": 1,
        "single_rollout_group": 1,
        "prompt_mismatch": 1,
        "no_group": 1,
    }
    assert sft_records([t("a", "g", 0.2)], min_reward=0.5) == []


def test_export_is_all_or_nothing_and_bad_input_is_clear(db, tmp_path, capsys) -> None:
    out = tmp_path / "x.jsonl"
    out.write_text("keep me\n")
    rc = main(
        ["export", "--store", db, "--format", "sft", "--rollouts", "ro-good,missing", "--out", str(out)]
    )
    assert rc == 2
    assert "missing" in capsys.readouterr().err
    assert out.read_text() == "keep me\n"
    assert [p for p in os.listdir(tmp_path) if p.startswith(".agl-export")] == []
    with pytest.raises(SystemExit):
        main(["export", "--store", db, "--format", "csv", "--out", str(out)])
    store = open_store(db)
    try:
        with pytest.raises(ValueError, match="unknown export format"):
            export(store, "csv", str(out))
    finally:
        store.close()


def test_transitions_command_prints_each_transition(db, capsys) -> None:
    assert main(["transitions", "ro-bad", "--store", db]) == 0
    text = capsys.readouterr().out
    assert "rollout ro-bad" in text and "status=succeeded" in text
    assert "#0   agent=writer  exact=yes  seq=0  prompt=3 tok  response=2 tok" in text
    assert "#1   agent=checker" in text and "intermediate=-0.100" in text and "return=-0.100" in text
    assert "response 41" in text and "[user] What is 6*7?" in text
    assert "tool_error" in text


def test_transitions_command_decodes_with_a_tokenizer_and_json(db, capsys) -> None:
    pytest.importorskip("tokenizers")
    from agl.chat.tokenizer import load_default_tokenizer

    tok = load_default_tokenizer()
    assert (
        main(["transitions", "ro-good", "--store", db, "--tokenizer", "default", "--agents", "checker"]) == 0
    )
    text = capsys.readouterr().out
    assert f"response {tok.decode([7])}" in text and "agent=writer" not in text
    assert main(["transitions", "ro-good", "--store", db, "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [x["agent"] for x in lines] == ["writer", "checker"]
    assert main(["transitions", "ro-nope", "--store", db]) == 2
    assert "ro-nope" in capsys.readouterr().err


def test_python_api_export_to_file(db, tmp_path) -> None:
    store = open_store(db)
    try:
        res = export(store, "transitions", str(tmp_path / "o.jsonl"), rollout_ids=["ro-mid"])
    finally:
        store.close()
    assert (res.records, res.rollouts, res.transitions) == (1, 1, 1)
