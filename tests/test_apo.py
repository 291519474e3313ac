"""APO end to end on the mechanics: the real gateway on 127.0.0.1 (scripted backends for the agent's
model and for the optimiser), a real store, real Runners, the real openai client in the agent.

The scripted agent model answers a task right when the writer's system prompt earns it: a prompt
with ``LEVEL n`` is right on tasks whose index mod 4 is below n; "step by step" is right on all.
The scripted optimiser answers critiques with a fixed text and rewrites from a list, so the test
knows which candidate should win.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")

import agl  # noqa: E402
import agl.store  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.algorithms.apo import (  # noqa: E402
    APO,
    CRITIQUE_SYSTEM,
    REWRITE_SYSTEM,
    OptimizerError,
    parse_rewrite,
)
from agl.gateway.testing import ScriptedBackend, reply, serve_gateway  # noqa: E402
from agl.store.memory import MemoryStore  # noqa: E402
from agl.tracing import provider as tracing  # noqa: E402
from agl.tracing.prompts import prompt_version  # noqa: E402

BASE = "You answer questions."
CRITIQUE = "The prompt never tells the agent how to reason before it answers."


@pytest.fixture(autouse=True)
def _instrumented() -> Iterator[None]:
    agl.instrument("openai")
    yield
    agl.uninstrument()
    tracing.reset_tracing()


def _tasks(n: int, offset: int = 0) -> list[dict[str, Any]]:
    return [{"i": offset + i, "q": f"Question {offset + i}?", "a": f"answer-{offset + i}"} for i in range(n)]


def _level(system: str) -> int:
    if "step by step" in system:
        return 4
    m = re.search(r"LEVEL (\d)", system)
    return int(m.group(1)) if m else 0


def agent_model(request: Any) -> Any:
    """The agent's scripted model: right when the system prompt's level covers the task."""
    msgs = request.messages or []
    system = next((m["content"] for m in msgs if m["role"] == "system"), "")
    question = next((m["content"] for m in msgs if m["role"] == "user"), "")
    i = int(re.search(r"(\d+)", question).group(1))  # type: ignore[union-attr]
    return reply(f"answer-{i}" if i % 4 < _level(system) else "no idea")


@agl.rollout
def writer(task: dict[str, Any], resources: agl.Resources) -> float:
    """The agent: one line reads its prompt through agl.prompt."""
    llm = resources.llm
    assert llm is not None
    client = openai.OpenAI(base_url=llm.base_url, api_key="x", max_retries=0)
    system = agl.prompt("writer", default=BASE)
    out = client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": task["q"]}],
        max_tokens=16,
    )
    return 1.0 if (out.choices[0].message.content or "").strip() == task["a"] else 0.0


@agl.rollout
def two_prompts(task: dict[str, Any], resources: agl.Resources) -> float:
    """A second agent's prompt beside the writer's (read, not used: only the writer's moves the reward)."""
    agl.prompt("checker", default="You check answers.")
    return writer.fn(task, resources)


class Optimiser:
    """The scripted optimiser: a fixed critique; rewrites from ``rewrites`` in call order.

    A rewrite entry is a prompt (sent as JSON), or a raw reply (``reply(...)``/str starting with '!'
    is sent as is). Every request is kept for inspection."""

    def __init__(self, rewrites: list[Any]) -> None:
        self.rewrites = list(rewrites)
        self.requests: list[list[dict[str, Any]]] = []
        self.lock = threading.Lock()

    def __call__(self, request: Any) -> Any:
        msgs = request.messages or []
        with self.lock:
            self.requests.append(msgs)
            system = msgs[0]["content"]
            if system == CRITIQUE_SYSTEM:
                return reply(CRITIQUE)
            assert system == REWRITE_SYSTEM
            if len(msgs) > 2:  # a repair request after a bad reply
                nxt = self.rewrites.pop(0)
                return reply(json.dumps({"prompt": nxt}))
            nxt = self.rewrites.pop(0) if self.rewrites else "!{}"
        if isinstance(nxt, str) and nxt.startswith("!"):
            return reply(nxt[1:])
        if not isinstance(nxt, str):
            return nxt
        return reply(json.dumps({"prompt": nxt}))


def _apo_trainer(tmp_path: Path, apo: APO, store: Any, *, agents: Any = None) -> agl.Trainer:
    return agl.Trainer(
        apo,
        agents=agents,
        serving=agl.Serving(
            backend=ScriptedBackend(agent_model, accept_any_model=True),
            store=store,
            runners=4,
            run_dir=tmp_path / "run",
            progress=False,
        ),
    )


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# ------------------------------------------------------------------------------------------ tests


def test_trainer_apo_keeps_the_better_rewrite_and_records_versions(tmp_path: Path) -> None:
    opt = Optimiser(["Answer carefully. LEVEL 2", "Think step by step, then answer."])
    apo = APO(
        rounds=1,
        beam_width=1,
        branch_factor=2,
        rollouts_per_candidate=4,
        optimizer_backend=ScriptedBackend(opt, accept_any_model=True),
        optimizer_store=MemoryStore(),
    )
    store = MemoryStore()
    summary = _apo_trainer(tmp_path, apo, store).fit(writer, _tasks(8), _tasks(4, offset=100))

    # the defaults were learnt from the agent's agl.prompt() spans; the best rewrite won
    assert summary["val_reward_before"] == 0.0
    assert summary["val_reward_after"] == 1.0
    assert summary["best_prompts"] == {"writer": "Think step by step, then answer."}
    cands = {c["id"]: c for c in _lines(tmp_path / "run" / "candidates.jsonl")}
    assert cands["c0"]["prompts"] == {"writer": BASE}
    assert [cands[c]["val_reward"] for c in ("c0", "c1", "c2")] == [0.0, 0.5, 1.0]
    assert cands["c2"]["parent"] == "c0" and cands["c2"]["critique"] == CRITIQUE

    # the critique saw the failing traces: the task and the agent's wrong answer
    critique_prompt = next(m[1]["content"] for m in opt.requests if m[0]["content"] == CRITIQUE_SYSTEM)
    assert BASE in critique_prompt and "no idea" in critique_prompt and "Question" in critique_prompt

    # every rollout of a candidate ran with that candidate's resources version and prompt version
    by_version: dict[int, str] = {}
    for cid in ("c0", "c1", "c2"):
        c = cands[cid]
        res = store.get_resources(c["resources_version"])
        assert res is not None and res.prompts["writer"].template == c["prompts"]["writer"]
        assert c["versions"]["writer"] == prompt_version(c["prompts"]["writer"])
        by_version[c["resources_version"]] = c["versions"]["writer"]
    checked = 0
    for r in store.query_rollouts():
        apo_meta = r.metadata["apo"]
        if "candidate" not in apo_meta:
            continue  # the baseline run that learnt the defaults
        c = cands[apo_meta["candidate"]]
        assert r.resources_version == c["resources_version"]
        assert apo_meta["prompt_versions"] == c["versions"]
        (span,) = store.query_spans(rollout_id=r.id, name=sc.SPAN_PROMPT)
        assert span.attributes[sc.AGL_PROMPT_VERSION] == by_version[r.resources_version]
        assert span.attributes[sc.AGL_RESOURCES_VERSION] == r.resources_version
        assert span.attributes[sc.AGL_PROMPT_SOURCE] == "resources"
        checked += 1
    assert checked == 4 + 2 * 4  # c0 on the training batch, both children on the validation set
    # metrics, best prompt per round, the plot
    metrics = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [m["round"] for m in metrics] == [0, 1]
    assert metrics[1]["val_reward"] == 1.0 and metrics[1]["optimizer_calls"] == 4
    best1 = json.loads((tmp_path / "run" / "prompts" / "round-1.json").read_text())
    assert best1["prompts"]["writer"] == "Think step by step, then answer."
    assert (tmp_path / "run" / "reward_curve.png").stat().st_size > 0


def test_optimiser_calls_are_recorded_through_its_gateway(tmp_path: Path) -> None:
    opt_store = MemoryStore()
    opt = Optimiser(["LEVEL 1"])
    apo = APO(
        rounds=1,
        beam_width=1,
        branch_factor=1,
        rollouts_per_candidate=2,
        optimizer_backend=ScriptedBackend(opt, accept_any_model=True),
        optimizer_store=opt_store,
        prompts={"writer": BASE},
    )
    summary = _apo_trainer(tmp_path, apo, MemoryStore()).fit(writer, _tasks(4), _tasks(4, offset=100))
    rollouts = opt_store.query_rollouts()
    assert [r.metadata["apo"]["optimizer"] for r in rollouts] == ["critique", "rewrite"]
    assert all(r.status == "succeeded" for r in rollouts)
    for r in rollouts:
        (chat,) = opt_store.query_spans(rollout_id=r.id, name=sc.SPAN_CHAT)
        assert chat.attributes[sc.AGL_SIDE] == sc.SIDE_SERVER
    tokens = sum(
        s.attributes[sc.GEN_AI_USAGE_INPUT_TOKENS] + s.attributes[sc.GEN_AI_USAGE_OUTPUT_TOKENS]
        for r in rollouts
        for s in opt_store.query_spans(rollout_id=r.id, name=sc.SPAN_CHAT)
    )
    assert summary["optimizer_tokens"] == tokens > 0
    assert summary["val_reward_after"] == 0.25


def test_beam_keeps_the_top_k(tmp_path: Path) -> None:
    opt = Optimiser(["LEVEL 1", "LEVEL 3", "LEVEL 2"] + [f"LEVEL {1 + i % 3} v{i}" for i in range(6)])
    apo = APO(
        rounds=2,
        beam_width=2,
        branch_factor=3,
        rollouts_per_candidate=4,
        optimizer_backend=ScriptedBackend(opt, accept_any_model=True),
        optimizer_store=MemoryStore(),
        prompts={"writer": BASE},
    )
    _apo_trainer(tmp_path, apo, MemoryStore()).fit(writer, _tasks(8), _tasks(8, offset=100))
    metrics = _lines(tmp_path / "run" / "metrics.jsonl")
    cands = {c["id"]: c for c in _lines(tmp_path / "run" / "candidates.jsonl")}
    # round 1: c0 (0) + LEVEL 1/3/2 → the beam is LEVEL 3 and LEVEL 2
    assert metrics[1]["beam"] == ["c2", "c3"]
    assert metrics[1]["beam_val_rewards"] == [0.75, 0.5]
    # the beam is always the best two of all candidates seen so far
    for m in metrics[1:]:
        seen = [c for c in cands.values() if c["round"] <= m["round"]]
        top = sorted((c["val_reward"] for c in seen), reverse=True)[:2]
        assert m["beam_val_rewards"] == top
    # round 2 expands the beam members that failed a training task (LEVEL 2 fails half of them)
    parents = {cands[c]["parent"] for c in metrics[2]["new_candidates"]}
    assert "c3" in parents and parents <= {"c2", "c3"}


def test_budgets_are_respected(tmp_path: Path) -> None:
    opt = Optimiser([f"LEVEL {1 + i % 3} v{i}" for i in range(40)])
    opt_store = MemoryStore()
    store = MemoryStore()
    budget = 1500
    apo = APO(
        rounds=5,
        beam_width=2,
        branch_factor=2,
        rollouts_per_candidate=3,
        max_optimizer_tokens=budget,
        optimizer_backend=ScriptedBackend(opt, accept_any_model=True),
        optimizer_store=opt_store,
        optimizer_sampling={"max_tokens": 64},
        prompts={"writer": BASE},
    )
    summary = _apo_trainer(tmp_path, apo, store).fit(writer, _tasks(12), _tasks(4, offset=100))
    assert summary["budget_exhausted"] is True
    assert 0 < summary["optimizer_tokens"] <= budget
    assert summary["rounds"] < 5
    assert summary["optimizer_calls"] == len(opt_store.query_rollouts())
    # every beam candidate ran exactly rollouts_per_candidate training tasks per round
    per: dict[tuple[str, str], int] = {}
    for r in store.query_rollouts(mode="train"):
        key = (r.metadata["apo"]["label"], r.metadata["apo"]["candidate"])
        per[key] = per.get(key, 0) + 1
    assert per and set(per.values()) == {3}
    metrics = _lines(tmp_path / "run" / "metrics.jsonl")
    assert all(len(m["beam"]) <= 2 for m in metrics)
    assert all(len(m["new_candidates"]) <= 2 * 2 for m in metrics[1:])


def test_optimiser_failures_cost_a_child_not_the_round(tmp_path: Path) -> None:
    opt = Optimiser(
        [
            "!Sure, here is a better prompt: be smart.",  # not JSON → one repair request …
            "LEVEL 2",  # … which answers properly
            "!" + json.dumps({"prompt": "   "}),  # an empty rewrite
            reply(error="upstream is down"),  # an HTTP error (the gateway answers 502)
            "Answer {question} at LEVEL 3",  # adds a placeholder the prompt does not have
        ]
    )
    apo = APO(
        rounds=1,
        beam_width=2,
        branch_factor=4,
        rollouts_per_candidate=4,
        optimizer_backend=ScriptedBackend(opt, accept_any_model=True),
        optimizer_store=MemoryStore(),
        prompts={"writer": BASE},
    )
    summary = _apo_trainer(tmp_path, apo, MemoryStore()).fit(writer, _tasks(8), _tasks(4, offset=100))
    assert summary["optimizer_failures"] == {
        "bad_json_retried": 1,
        "empty_rewrite": 1,
        "http_error": 1,
        "placeholders": 1,
    }
    assert summary["best_prompts"] == {"writer": "LEVEL 2"}
    assert summary["val_reward_after"] == 0.5
    metrics = _lines(tmp_path / "run" / "metrics.jsonl")
    assert metrics[1]["optimizer_failures"] == 4 and metrics[1]["new_candidates"] == ["c1"]
    reasons = [f["reason"] for f in _lines(tmp_path / "run" / "optimizer_failures.jsonl")]
    assert sorted(reasons) == ["bad_json", "empty_rewrite", "http_error", "placeholders"]


def test_selected_agents_only(tmp_path: Path) -> None:
    """Two prompts; agents=["writer"] rewrites only the writer's."""

    opt = Optimiser(["LEVEL 2", "LEVEL 3"])
    apo = APO(
        rounds=1,
        beam_width=1,
        branch_factor=2,
        rollouts_per_candidate=2,
        optimizer_backend=ScriptedBackend(opt, accept_any_model=True),
        optimizer_store=MemoryStore(),
    )
    summary = _apo_trainer(tmp_path, apo, MemoryStore(), agents=["writer"]).fit(
        two_prompts, _tasks(4), _tasks(4, offset=100)
    )
    assert summary["best_prompts"] == {"writer": "LEVEL 3", "checker": "You check answers."}
    for c in _lines(tmp_path / "run" / "candidates.jsonl")[1:]:
        assert c["edited"] == "writer" and c["prompts"]["checker"] == "You check answers."
    with pytest.raises(ValueError, match="nobody"):
        _apo_trainer(
            tmp_path, APO(rounds=0, optimizer_store=MemoryStore()), MemoryStore(), agents=["nobody"]
        ).fit(two_prompts, _tasks(2), _tasks(2))


def test_cli_runs_apo_against_openai_compatible_endpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from agl.cli import main

    train, val, test = tmp_path / "train.jsonl", tmp_path / "val.jsonl", tmp_path / "test.jsonl"
    for path, tasks in ((train, _tasks(4)), (val, _tasks(4, 100)), (test, _tasks(4, 200))):
        path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    opt = Optimiser(["Think step by step."])
    with (
        serve_gateway(ScriptedBackend(agent_model, accept_any_model=True)) as agent_url,
        serve_gateway(ScriptedBackend(opt, accept_any_model=True)) as opt_url,
    ):
        monkeypatch.syspath_prepend(str(Path(__file__).parent))
        rc = main(
            [
                "apo", "--agent", "test_apo:writer", "--train", str(train), "--val", str(val),
                "--test", str(test), "--base-url", agent_url, "--model", "scripted",
                "--optimizer-base-url", opt_url, "--optimizer-model", "opt", "--rounds", "1",
                "--beam-width", "1", "--branch-factor", "1", "--rollouts-per-candidate", "2",
                "--run-dir", str(tmp_path / "run"), "--no-progress", "--no-instrument",
            ]
        )  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["test_reward_before"] == 0.0 and out["test_reward_after"] == 1.0
    assert out["best_prompts"] == {"writer": "Think step by step."}
    assert (tmp_path / "run" / "optimizer.db").exists() and (tmp_path / "run" / "store.db").exists()
    # bad input: a clear error, exit 2
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert (
        main(["apo", "--agent", "test_apo:writer", "--train", str(tmp_path / "bad.jsonl"), "--val", str(val)])
        == 2
    )
    assert "bad.jsonl:1 is not JSON" in capsys.readouterr().err
    args = ["apo", "--agent", "test_apo:writer", "--train", str(train), "--val", str(val)]
    assert main([*args, "--prompt", "writer=" + str(tmp_path / "missing.txt")]) == 2
    assert "--prompt writer: no such file" in capsys.readouterr().err
    assert main([*args, "--beam-width", "0"]) == 2
    assert "beam_width must be an integer >= 1" in capsys.readouterr().err


def _agl(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``agl ARGS`` in a fresh interpreter, the way a user runs it (tests/ on the path for the agent)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", "import sys; from agl.cli import main; raise SystemExit(main())", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_agl_apo_command_end_to_end_then_agl_plot(tmp_path: Path) -> None:
    """The whole loop through the ``agl apo`` command in its own process: the agent's model and a
    "hosted" optimiser are scripted gateways here, reached over HTTP like any OpenAI-compatible
    endpoint; then ``agl plot`` draws the run."""
    train, val, test = tmp_path / "train.jsonl", tmp_path / "val.jsonl", tmp_path / "test.jsonl"
    for path, tasks in ((train, _tasks(8)), (val, _tasks(4, 100)), (test, _tasks(4, 200))):
        path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    (tmp_path / "writer.txt").write_text(BASE + "\n")
    run = tmp_path / "run"
    opt = Optimiser(["Answer carefully. LEVEL 2", "Think step by step, then answer."])
    with (
        serve_gateway(ScriptedBackend(agent_model, accept_any_model=True)) as agent_url,
        serve_gateway(ScriptedBackend(opt, accept_any_model=True)) as opt_url,
    ):
        proc = _agl(
            "apo", "--agent", "test_apo:two_prompts", "--train", str(train), "--val", str(val),
            "--test", str(test), "--prompt", f"writer={tmp_path / 'writer.txt'}",
            "--prompt", f"checker={tmp_path / 'writer.txt'}", "--agents", "writer",
            "--base-url", agent_url, "--model", "scripted",
            "--optimizer-base-url", opt_url, "--optimizer-model", "hosted-optimiser",
            "--rounds", "1", "--beam-width", "1", "--branch-factor", "2", "--rollouts-per-candidate", "4",
            "--run-dir", str(run),
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["best_prompts"] == {"writer": "Think step by step, then answer.", "checker": BASE}
    assert (out["val_reward_before"], out["val_reward_after"]) == (0.0, 1.0)
    assert (out["test_reward_before"], out["test_reward_after"]) == (0.0, 1.0)
    assert "agl apo" in proc.stderr and "round" in proc.stderr  # the progress bar

    # the optimiser was reached through APO's own gateway: each call a recorded rollout with its chat span
    assert [m[0]["content"] for m in opt.requests] == [CRITIQUE_SYSTEM, REWRITE_SYSTEM] * 2
    opt_store = agl.store.open(f"sqlite:///{run / 'optimizer.db'}")
    calls = sorted(opt_store.query_rollouts(), key=lambda r: r.created_at)
    assert [r.metadata["apo"]["optimizer"] for r in calls] == ["critique", "rewrite"] * 2
    assert all(r.metadata["apo"]["prompt"] == "writer" for r in calls)
    for r in calls:
        (chat,) = opt_store.query_spans(rollout_id=r.id, name=sc.SPAN_CHAT)
        assert json.loads(chat.attributes[sc.GEN_AI_INPUT_MESSAGES])[0]["content"] in (
            CRITIQUE_SYSTEM,
            REWRITE_SYSTEM,
        )
        assert chat.attributes[sc.GEN_AI_REQUEST_MODEL] == "hosted-optimiser"
    assert out["optimizer_calls"] == 4

    # the agent's rollouts name the prompt versions they ran with, in metadata and in their prompt spans
    store = agl.store.open(f"sqlite:///{run / 'store.db'}")
    cands = {c["id"]: c for c in _lines(run / "candidates.jsonl")}
    best = cands[out["best_candidate"]]
    assert best["versions"] == out["best_versions"] and best["edited"] == "writer"
    final = store.query_rollouts(mode="test")
    assert len(final) == 8
    for r in final:
        versions = r.metadata["apo"]["prompt_versions"]
        assert versions in (cands["c0"]["versions"], best["versions"])
        spans = {
            s.attributes[sc.AGL_PROMPT_NAME]: s
            for s in store.query_spans(rollout_id=r.id, name=sc.SPAN_PROMPT)
        }
        assert {n: s.attributes[sc.AGL_PROMPT_VERSION] for n, s in spans.items()} == versions

    # the run directory: metrics per round, best prompt per round, the summary; agl plot draws it
    assert [m["round"] for m in _lines(run / "metrics.jsonl")] == [0, 1]
    for rnd, prompt in ((0, BASE), (1, "Think step by step, then answer.")):
        assert json.loads((run / "prompts" / f"round-{rnd}.json").read_text())["prompts"]["writer"] == prompt
    assert json.loads((run / "best_prompts.json").read_text())["best_candidate"] == out["best_candidate"]
    plot = _agl("plot", str(run), "--out", str(tmp_path / "apo.png"), timeout=120)
    assert plot.returncode == 0, plot.stderr
    assert plot.stdout.strip() == str(tmp_path / "apo.png") and (tmp_path / "apo.png").stat().st_size > 10_000


def test_default_optimiser_is_the_agents_model_and_every_prompt_takes_turns(tmp_path: Path) -> None:
    """No optimiser given: the agent's own model critiques and rewrites (the SmolLM2 example's
    set-up), through a gateway that records the calls in run_dir/optimizer.db; with no agents=
    selection every prompt the agent reads is rewritten in turn."""
    opt = Optimiser(["You check answers twice.", "LEVEL 2"])

    def one_model(request: Any) -> Any:
        system = (request.messages or [{}])[0].get("content")
        return opt(request) if system in (CRITIQUE_SYSTEM, REWRITE_SYSTEM) else agent_model(request)

    apo = APO(rounds=1, beam_width=1, branch_factor=2, rollouts_per_candidate=4)
    trainer = agl.Trainer(
        apo,
        serving=agl.Serving(
            backend=ScriptedBackend(one_model, accept_any_model=True),
            store=MemoryStore(),
            runners=4,
            run_dir=tmp_path / "run",
            progress=False,
        ),
    )
    summary = trainer.fit(two_prompts, _tasks(8), _tasks(4, offset=100))
    cands = _lines(tmp_path / "run" / "candidates.jsonl")
    assert [(c["id"], c["edited"]) for c in cands] == [("c0", None), ("c1", "checker"), ("c2", "writer")]
    assert [c["val_reward"] for c in cands] == [0.0, 0.0, 0.5]
    assert summary["best_prompts"] == {"writer": "LEVEL 2", "checker": "You check answers."}
    assert len(opt.requests) == 4 and summary["optimizer_calls"] == 4
    opt_store = agl.store.open(f"sqlite:///{tmp_path / 'run' / 'optimizer.db'}")
    calls = opt_store.query_rollouts()
    assert sorted(r.metadata["apo"]["optimizer"] for r in calls) == [
        "critique",
        "critique",
        "rewrite",
        "rewrite",
    ]
    assert all(opt_store.query_spans(rollout_id=r.id, name=sc.SPAN_CHAT) for r in calls)


def test_prompt_resolution_outside_and_inside_resources() -> None:
    assert agl.prompt("writer", default="hi {name}", name="Ada") == "hi Ada"
    res = agl.Resources(version=3, items={"writer": agl.PromptTemplate(template="Hello {name}")})
    assert res.prompts["writer"].template == "Hello {name}"
    assert agl.prompt("writer", default="x", resources=res, name="Bo") == "Hello Bo"
    with pytest.raises(KeyError, match="no prompt 'other'"):
        agl.prompt("other", resources=res)
    with pytest.raises(ValueError):
        agl.prompt("")


def test_parse_rewrite() -> None:
    assert parse_rewrite('{"prompt": "A"}') == "A"
    assert parse_rewrite('Here you go:\n```json\n{"prompt": "B {x}"}\n```') == "B {x}"
    assert parse_rewrite("<prompt>C</prompt>") == "C"
    assert parse_rewrite("```\nD\n```", "text") == "D"
    assert parse_rewrite('"E"', "text") == "E"
    for bad, reason in (
        ("", "empty_reply"),
        ("no json here", "bad_json"),
        ('{"prompt": ""}', "empty_rewrite"),
    ):
        with pytest.raises(OptimizerError) as info:
            parse_rewrite(bad)
        assert info.value.reason == reason


def test_apo_validates_its_settings() -> None:
    with pytest.raises(ValueError, match="beam_width"):
        APO(beam_width=0)
    with pytest.raises(ValueError, match="max_optimizer_tokens"):
        APO(max_optimizer_tokens=0)
    with pytest.raises(ValueError, match="not a valid f-string"):
        APO(prompts={"w": "broken {"})
    with pytest.raises(ValueError, match="validation tasks"):
        APO().optimize(writer, _tasks(2), None)
    with pytest.raises(TypeError, match="unknown APO run settings"):
        APO().optimize(writer, _tasks(2), _tasks(2), run_dri="typo")
    with pytest.raises(ValueError, match="optimizer_base_url or optimizer_backend"):
        APO(optimizer_base_url="http://x/v1", optimizer_backend=ScriptedBackend(["x"]))
    assert APO(agents="writer").agents == ["writer"]
