"""solve_check: two agents that need opposite behaviour, trained on a shared policy or an adapter each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

# the example's agent (and learn_on_cpu's, whose calculator it reuses) instruments the openai client
# on import, as a user's agent module does: without openai (the core env) there is nothing to test
pytest.importorskip("openai")

from examples.solve_check.agent import agent_scores, checker_reward  # noqa: E402
from examples.solve_check.data import propose, split  # noqa: E402


def test_proposals_are_fixed_half_right_and_near_misses_otherwise() -> None:
    train, val = split()
    assert split() == (train, val)  # fixed by the expressions, not by a global seed
    assert not {t["expression"] for t in train} & {t["expression"] for t in val}
    every = train + val
    right = [t for t in every if t["proposal"] == t["answer"]]
    assert 0.4 < len(right) / len(every) < 0.6
    assert {t["proposal"] - t["answer"] for t in every} <= {-10, -2, -1, 0, 1, 2, 10}
    assert propose(val[0]) == val[0]


@pytest.mark.parametrize(
    ("reply", "proposal", "answer", "score"),
    [
        ("Verdict: correct", 7, 7, 1.0),
        ("Verdict: wrong", 8, 7, 1.0),
        ("Verdict: wrong", 7, 7, 0.0),
        ("Verdict: correct", 8, 7, 0.0),
        ("Verdict: incorrect", 8, 7, 0.0),  # strict format: a program reads it
        ("Answer: 7", 7, 7, 0.0),  # the solver's format is the checker's failure
        (None, 7, 7, 0.0),
    ],
)
def test_checker_reward_by_hand(reply: str | None, proposal: int, answer: int, score: float) -> None:
    assert checker_reward(reply, proposal, answer) == score


def test_agent_scores_by_hand() -> None:
    task = {"answer": 12, "proposal": 13}
    assert agent_scores(task, {"solver": "Answer: 12", "checker": "Verdict: wrong"}) == {
        "solver": 1.0,
        "checker": 1.0,
    }
    assert agent_scores(task, {"solver": "Verdict: wrong", "checker": "Answer: 12"}) == {
        "solver": 0.0,
        "checker": 0.0,
    }
    assert agent_scores(task, {"checker": "Verdict: correct"}) == {"checker": 0.0}


def _tiny_model() -> Any:
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("per_agent", [False, True], ids=["shared", "per-agent"])
def test_a_step_with_a_tiny_model(tmp_path: Path, per_agent: bool) -> None:
    """Both setups run through the example's own command line: each agent's calls are served by its
    own adapter only per agent, and the held-out table has each agent's score before and after."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    pytest.importorskip("openai")
    import torch

    import agl
    import agl.store
    from agl import semconv as sc
    from agl.adapter import Adapter
    from agl.trainer.trainer import load_tokenizer
    from examples.solve_check.__main__ import _train_one, parser

    args = parser().parse_args(
        ["train", "--steps", "1", "--tasks-per-step", "1", "--group-size", "2", "--val-size", "2",
         "--val-every", "1", "--max-tokens", "4", "--runners", "4", "--lora-r", "4"]
    )  # fmt: skip
    args.model = _tiny_model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run = tmp_path / "run"
    agl.instrument("openai")  # as the agent module does on import (undone below, for the next case)
    try:
        out = _train_one(args, 0, run, per_agent, tokenizer=load_tokenizer(), progress=False)
    finally:
        torch.set_num_threads(threads)
        agl.uninstrument()
    assert out["setup"] == ("per_agent" if per_agent else "shared")
    assert set(out["held_out_before"]) == set(out["held_out_after"]) == {"solver", "checker"}
    assert len(out["held_out_by_agent"]) == 2  # before the first step and after the last
    store = agl.store.open(f"sqlite:///{run / 'store.db'}")
    try:
        ids = [r.id for r in store.query_rollouts(mode="train")]
        every = Adapter().from_store(store, ids)
        spans = [s for rid in ids for s in store.query_spans(rollout_id=rid)]
    finally:
        store.close()
    assert sorted(t.agent for t in every) == ["checker"] * 2 + ["solver"] * 2
    # the rollout's reward is its one reward: no agent's call carries another as an intermediate one
    # (a per-agent breakdown emitted beside it would be trained on twice, by the checker's call)
    rewards = [s for s in spans if s.name == sc.SPAN_REWARD]
    assert len(rewards) == len(ids) and all(s.attributes[sc.AGL_REWARD_PRIMARY] for s in rewards)
    assert all(t.intermediate_reward == 0.0 and t.reward == t.final_reward for t in every)
    # the gateway's span of each call names the adapter that served it
    served = {
        s.attributes[sc.AGL_LLM_AGENT]: s.attributes.get(sc.AGL_LLM_ADAPTER)
        for s in spans
        if sc.AGL_LLM_AGENT in s.attributes
    }
    if per_agent:
        assert served == {"solver": "solver", "checker": "checker"}
    else:
        assert served["solver"] == served["checker"]
    (step,) = [h for h in out["history"] if "train_reward" in h]
    assert ("trained_transitions/solver" in step) is per_agent


def test_dev_with_the_scripted_oracle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``dev --backend scripted``: the oracle's replies score 1 for both agents on every task, through
    the real gateway, store and adapter (so the prompts the oracle reads are the ones the agents send)."""
    import agl
    from examples.solve_check.__main__ import main

    agl.instrument("openai")
    try:
        assert main(["dev", "--backend", "scripted", "-n", "6", "--run-dir", str(tmp_path / "dev")]) == 0
    finally:
        agl.uninstrument()
    out = capsys.readouterr().out
    assert "6 rollouts, 12 transitions, mean reward 1.000" in out
    assert out.count("response: Verdict: wrong") >= 1 and out.count("response: Verdict: correct") >= 1


def test_oracle_demonstrations_on_training_tasks_for_a_warm_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dev --backend scripted --split train --store URL`` records the oracle on training tasks into
    the given store, every rollout at reward 1: the demonstrations ``agl sft`` warm-starts from."""
    import agl
    import agl.store
    from examples.solve_check.__main__ import main
    from examples.solve_check.data import split

    url = f"sqlite:///{tmp_path / 'demos.db'}"
    agl.instrument("openai")
    try:
        argv = ["dev", "--backend", "scripted", "-n", "5", "--split", "train", "--store", url]
        assert main([*argv, "--run-dir", str(tmp_path / "dev")]) == 0
    finally:
        agl.uninstrument()
    train, val = split()
    store = agl.store.open(url)
    try:
        inputs = [r.input for r in store.query_rollouts(status="succeeded")]
    finally:
        store.close()
    assert len(inputs) == 5 and all(x in train for x in inputs) and not any(x in val for x in inputs)
    assert "5 rollouts, 10 transitions, mean reward 1.000" in capsys.readouterr().out


def test_warm_starts_pick_the_merged_model_or_each_agents_adapter(tmp_path: Path) -> None:
    """Shared: the merged model of an ``agl sft`` output; per agent: its base model and the output's
    adapters; compare refuses one warm start without the other (the setups must start alike)."""
    import json

    from examples.solve_check.__main__ import _warm_start, main, parser

    shared, per_agent = tmp_path / "sft", tmp_path / "sft_per_agent"
    (shared / "model").mkdir(parents=True)
    (shared / "model" / "config.json").write_text("{}")
    per_agent.mkdir()
    (per_agent / "sft_summary.json").write_text(json.dumps({"base_model": "/models/base"}))
    args = parser().parse_args(
        ["compare", "--warm-start", str(shared), "--warm-start-per-agent", str(per_agent)]
    )
    model, adapters = _warm_start(args, per_agent=False)
    assert Path(model).resolve() == (shared / "model").resolve() and adapters is None
    assert _warm_start(args, per_agent=True) == ("/models/base", str(per_agent))
    args = parser().parse_args(["train", "--adapter-per-agent", "--warm-start", str(per_agent)])
    assert _warm_start(args, per_agent=True) == ("/models/base", str(per_agent))
    assert _warm_start(parser().parse_args(["train"]), per_agent=False) == (None, None)
    with pytest.raises(SystemExit, match="both --warm-start"):
        main(["compare", "--warm-start", str(shared), "--run-dir", str(tmp_path / "c")])
