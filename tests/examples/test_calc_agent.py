"""examples/calc_agent: the problems (deterministic, gold answers computed exactly), the calculator tool,
the exact-answer reward, ``dev`` with the scripted model (right, wrong and tool-free answers, a
malformed calculator call penalised by AIR on the call that made it), and ``train`` for a few steps
with a tiny random model."""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from examples.calc_agent import data
from examples.calc_agent.reward import exact_match, parse_answer

# ------------------------------------------------------------------------------------------ data


def test_problems_are_deterministic_disjoint_and_correct() -> None:
    train, test = data.load_tasks("train"), data.load_tasks("test")
    assert train == data.load_tasks("train") and test == data.load_tasks("test")
    assert len(train) == data.TRAIN_SIZE and len(test) == data.TEST_SIZE
    assert not {t["question"] for t in train} & {t["question"] for t in test}
    assert {t["kind"] for t in test} == {f.__name__[1:] for f in data.TEMPLATES}
    for task in train + test:
        value = data.evaluate(task["expression"])
        assert Fraction(task["answer"]) == value >= 0, task
    with pytest.raises(ValueError, match="split"):
        data.load_tasks("dev")


def test_calculator() -> None:
    pytest.importorskip("autogen_agentchat")
    from examples.calc_agent.agent import calculator

    assert calculator("12 * 7 - 5") == "79"
    assert calculator("(93 + 79 + 77) / 3") == "83"
    assert calculator("40 - 4 * 8.60") == "5.6"
    assert calculator("16 * (100 - 10) / 100") == "14.4"
    assert calculator("1,200 + $5") == "1205"
    assert calculator("2 ** 10 % 1000") == "24"
    assert calculator("10 / 4") == "2.5"
    for bad in ("(2 + 3", "2 +", "", "x + 1", "__import__('os')", "[1, 2]", "2 ** 1000", "1 / 0", "abs(-1)"):
        with pytest.raises(ValueError):
            calculator(bad)
    for task in data.load_tasks("test"):  # the tool agrees with the exact gold answer
        assert exact_match(calculator(task["expression"]), task["answer"]) == 1.0, task


# ---------------------------------------------------------------------------------------- reward


@pytest.mark.parametrize(
    ("text", "gold", "reward"),
    [
        ("ANSWER: 70", "70", 1.0),
        ("The result is 70.", "70", 1.0),
        ("ANSWER: 14.40", "14.4", 1.0),
        ("ANSWER: $14.40", "14.4", 1.0),
        ("ANSWER: 1,200", "1200", 1.0),
        ("I used 36 / 6. ANSWER: 6", "6", 1.0),
        ("ANSWER: 6 (from 36 / 6)", "6", 1.0),  # the number after ANSWER, not the last one
        ("ANSWER: 14.39", "14.4", 0.0),
        ("ANSWER: 14", "14.4", 0.0),
        ("ANSWER: 71", "70", 0.0),
        ("I do not know", "70", 0.0),
        ("", "70", 0.0),
        ("ANSWER: -.5", "-0.5", 1.0),
    ],
)
def test_exact_match(text: str, gold: str, reward: float) -> None:
    assert exact_match(text, gold) == reward


def test_parse_answer() -> None:
    assert parse_answer("ANSWER: 83") == 83
    assert parse_answer("answer = 2.5") == Fraction(5, 2)
    assert parse_answer("nothing") is None


# --------------------------------------------------------------------------- dev, scripted model


def test_dev_with_the_scripted_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("autogen_agentchat")
    pytest.importorskip("autogen_ext.models.openai")
    pytest.importorskip("transformers")  # Trainer.dev tokenises with it
    import agl.store
    from agl import semconv as sc
    from agl.adapter import Adapter
    from examples.calc_agent import cli
    from examples.calc_agent.scripted import behaviour, expected_calls

    store = agl.store.open(f"sqlite:///{tmp_path / 'dev.db'}")
    args = cli.parser().parse_args(["dev", "--backend", "scripted", "-n", "12"])
    transitions = cli.dev(args, store=store)
    out = capsys.readouterr().out
    assert "12 rollouts" in out and "agent=solver" in out

    rollouts = {r.id: r for r in store.query_rollouts()}
    assert len(rollouts) == 12 and all(r.status == "succeeded" for r in rollouts.values())
    by_rollout: dict[str, list[Any]] = defaultdict(list)
    for t in transitions:
        by_rollout[t.rollout_id].append(t)
    kinds: Counter[str] = Counter()
    for rid, rollout in rollouts.items():
        task = rollout.input
        kind = behaviour(task)
        kinds[kind] += 1
        ts = sorted(by_rollout[rid], key=lambda t: t.index)
        assert [t.agent for t in ts] == ["solver"] * expected_calls(task), (kind, task)
        final = 0.0 if kind == "wrong" else 1.0
        assert all(t.final_reward == final and t.exact for t in ts), (kind, task)
        assert exact_match(ts[-1].response_text or "", task["answer"]) == final

        spans = store.query_spans(rollout_id=rid)
        tools = [s for s in spans if s.name == sc.SPAN_EXECUTE_TOOL]
        failed = [s for s in tools if s.status.code == "ERROR"]
        assert len(tools) == {"good": 1, "sloppy": 2}.get(kind, 0), (kind, tools)
        assert len(failed) == (1 if kind == "sloppy" else 0)
        if kind == "sloppy":
            # AIR: exactly the call that wrote the malformed expression is penalised (by tool-call id)
            assert [t.intermediate_reward for t in ts] == pytest.approx([-0.1, 0.0, 0.0])
            (message,) = json.loads(ts[0].response_text) if ts[0].response_text.startswith("[") else [None]
            call_id = failed[0].attributes[sc.GEN_AI_TOOL_CALL_ID]
            assert message is not None and message["id"] == call_id
            result = str(failed[0].attributes.get(sc.GEN_AI_TOOL_CALL_RESULT, ""))
            assert "malformed expression" in result + str(failed[0].status.message)
        else:
            assert all(t.intermediate_reward == 0.0 for t in ts)
    assert all(kinds[k] for k in ("good", "sloppy", "wrong", "direct")), kinds

    # selecting another agent name yields nothing; the solver's selection yields everything
    assert Adapter(agents=["verifier"]).from_store(store, list(rollouts)) == []
    assert len(Adapter(agents=["solver"]).from_store(store, list(rollouts))) == len(transitions)


# --------------------------------------------------------------------------- APO, scripted model


def test_apo_with_the_scripted_model_and_a_hosted_style_optimiser(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m examples.calc_agent apo`` on the real AutoGen agent: the scripted model plays the
    solver, a scripted optimiser behind its own gateway plays the hosted one. Its rewrite drops the
    solver's instructions (the scripted solver then refuses), so APO must keep the initial prompt."""
    pytest.importorskip("autogen_agentchat")
    pytest.importorskip("autogen_ext.models.openai")
    from agl.algorithms.apo import CRITIQUE_SYSTEM, REWRITE_SYSTEM
    from agl.gateway.testing import ScriptedBackend, reply, serve_gateway
    from examples.calc_agent import cli
    from examples.calc_agent.agent import AGENT, SYSTEM
    from examples.calc_agent.scripted import ScriptedCalc

    seen: list[list[dict[str, Any]]] = []

    def optimiser(request: Any) -> Any:
        seen.append(request.messages)
        if request.messages[0]["content"] == CRITIQUE_SYSTEM:
            return reply("The solver answers from memory instead of using the calculator.")
        assert request.messages[0]["content"] == REWRITE_SYSTEM
        return reply(json.dumps({"prompt": "Answer from memory."}))

    run = tmp_path / "run"
    with serve_gateway(ScriptedBackend(optimiser, accept_any_model=True)) as url:
        args = cli.parser().parse_args(
            [
                "apo", "--optimizer-base-url", url, "--optimizer-model", "hosted", "--rounds", "1",
                "--beam-width", "1", "--branch-factor", "1", "--rollouts-per-candidate", "8",
                "--val-tasks", "8", "--test-tasks", "8", "--runners", "4", "--run-dir", str(run), "--seed", "1",
            ]
        )  # fmt: skip
        summary = cli.apo(args, backend="scripted", script=ScriptedCalc(), progress=False)
    printed = json.loads(capsys.readouterr().out)
    assert printed["best_prompts"] == summary["best_prompts"] == {AGENT: SYSTEM}
    # any 8 consecutive problems hold 2 the scripted solver gets wrong (seed 1 draws 2 of them for
    # training too); the rewrite is refused on all
    assert (summary["val_reward_before"], summary["val_reward_after"]) == (0.75, 0.75)
    assert (summary["test_reward_before"], summary["test_reward_after"]) == (0.75, 0.75)
    cands = [json.loads(x) for x in (run / "candidates.jsonl").read_text().splitlines()]
    assert [(c["id"], c["val_reward"]) for c in cands] == [("c0", 0.75), ("c1", 0.0)]
    assert cands[1]["prompts"] == {AGENT: "Answer from memory."}
    # the critique saw the solver's prompt and its failing AutoGen traces: agent name, wrong answers
    critique = seen[0][1]["content"]
    assert SYSTEM in critique and f"[{AGENT}] assistant: ANSWER:" in critique
    assert critique.count("### Failure") == 2 and summary["optimizer_calls"] == 2
    assert (run / "optimizer.db").exists() and (run / "reward_curve.png").exists()


# --------------------------------------------------------------------------- train, tiny model


def _tiny_model() -> Any:
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


def test_train_a_few_steps_with_a_tiny_model(tmp_path: Path) -> None:
    pytest.importorskip("autogen_agentchat")
    pytest.importorskip("autogen_ext.models.openai")
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    import torch

    import agl.store
    from agl.adapter import Adapter
    from agl.trainer.trainer import load_tokenizer
    from examples.calc_agent import cli

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run_dir = tmp_path / "run"
    args = cli.parser().parse_args(
        ["train", "--run-dir", str(run_dir), "--steps", "2", "--tasks-per-step", "2", "--group-size", "2",
         "--val-tasks", "2", "--val-every", "2", "--max-tokens", "6", "--runners", "4", "--learning-rate", "1e-3",
         "--lora-r", "4"]
    )  # fmt: skip
    try:
        summary = cli.train(args, model=_tiny_model(), tokenizer=load_tokenizer(), progress=False)
    finally:
        torch.set_num_threads(threads)

    steps = [h for h in summary["history"] if "train_reward" in h]
    assert [h["step"] for h in steps] == [0, 1]
    assert summary["val_reward_before"] is not None and summary["val_reward_after"] is not None
    store = agl.store.open(f"sqlite:///{run_dir / 'store.db'}")
    train_ids = [r.id for r in store.query_rollouts(mode="train")]
    assert len(train_ids) == 2 * 2 * 2
    every = Adapter().from_store(store, train_ids)
    # random tokens are no tool call: one LLM call per rollout, the solver's, and a wrong answer
    assert [t.agent for t in every] == ["solver"] * len(train_ids)
    assert all(t.final_reward == 0.0 and t.exact for t in every)
    for h in steps:
        assert h["transitions"] == 4 and h["train_reward"] == 0.0
        assert h["zero_variance_groups"] == h["groups"] == 2
        assert math.isfinite(h["loss"]) or h["trained_transitions"] == 0


# --------------------------------------------------------------------------- oracle, SFT, warm start


def test_oracle_demonstrations_sft_and_rl_from_the_warm_start(tmp_path: Path) -> None:
    """The recipe's data path end to end, small: the oracle teacher solves every problem through the
    unchanged AutoGen agent (reward 1, calculator called), ``agl export --format sft`` writes the
    tool call as ``tool_calls`` with the tools schema, ``agl sft`` trains a tiny model on the recorded
    token ids, and ``train --warm-start`` continues with LightningRL from its merged model."""
    pytest.importorskip("autogen_agentchat")
    pytest.importorskip("autogen_ext.models.openai")
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    import torch

    import agl.store
    from agl import semconv as sc
    from agl.cli import main as agl_main
    from agl.trainer.trainer import load_tokenizer
    from examples.calc_agent import cli

    db = f"sqlite:///{tmp_path / 'demos.db'}"
    args = cli.parser().parse_args(["dev", "--oracle", "--split", "train", "-n", "6", "--store", db])
    transitions = cli.dev(args)
    store = agl.store.open(db)
    rollouts = store.query_rollouts()
    assert len(rollouts) == 6 and all(r.status == "succeeded" for r in rollouts)
    by: dict[str, list[Any]] = defaultdict(list)
    for t in transitions:
        by[t.rollout_id].append(t)
    for r in rollouts:
        ts = sorted(by[r.id], key=lambda t: t.index)
        assert [t.final_reward for t in ts] == [1.0, 1.0] and all(t.exact for t in ts)
        assert all(t.intermediate_reward == 0.0 for t in ts)
        tools = [s for s in store.query_spans(rollout_id=r.id) if s.name == sc.SPAN_EXECUTE_TOOL]
        assert len(tools) == 1 and tools[0].status.code != "ERROR"
        assert json.loads(tools[0].attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS]) == {
            "expression": r.input["expression"]
        }
    store.close()

    out = tmp_path / "sft.jsonl"
    rc = agl_main(
        [
            "export",
            "--store",
            db,
            "--format",
            "sft",
            "--agents",
            "solver",
            "--min-reward",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 12
    first = [r for r in recs if r["index"] == 0]
    for rec in first:
        call = rec["messages"][-1]
        assert call["role"] == "assistant" and not call["content"]
        (tc,) = call["tool_calls"]
        assert tc["type"] == "function" and tc["function"]["name"] == "calculator"
        assert "expression" in json.loads(tc["function"]["arguments"])
        assert [t["function"]["name"] for t in rec["tools"]] == ["calculator"]
    second = [r for r in recs if r["index"] == 1]
    assert all(r["messages"][-1]["content"].startswith("ANSWER: ") for r in second)
    # the earlier tool call is in the prompt as the agent sent it: a structured call and its result
    assert all(any(m.get("tool_calls") for m in r["messages"][:-1]) for r in second)

    # agl sft on the demonstrations, from a tiny random model saved like any local model
    model_dir = tmp_path / "tiny"
    _tiny_model().save_pretrained(str(model_dir))
    load_tokenizer().save_pretrained(str(model_dir))
    threads = torch.get_num_threads()
    try:
        rc = agl_main(
            ["sft", "--store", db, "--agents", "solver", "--min-reward", "1", "--model", str(model_dir),
             "--out", str(tmp_path / "sft"), "--epochs", "2", "--learning-rate", "1e-3", "--lora-r", "4",
             "--threads", "1"]
        )  # fmt: skip
        assert rc == 0
        summary = json.loads((tmp_path / "sft" / "sft_summary.json").read_text())
        assert summary["examples"] == 12 and summary["agents"] == ["solver"] and summary["exact"] == 12
        assert summary["loss_after"] < summary["loss_before"]

        run_dir = tmp_path / "rl"
        targs = cli.parser().parse_args(
            ["train", "--warm-start", str(tmp_path / "sft"), "--run-dir", str(run_dir), "--steps", "1",
             "--tasks-per-step", "1", "--group-size", "2", "--val-tasks", "1", "--val-every", "1",
             "--max-tokens", "6", "--runners", "2", "--lora-r", "4"]
        )  # fmt: skip
        result = cli.train(targs, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert [h["step"] for h in result["history"] if "train_reward" in h] == [0]
    assert result["val_reward_before"] is not None
