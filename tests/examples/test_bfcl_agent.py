"""examples/bfcl_agent: the reward is BFCL's checker (BFCL's possible answers score 1, perturbed ones 0,
as BFCL's checker says), the agent behind agl's real gateway with a scripted engine (a right call 1, a
wrong argument 0, prose 0 with AIR's penalty), BFCL's multi-turn loop against its own API classes, the
eval command end to end, and bad input refused. Skipped when ``bfcl_eval`` is not importable."""

from __future__ import annotations

import ast
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from examples.bfcl_agent import bfcl

pytestmark = pytest.mark.skipif(bfcl.unavailable() is not None, reason=str(bfcl.unavailable()))


def _as_call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "arguments": json.dumps(args)}


# ------------------------------------------------------------------------------------- data, reward


def test_the_split_is_seeded_by_case_and_disjoint() -> None:
    from examples.bfcl_agent import data

    train, test = data.load_tasks("train"), data.load_tasks("test")
    assert [t["id"] for t in train] == [t["id"] for t in data.load_tasks("train")]
    assert not {t["id"] for t in train} & {t["id"] for t in test}
    for category in data.SPLIT_CATEGORIES:
        n_train = sum(t["category"] == category for t in train)
        n_test = sum(t["category"] == category for t in test)
        assert n_test == round((n_train + n_test) * data.HELD_OUT_FRACTION) > 0
    assert all("ground_truth" not in t for t in train + test)  # the agent never sees the answers
    with pytest.raises(ValueError, match="unknown BFCL category"):
        data.load_tasks("test", ["simple_rust"])


def test_the_reward_agrees_with_bfcls_checker_on_its_possible_answers() -> None:
    from examples.bfcl_agent import data
    from examples.bfcl_agent.reward import score
    from examples.bfcl_agent.scripted import _perturb, answer_calls

    tasks = data.load_tasks("all")
    assert len(tasks) == 1240
    for task in tasks:
        calls = answer_calls(task)
        assert score(task, [_as_call(n, a) for n, a in calls]) == (1.0, None), task["id"]
        if not calls:  # irrelevance: any call is wrong, by BFCL's rule
            assert score(task, [_as_call(task["function"][0]["name"], {})])[0] == 0.0
            continue
        first_name, first_args = calls[0]
        perturbed = [_as_call(first_name, _perturb(first_args))] + [_as_call(n, a) for n, a in calls[1:]]
        got = score(task, perturbed)
        decoded = [{c["name"]: json.loads(c["arguments"])} for c in perturbed]
        direct = bfcl.ast_check(task["function"], decoded, data.answer(task), task["category"])
        assert got[0] == float(direct["valid"]) and got[1] == direct.get("error_type"), task["id"]
        if first_args:
            assert got[0] == 0.0, task["id"]
        assert score(task, [])[1] == "ast_decoder:decoder_failed"
        assert score(task, [{"name": first_name, "arguments": "{not json"}])[0] == 0.0


def test_failure_kinds_are_the_checkers_terms() -> None:
    from examples.bfcl_agent.reward import kind_of

    assert kind_of(None, 1) is None
    assert kind_of("ast_decoder:decoder_failed", 0) == "no call"
    assert kind_of("simple_function_checker:wrong_func_name", 1) == "wrong function"
    assert kind_of("type_error:simple", 1) == "wrong argument type"
    assert kind_of("value_error:string", 1) == "wrong value"
    assert kind_of("irrelevance_error:decoder_success", 1) == "call where none fits"


# ---------------------------------------------------------------- the agent behind agl's gateway


def _dev(tmp_path: Path, tasks: list[dict[str, Any]], script: Any) -> tuple[Any, list[Any]]:
    import agl.store
    from agl import Trainer
    from examples.bfcl_agent.agent import AGENT, make_rollout

    store = agl.store.open(f"sqlite:///{tmp_path / 'dev.db'}")
    trainer = Trainer(
        backend="scripted", script=script, agents=[AGENT], store=store, runners=4, progress=False,
        sampling={"max_tokens": 512, "temperature": 0.0},
    )  # fmt: skip
    return store, trainer.dev(make_rollout(), tasks, show=False)


@pytest.mark.parametrize(
    ("behaviour", "reward", "air"),
    [("right", 1.0, 0.0), ("wrong_value", 0.0, 0.0), ("prose", 0.0, -0.1), ("unknown_function", 0.0, -0.1)],
)
def test_the_agents_call_is_scored_by_bfcls_checker(
    tmp_path: Path, behaviour: str, reward: float, air: float
) -> None:
    pytest.importorskip("transformers")  # Trainer.dev tokenises with it
    from examples.bfcl_agent import data
    from examples.bfcl_agent.scripted import ScriptedBFCL

    tasks = data.load_tasks("test", ["simple_python", "multiple", "parallel"], limit=6)
    store, transitions = _dev(tmp_path, tasks, ScriptedBFCL(behaviour=behaviour))
    by_rollout: dict[str, list[Any]] = defaultdict(list)
    for t in transitions:
        by_rollout[t.rollout_id].append(t)
    assert len(by_rollout) == len(tasks)
    for ts in by_rollout.values():
        assert len(ts) == 1 and ts[0].agent == "caller"
        assert ts[0].final_reward == reward
        assert ts[0].intermediate_reward == pytest.approx(air)


def test_irrelevance_no_call_is_right_and_unpenalised(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from examples.bfcl_agent import data
    from examples.bfcl_agent.scripted import ScriptedBFCL

    tasks = data.load_tasks("test", ["irrelevance"], limit=3)
    _, transitions = _dev(tmp_path, tasks, ScriptedBFCL(oracle=True))
    assert [t.final_reward for t in transitions] == [1.0] * 3
    assert all(t.intermediate_reward == 0.0 for t in transitions)


def _calls_of(line: str) -> tuple[str, dict[str, Any]]:
    """A ground-truth call string (``cd(folder='document')``) as a tool call's name and arguments."""
    node = ast.parse(line, mode="eval").body
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    assert not node.args, line
    return node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords}


def test_the_multi_turn_loop_runs_against_bfcls_classes(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from agl import semconv as sc
    from agl.gateway.testing import reply, tool_call
    from examples.bfcl_agent import data

    (task,) = [t for t in data.load_tasks("all", [data.MULTI_TURN]) if t["id"] == "multi_turn_base_1"]
    truth = data.answer(task)
    script = []
    for turn in truth:  # each turn: the ground truth's calls in one reply, then a reply without calls
        script += [reply(None, *(tool_call(*_calls_of(c)) for c in turn)), reply("Done.")]
    store, transitions = _dev(tmp_path, [task], script)
    assert len(transitions) == 2 * len(truth)
    assert all(t.final_reward == 1.0 for t in transitions)
    tools = [s for s in store.query_spans() if s.name == sc.SPAN_EXECUTE_TOOL]
    assert len(tools) == sum(len(turn) for turn in truth)
    results = [str(s.attributes.get(sc.GEN_AI_TOOL_CALL_RESULT, "")) for s in tools]
    assert any("log.txt" in r for r in results), results  # BFCL's file system answered

    # the same conversation missing its last turn's calls fails BFCL's checker
    short = script[:-2] + [reply("I am done."), reply("Done.")]
    _, transitions = _dev(tmp_path / "short", [task], short)
    assert transitions and all(t.final_reward == 0.0 for t in transitions)


# ------------------------------------------------------------------------------------ the eval command


def test_the_eval_command_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from examples.bfcl_agent import cli

    args = cli.parser().parse_args(
        [
            "eval",
            "--category",
            "simple_python",
            "--limit",
            "8",
            "--backend",
            "scripted",
            "--max-tokens",
            "512",
            "--no-progress",
        ]
    )
    summary = cli.evaluate(args)
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == summary
    # ScriptedBFCL's behaviours cycle by case number: right, wrong value, prose, unknown function
    from examples.bfcl_agent import data
    from examples.bfcl_agent.scripted import BEHAVIOURS

    tasks = data.load_tasks("test", ["simple_python"], limit=8)
    right = sum(BEHAVIOURS[int(t["id"].rsplit("_", 1)[1]) % 4] == "right" for t in tasks)
    assert summary["n"] == 8 and summary["accuracy"] == round(right / 8, 4)
    assert set(summary["failures"]) <= {"no call", "wrong function", "wrong value"}
    assert "BFCL simple_python" in out[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["eval", "--category", "simple_rust"], "unknown BFCL category 'simple_rust'"),
        (
            ["eval", "--category", "simple_python", "--model", "/no/such/dir"],
            "--model /no/such/dir: no such folder",
        ),
        (
            ["eval", "--category", "parallel", "--adapter", "/no/such/dir"],
            "--adapter /no/such/dir: no such folder",
        ),
    ],
)
def test_bad_input_is_refused_in_one_line(argv: list[str], message: str) -> None:
    from examples.bfcl_agent import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert message in str(exc.value) and "\n" not in str(exc.value)
