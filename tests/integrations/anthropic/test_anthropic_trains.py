"""An agent written against the Anthropic client trains unchanged: ``Trainer.fit`` serves a tiny model
behind the gateway's Messages API, the real SDK calls it, and the update trains on exact token ids."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

anthropic = pytest.importorskip("anthropic")
torch = pytest.importorskip("torch")
pytest.importorskip("peft")

import agl  # noqa: E402
from agl.chat.tokenizer import load_tokenizer  # noqa: E402
from agl.tracing import provider as tracing  # noqa: E402

GOOD, BAD = "Paris.", "I am not sure."


class Alternate:
    """The engine: replies alternate between a right and a wrong answer, so each group has both (the
    test runs one rollout at a time: with two at once, two groups' calls could interleave so that one
    group gets both right answers and the other both wrong ones, and neither trains)."""

    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()

    def __call__(self, request: Any) -> str:
        with self.lock:
            self.n += 1
            return GOOD if self.n % 2 else BAD


def claude_style_agent(task: dict, resources: agl.Resources) -> float:
    """Unchanged Anthropic-client code: the rollout function only points the client at the gateway."""
    llm = resources.llm
    assert llm is not None
    client = anthropic.Anthropic(base_url=llm.base_url.removesuffix("/v1"), api_key="x", max_retries=0)
    with agl.agent("geographer"):
        msg = client.messages.create(
            model=llm.model,
            max_tokens=16,
            system="Answer in one short sentence.",
            messages=[{"role": "user", "content": task["q"]}],
        )
    text = "".join(b.text for b in msg.content if b.type == "text")
    return 1.0 if text.strip() == GOOD else 0.0


def _tiny_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

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


def test_an_anthropic_client_agent_trains_on_exact_ids(tmp_path: Path) -> None:
    agl.instrument("anthropic")
    try:
        trainer = agl.Trainer(
            agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8),
            model=_tiny_model(),
            serving=agl.Serving(
                tokenizer=load_tokenizer(),
                backend="scripted",
                script=Alternate(),
                store="memory://",
                runners=1,
                run_dir=tmp_path / "run",
                progress=False,
            ),
            loop=agl.LoopConfig(tasks_per_step=2, steps=2, val_every=0),
        )
        summary = trainer.fit(
            claude_style_agent, [{"q": "Capital of France?"}, {"q": "Where is the Louvre?"}]
        )
    finally:
        agl.uninstrument()
        tracing.reset_tracing()
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "train_reward" in s]
    assert len(trained) == 2 and summary["steps"] == 2
    for s in trained:
        # every call went through the Messages API with the engine's exact ids, and was trained on
        assert s["transitions"] == 4 and s["exact_token_ratio"] == 1.0
        assert s["trained_transitions"] == 4 and s["grad_norm"] > 0
        assert 0.0 < s["train_reward"] < 1.0
