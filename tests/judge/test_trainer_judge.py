"""Trainer(judge=..., reward="judge"): an agent with no reward function trains on the judge's scores.

Real pieces throughout: a tiny random Llama as the policy, agl's scripted backend as the engine,
the openai client in the agent, in-process runners, and the judge — another scripted backend — behind
the judge's own gateway, recording its calls in the run's judge store.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import agl  # noqa: E402
from agl.config import LoopConfig  # noqa: E402
from agl.gateway.testing import ScriptedBackend  # noqa: E402
from agl.run.settings import Serving  # noqa: E402
from agl.tracing import provider as tracing  # noqa: E402
from agl.trainer.trainer import Trainer, load_tokenizer  # noqa: E402

GOOD, BAD = "Answer: 42", "I am not sure."


@pytest.fixture(autouse=True)
def _instrumented() -> Any:
    agl.instrument("openai")
    yield
    agl.uninstrument()
    tracing.reset_tracing()


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


class Engine:
    """The policy's replies alternate good/bad per prompt, so each group (two rollouts of one task)
    holds one of each whatever order the runners' calls arrive in."""

    def __init__(self) -> None:
        self.n: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, request: Any) -> str:
        key = json.dumps(request.messages, sort_keys=True, default=str)
        with self.lock:
            self.n[key] = self.n.get(key, 0) + 1
            return GOOD if self.n[key] % 2 else BAD


def no_reward_agent(task: dict, resources: agl.Resources) -> None:
    """An agent without a grader: it answers and returns nothing."""
    llm = resources.llm
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "x")
    client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=16
    )


def judge_script(request: Any) -> str:
    """The judge: 1 for a trajectory whose answer says 42, else 0."""
    prompt = request.messages[-1]["content"]
    blocks = re.findall(r"=== trajectory (t\d+) ===\n(.*?)(?=\n\n=== |\n\nCompare|\Z)", prompt, re.S)
    scores = [{"id": lbl, "score": float("Answer: 42" in text), "reason": "42?"} for lbl, text in blocks]
    return json.dumps({"scores": scores})


def judged_trainer(tmp_path: Path, steps: int) -> Trainer:
    """A Trainer on ``reward="judge"``: groups of two, two tasks a step, the scripted judge."""
    judge = agl.Judge(backend=ScriptedBackend(judge_script, accept_any_model=True), model="judge-m")
    return Trainer(
        agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8),
        model=tiny_model(),
        judge=judge,
        reward="judge",
        serving=Serving(
            backend="scripted",
            script=Engine(),
            runners=2,
            run_dir=tmp_path / "run",
            tokenizer=load_tokenizer(),
            progress=False,
        ),
        loop=LoopConfig(tasks_per_step=2, steps=steps, val_every=0, val_before=False),
    )


def test_an_agent_without_a_reward_trains_on_the_judge(tmp_path: Path, monkeypatch: Any) -> None:
    seen: list[tuple[str, float]] = []  # (response, advantage) of every transition the update got
    advantages_of = agl.LightningRL.compute_advantages

    def recording(self: Any, transitions: Any, **kw: Any) -> Any:
        adv, stats = advantages_of(self, transitions, **kw)
        seen.extend(zip([t.response_text or "" for t in transitions], adv, strict=True))
        return adv, stats

    monkeypatch.setattr(agl.LightningRL, "compute_advantages", recording)
    trainer = judged_trainer(tmp_path, steps=2)
    trainer.fit(no_reward_agent, [{"q": f"What is {i} * 6?"} for i in range(4)])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("rollouts")]
    assert len(train) == 2
    for r in train:
        assert r["judge_calls"] == 2 and r["judge_groups"] == 2 and r["judge_groups_skipped"] == 0
        assert r["judge_prompt_tokens"] > 0 and r["judge_s"] > 0
        assert r["train_task_reward"] == 0.0  # the agent gave none: the missing-reward fill
        assert r["train_reward"] == r["judge_reward"] == 0.5  # one good, one bad per group
        assert r["zero_variance_groups"] == 0 and r["trained_transitions"] == r["transitions"] == 4
        assert "monitor_warnings" in r and r["response_tokens"] > 0
        assert r["monitor_divergence"] is None  # no task reward reported: nothing to diverge from
    # the update trains on the judge's scores: the answer it passed is pushed up, the one it failed
    # down (returns credited from the task's missing-reward fill of 0 would push both down alike)
    assert len(seen) == 8
    assert all((adv > 0) == (GOOD in text) and adv != 0 for text, adv in seen), seen
    # the judge store holds one judge rollout per group, each with its call and scores
    judge_store = agl.store.open(f"sqlite:///{tmp_path / 'run' / 'judge.db'}")
    try:
        assert len(judge_store.query_rollouts(mode="test", status="succeeded")) == 4
    finally:
        judge_store.close()


def lenient_agent(task: dict, resources: agl.Resources) -> float:
    """An agent whose own grader passes every answer: the judge (1 for "42", else 0) disagrees on half."""
    no_reward_agent(task, resources)
    return 1.0


def test_divergence_compares_the_reported_task_reward_with_the_judge(tmp_path: Path) -> None:
    """Trained on the judge's score, the monitors still see the task reward the agent reported: the
    lenient grader's 1.0 against the judge's 0 on every bad answer is a gap of 0.5 a rollout on average,
    above the default threshold, and the warning names the rollouts the judge failed."""
    trainer = judged_trainer(tmp_path, steps=1)
    trainer.fit(lenient_agent, [{"q": f"What is {i} * 6?"} for i in range(2)])
    (r,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert r["train_task_reward"] == 1.0 and r["train_reward"] == r["judge_reward"] == 0.5
    assert r["monitor_divergence"] == 0.5
    (warning,) = [w for w in r["monitor_warnings"] if w["monitor"] == "divergence"]
    assert warning["step"] == 0 and len(warning["rollouts"]) == 4
    store = agl.store.open(f"sqlite:///{tmp_path / 'run' / 'store.db'}")
    try:  # worst gap first: the two answers the judge failed, then the two it passed
        texts = {
            t.rollout_id: t.response_text or ""
            for t in trainer.adapter.from_store(store, warning["rollouts"])
        }
    finally:
        store.close()
    assert [BAD in texts[r] for r in warning["rollouts"]] == [True, True, False, False]


def test_reward_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="needs judge"):
        Trainer(reward="judge", serving=Serving(backend="scripted", script=["x"]))
    with pytest.raises(ValueError, match="reward must be"):
        Trainer(reward={"task": 1, "vibes": 1}, serving=Serving(backend="scripted", script=["x"]))
    with pytest.raises(ValueError, match="reward must be"):
        Trainer(reward={"task": -1}, serving=Serving(backend="scripted", script=["x"]))


def test_the_gate_rolls_back_to_the_last_checkpoint_when_its_monitor_fires(tmp_path: Path) -> None:
    """The engine gives every task the same answer, so ``identical_answers`` fires every step: the
    gate logs at step 0 (no checkpoint yet), then reloads checkpoint-1 after each later update."""
    trainer = Trainer(
        agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8),
        model=tiny_model(),
        gate=agl.Gate(monitors=("identical_answers",), val_drop=None),
        serving=Serving(
            backend="scripted",
            script=lambda request: GOOD,
            runners=2,
            run_dir=tmp_path / "run",
            tokenizer=load_tokenizer(),
            progress=False,
        ),
        loop=LoopConfig(tasks_per_step=2, steps=3, val_every=0, val_before=False, checkpoint_every=1),
        # the agent reports no reward: scored 0.0 only because the test says so (unset, such rollouts
        # are no verdict and left out of their groups)
        adapter=agl.Adapter(missing_reward=0.0),
    )
    trainer.fit(no_reward_agent, [{"q": f"What is {i} * 6?"} for i in range(6)])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    gates = [r.get("gate_rollback") for r in records]
    assert gates[0]["checkpoint"] is None and "identical_answers fired at step 0" in gates[0]["reason"]
    assert len(gates) == 3
    for g in gates[1:]:
        assert g["checkpoint"].endswith("checkpoint-1") and g["update_step"] == 1
    assert trainer.policy.global_step == 1


def test_a_gate_needs_checkpoints_and_known_monitors() -> None:
    with pytest.raises(ValueError, match="checkpoint_every"):
        Trainer(gate=agl.Gate(), serving=Serving(backend="scripted", script=["x"]))
    with pytest.raises(ValueError, match="Gate.monitors"):
        agl.Gate(monitors=("vibes",))
