"""examples/crew_agent: the fact base and its tasks (gold facts read off the directory), the lookup
tool, the coverage reward, ``dev`` with the scripted model (good, sloppy, partial and vague writers;
the failing lookup penalised by AIR on the researcher's call that issued it; only the writer's calls
selected), a fixed researcher endpoint, and ``train`` for a few steps with a tiny random model."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from examples.crew_agent import data
from examples.crew_agent.reward import coverage, normalize, stated

# ------------------------------------------------------------------------------------------ data


def test_fact_base_and_tasks_are_deterministic_and_correct() -> None:
    directory = data.build_directory()
    assert directory == data.build_directory.__wrapped__(data.SEED, data.DEFAULT_SIZE)
    assert len(directory) == data.DEFAULT_SIZE
    assert len({e["ticker"] for e in directory.values()}) == len(directory)
    train, test = data.load_tasks("train"), data.load_tasks("test")
    assert len(train) + len(test) == data.DEFAULT_SIZE and 0.1 < len(test) / data.DEFAULT_SIZE < 0.3
    assert not {t["company"] for t in train} & {t["company"] for t in test}  # held out by company
    assert data.load_tasks("test") == test and data.load_tasks("test", limit=3) == test[:3]
    for task in train + test:
        entry = directory[data.lookup_key(task["company"])]
        assert 2 <= len(task["facts"]) <= 3 and set(task["facts"]) <= set(data.FACTS)
        assert task["gold"] == {f: entry[f] for f in task["facts"]}
        # the tool's answer states every gold fact; no fact is stated by another fact's value
        assert coverage(data.fact_lines(entry), task["gold"]) == 1.0
        for fact, value in entry.items():
            others = " ".join(v for f, v in entry.items() if f not in (fact, "name"))
            assert fact == "name" or not stated(value, others), (fact, entry)
    with pytest.raises(ValueError, match="split"):
        data.load_tasks("dev")


def test_coverage_by_hand() -> None:
    gold = {"founded": "1987", "ceo": "Alma Novak", "employees": "2340"}
    assert coverage("Founded in 1987 by Alma Novak's team; it employs 2,340 people.", gold) == 1.0
    assert coverage("Alma Novak leads it.", gold) == pytest.approx(1 / 3)
    assert coverage("It was founded in 19870 by Alma Novakova and has 198 staff.", gold) == 0.0
    assert coverage("ALMA NOVAK, since 1987.", gold) == pytest.approx(2 / 3)
    assert coverage("", gold) == 0.0 and coverage(None, gold) == 0.0
    assert normalize("Drone-motors, 2,340 units!") == "drone motors 2340 units"
    with pytest.raises(ValueError, match="at least one fact"):
        coverage("anything", {})


# ---------------------------------------------------------------------------------- CrewAI parts


@pytest.fixture
def crew_offline() -> Iterator[None]:
    pytest.importorskip("crewai")
    import os

    import agl
    from agl.tracing.provider import reset_tracing

    # CrewAI's telemetry and trace upload are off (tests/conftest.py sets these; the example too)
    assert os.environ["CREWAI_DISABLE_TELEMETRY"] == "true"
    assert os.environ["CREWAI_TRACING_ENABLED"] == "false"
    yield
    agl.uninstrument("crewai", "openai")
    reset_tracing()


def test_the_lookup_tool_fails_on_unknown_keys(crew_offline: None) -> None:
    from examples.crew_agent.agent import make_lookup

    directory = data.build_directory()
    lookup = make_lookup(directory)
    task = data.load_tasks("test", limit=1)[0]
    text = lookup.run(key=f"  {task['company'].upper()} ")
    assert coverage(text, task["gold"]) == 1.0
    with pytest.raises(KeyError, match="unknown key"):
        lookup.run(key=task["company"] + "x")


def _expected(kind: str, task: dict[str, Any]) -> tuple[int, float]:
    """(researcher LLM calls, coverage) for a scripted rollout of ``kind``."""
    n = len(task["facts"])
    return {"good": (2, 1.0), "sloppy": (3, 1.0), "partial": (2, 1 / n), "vague": (2, 0.0)}[kind]


def test_dev_with_the_scripted_model(
    crew_offline: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import agl.store
    from agl import semconv as sc
    from agl.adapter import Adapter
    from examples.crew_agent import cli
    from examples.crew_agent.scripted import behaviour, misspelt

    url = f"sqlite:///{tmp_path / 'dev.db'}"  # `dev --store` records the rollouts where asked
    args = cli.parser().parse_args(["dev", "--backend", "scripted", "-n", "10", "--store", url])
    transitions = cli.dev(args)
    store = agl.store.open(url)
    out = capsys.readouterr().out
    assert "10 rollouts, 10 transitions" in out and "agent=writer" in out

    rollouts = {r.id: r for r in store.query_rollouts()}
    assert len(rollouts) == 10 and all(r.status == "succeeded" for r in rollouts.values())
    # only the writer's calls are selected: one per rollout
    assert sorted(t.rollout_id for t in transitions) == sorted(rollouts)
    every = Adapter().from_store(store, list(rollouts))  # no selection: the researcher's calls too
    by_rollout: dict[str, list[Any]] = defaultdict(list)
    for t in every:
        by_rollout[t.rollout_id].append(t)
    kinds: Counter[str] = Counter()
    for rid, rollout in rollouts.items():
        task = rollout.input
        kind = behaviour(task["company"])
        kinds[kind] += 1
        researcher_calls, reward = _expected(kind, task)
        ts = sorted(by_rollout[rid], key=lambda t: t.index)
        assert [t.agent for t in ts] == ["researcher"] * researcher_calls + ["writer"], (kind, task)
        assert all(t.final_reward == pytest.approx(reward) and t.exact for t in ts), (kind, task)
        # AIR: the researcher's call that asked for the misspelt key, and no other, is penalised
        air = [-0.1 if kind == "sloppy" and i == 0 else 0.0 for i in range(len(ts))]
        assert [t.intermediate_reward for t in ts] == pytest.approx(air), (kind, task)
        selected = [t for t in transitions if t.rollout_id == rid]
        assert len(selected) == 1 and selected[0].span_id == ts[-1].span_id
        assert selected[0].intermediate_reward == 0.0 and selected[0].final_reward == pytest.approx(reward)

        spans = store.query_spans(rollout_id=rid)
        agents = [s.attributes[sc.GEN_AI_AGENT_NAME] for s in spans if s.name == sc.SPAN_INVOKE_AGENT]
        assert sorted(agents) == ["researcher", "writer"]
        tools = sorted((s for s in spans if s.name == sc.SPAN_EXECUTE_TOOL), key=lambda s: s.start_ns)
        keys = ([misspelt(task["company"])] if kind == "sloppy" else []) + [task["company"]]
        assert [s.attributes[sc.GEN_AI_TOOL_NAME] for s in tools] == ["lookup"] * len(keys)
        assert [s.status.code == "ERROR" for s in tools] == [k != task["company"] for k in keys]
    assert all(kinds[k] for k in ("good", "sloppy", "partial", "vague")), kinds


def test_a_fixed_researcher_endpoint(crew_offline: None) -> None:
    """``--scripted-researcher``: the researcher's calls go to another endpoint (not recorded by the
    trainer's gateway, so not trainable); the writer's calls are the trainer's, as before."""
    import agl.store
    from examples.crew_agent import cli
    from examples.crew_agent.scripted import ScriptedCrew, agent_of

    class WriterOnly(ScriptedCrew):
        """The trainer's engine: a good writer that records who asks."""

        def __call__(self, request: Any) -> Any:
            self.asked_by.append(agent_of(request.messages))
            return super().__call__(request)

        asked_by: list[str | None] = []

        def kind(self, task: Any, request: Any) -> str:
            return "good"

    store = agl.store.open("memory://")
    args = cli.parser().parse_args(["dev", "--backend", "scripted", "-n", "3", "--scripted-researcher"])
    engine = WriterOnly()
    transitions = cli.dev(args, script=engine, store=store)
    assert engine.asked_by == ["writer"] * 3  # the researcher never called the trainer's endpoint
    assert [t.agent for t in transitions] == ["writer"] * 3
    assert all(t.final_reward == 1.0 for t in transitions)
    with pytest.raises(ValueError, match="only"):
        ScriptedCrew(only="brilliant")


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


def test_train_a_few_steps_with_a_tiny_model(
    crew_offline: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny model is the policy; the scripted model answers (each company's rollouts alternate
    between a good and a vague writer, so no group is uniform); only the writer's calls train."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    from agl.algorithms.update import PolicyUpdate
    from agl.trainer.trainer import load_tokenizer
    from examples.crew_agent import cli
    from examples.crew_agent.scripted import ScriptedCrew

    class Alternating(ScriptedCrew):
        def __init__(self) -> None:
            super().__init__()
            self.seen: dict[str, list[str]] = defaultdict(list)

        def kind(self, task: dict[str, Any], request: Any) -> str:
            rollouts = self.seen[task["company"]]
            if request.rollout[0] not in rollouts:
                rollouts.append(request.rollout[0])
            return ("good", "vague")[rollouts.index(request.rollout[0]) % 2]

    trained: list[Any] = []
    real_step = PolicyUpdate.step

    def step(self: Any, transitions: Any, advantages: Any) -> Any:
        trained.append(list(transitions))
        return real_step(self, transitions, advantages)

    monkeypatch.setattr(PolicyUpdate, "step", step)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run_dir = tmp_path / "run"
    args = cli.parser().parse_args(
        ["train", "--run-dir", str(run_dir), "--steps", "2", "--tasks-per-step", "2", "--group-size", "4",
         "--val-tasks", "2", "--val-every", "1", "--runners", "4", "--learning-rate", "1e-3", "--lora-r", "4"]
    )  # fmt: skip
    args.backend = "scripted"  # the engine is the script; the tiny model is the policy being updated
    try:
        summary = cli.train(
            args, model=_tiny_model(), tokenizer=load_tokenizer(), script=Alternating(), progress=False
        )
    finally:
        torch.set_num_threads(threads)

    steps = [h for h in summary["history"] if "train_reward" in h]
    assert [h["step"] for h in steps] == [0, 1]
    assert summary["val_reward_before"] is not None and summary["val_reward_after"] is not None
    assert len(trained) == 2
    for h, batch in zip(steps, trained, strict=True):
        # one writer call per rollout; the researcher's two calls per rollout are never trained
        assert h["transitions"] == h["trained_transitions"] == len(batch) == 2 * 4
        assert {t.agent for t in batch} == {"writer"}
        assert sorted(t.final_reward for t in batch) == [0.0] * 4 + [1.0] * 4
        assert math.isfinite(h["loss"]) and h["zero_variance_groups"] == 0
