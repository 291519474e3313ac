"""Asynchronous training (``max_staleness=k``) on a tiny random Llama served by the real transformers
engine behind agl's gateway, with the real openai client as the agent's LLM client.

Asserts: the served weight version of every trained call (read back from the gateway's spans in the
store, not from the trainer's bookkeeping) is at most ``k`` versions behind the update that trains it;
a group served by older weights is dropped and counted; every rollout is trained at most once; a
trainer SIGKILLed mid-run resumes from its checkpoint and every trained rollout id appears in exactly
one step of metrics.jsonl, up to the final step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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
import agl.store  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.config import LoopConfig  # noqa: E402
from agl.errors import UsageError  # noqa: E402
from agl.run.settings import Serving  # noqa: E402
from agl.tracing import provider as tracing  # noqa: E402
from agl.trainer.trainer import Trainer, load_tokenizer  # noqa: E402

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
        Trainer(serving=Serving(backend="scripted", script=["hi"]), loop=LoopConfig(max_staleness=-2))


def _ask(task: dict, resources: agl.Resources) -> str:
    """The agents' one LLM call, through the gateway the resources name."""
    llm = resources.llm
    client = openai.OpenAI(base_url=llm.base_url, api_key="x")
    out = client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["q"]}], **llm.sampling
    )
    return out.choices[0].message.content or ""


def _tiny_async_trainer(tmp_path: Path, k: int, **loop: Any) -> Trainer:
    """A tiny random Llama on the transformers engine, memory store, 4 runners, ``max_staleness=k``
    (``loop``: more LoopConfig fields)."""
    return Trainer(
        agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8),
        model=tiny_model(),
        serving=Serving(
            backend="transformers",
            model_name="tiny",
            tokenizer=load_tokenizer(),
            store="memory://",
            runners=4,
            run_dir=tmp_path,
            progress=False,
        ),
        loop=LoopConfig(val_every=0, max_staleness=k, **loop),
        config=agl.RunConfig(temperature=1.0, max_tokens=4),
    )


def _stale_first_group_fit(tmp_path: Path, k: int, **loop: Any) -> Trainer:
    """k, one task a step. The first group's calls are served by the first version, then its agents wait
    until two updates are recorded: by then the policy is two versions ahead of it. The other groups'
    agents finish only once both first-group calls are answered, so no update can come before one of
    them (on a loaded machine a runner may start a first-group member late)."""
    box: dict[str, Any] = {"first_answered": set()}

    def agent(task: dict, resources: agl.Resources) -> float:
        content = _ask(task, resources)
        store = box["t"].store
        rid = tracing.current_rollout()[0]
        first_group = store.get_rollout(rid).group_id == store.query_rollouts(mode="train")[0].group_id
        deadline = time.monotonic() + 30
        if first_group:
            box["first_answered"].add(rid)
        while not first_group and len(box["first_answered"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        while first_group and len(box["t"].history) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        return float(len(content) % 2)

    trainer = _tiny_async_trainer(tmp_path, k, tasks_per_step=1, steps=4, **loop)
    box["t"] = trainer
    trainer.fit(agent, [{"q": "hello"}, {"q": "count"}, {"q": "ten"}])
    return trainer


def test_no_trained_call_is_older_than_k_and_stale_groups_are_dropped(tmp_path: Path) -> None:
    """k=1: the first group, two versions behind when it completes, must be dropped (counted) and
    replaced, while the updates go on with the groups enqueued ahead."""
    k = 1
    trainer = _stale_first_group_fit(tmp_path, k)
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
        assert r["trainer_idle_s"] >= 0
        # the engine's busy clock counts its running pass up to now: a step's share is within its wall
        assert 0 <= r["engine_busy_s"] <= r["step_s"] + 0.01 and r["engine_idle_s"] >= 0
        trained += ids
    assert len(trained) == len(set(trained))  # no rollout trained twice
    assert sum(r["stale_groups_dropped"] for r in history) >= 1
    for r in history:  # a dropped group was served by weights older than current - k, and not trained
        assert len(r["dropped_rollout_ids"]) == 2 * r["stale_groups_dropped"]
        for rid in r["dropped_rollout_ids"]:
            assert min(served[rid]) < r["resources_version"] - k and rid not in trained


def test_no_group_is_enqueued_past_the_last_step(tmp_path: Path) -> None:
    """k=2 over 3 steps: the pipeline keeps k steps ahead but never enqueues for a step after the last,
    so every training group the store holds was trained or dropped (none ran for nothing), and the
    final held-out check runs with no training rollout left running beside it."""

    def agent(task: dict, resources: agl.Resources) -> float:
        return float(len(_ask(task, resources)) % 2)

    trainer = _tiny_async_trainer(tmp_path, 2, tasks_per_step=2, steps=3, val_before=False)
    trainer.fit(agent, [{"q": w} for w in ("a", "b", "c", "d", "e", "f")], [{"q": "held"}])
    train = trainer.store.query_rollouts(mode="train")
    used = {
        rid
        for r in trainer.history
        for rid in r.get("trained_rollout_ids", []) + r.get("dropped_rollout_ids", [])
    }
    assert {r.id for r in train} == used  # before the fix: 2 more steps' groups (8 rollouts) enqueued
    assert len(used) == 3 * 2 * 2 + 2 * sum(r.get("stale_groups_dropped", 0) for r in trainer.history)
    (final,) = [r for r in trainer.history if "val_reward" in r]
    assert final["step"] == 3 and final["val_rollouts"] == 1


def test_off_policy_tis_keeps_a_too_stale_group_and_weights_it(tmp_path: Path) -> None:
    """The same run with off_policy="tis": the first group, too stale for k=1, is trained (decoupled PPO
    on its recorded behaviour log-probs) instead of dropped, and each step logs tis_clip_fraction."""
    k = 1
    trainer = _stale_first_group_fit(tmp_path, k, off_policy="tis", tis_cap=1.5)
    history = trainer.history
    served = _served_versions(trainer.store)
    assert [r["step"] for r in history] == [0, 1, 2, 3]
    assert all(r["stale_groups_dropped"] == 0 for r in history)
    too_stale = [
        rid
        for r in history
        for rid in r["trained_rollout_ids"]
        if min(served[rid]) < r["resources_version"] - k
    ]
    assert len(too_stale) == 2  # the first group, kept
    assert max(r["staleness_max"] for r in history) > k
    for r in history:  # every step logs it (0 when no token was trained: zero advantages)
        assert 0.0 <= r["tis_clip_fraction"] <= 1.0 and r["tis_weight_mean"] > 0, r
    trained = [rid for r in history for rid in r["trained_rollout_ids"]]
    assert len(trained) == len(set(trained))


RUN_SCRIPT = """
import sys, time
import torch
torch.set_num_threads(1)
from transformers import LlamaConfig, LlamaForCausalLM
import agl, openai
from agl.config import RolloutSettings
from agl.trainer.trainer import Trainer, load_tokenizer

agl.instrument("openai")


def agent(task, resources):
    llm = resources.llm
    client = openai.OpenAI(base_url=llm.base_url, api_key="x")
    out = client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["q"]}], **llm.sampling
    )
    time.sleep(0.2)
    return float(len(out.choices[0].message.content or "") % 2)


torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
))
trainer = Trainer(
    agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8),
    model=model,
    serving=agl.Serving(
        backend="transformers", model_name="tiny", tokenizer=load_tokenizer(), run_dir=sys.argv[1],
        runners=4, progress=False,
    ),
    loop=agl.LoopConfig(
        tasks_per_step=2, steps=STEPS, val_every=0, checkpoint_every=1, max_staleness=1,
        resume=sys.argv[2] == "1",
    ),
    rollout=RolloutSettings(lease_s=2.0, max_attempts=5),
    config=agl.RunConfig(max_tokens=4),
)
trainer.fit(agent, [{"q": w} for w in ("a", "b", "c", "d", "e")])
"""


def _records(path: Path) -> list[dict[str, Any]]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_sigkilled_trainer_resumes_and_trains_every_rollout_exactly_once(tmp_path: Path) -> None:
    """The trainer (a subprocess: tiny model, SQLite store, a checkpoint every step) is SIGKILLed after
    its second step, in the middle of the next; a second process resumes with resume=True. From the
    metrics alone: every step 0..STEPS-1 appears once, every trained rollout id appears in exactly one
    step; and every group that had finished in the store but was not yet trained at the kill is
    trained (or, too stale, counted as dropped) after the resume: none is lost."""
    steps = 6
    script = tmp_path / "run_async.py"
    script.write_text(RUN_SCRIPT.replace("STEPS", str(steps)))
    run = tmp_path / "run"
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115 - closed below
    first = subprocess.Popen([sys.executable, str(script), str(run), "0"], stdout=log, stderr=log, cwd=ROOT)
    deadline = time.monotonic() + 120
    while len(_records(run / "metrics.jsonl")) < 2 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)  # into the next step: rollouts queued, running and finished but untrained
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    log.close()
    assert first.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
    killed_at = time.time()
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["next_step"] < steps  # killed mid-run
    second = subprocess.run(
        [sys.executable, str(script), str(run), "1"], capture_output=True, text=True, cwd=ROOT, timeout=240
    )
    assert second.returncode == 0, second.stderr[-3000:]
    records = _records(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps))  # the final step reached, each once
    trained = [rid for r in records for rid in r["trained_rollout_ids"]]
    dropped = {rid for r in records for rid in r["dropped_rollout_ids"]}
    assert len(trained) == len(set(trained)) == steps * 2 * 2  # no rollout trained twice
    assert not dropped & set(trained)
    store = agl.store.open(f"sqlite:///{run / 'store.db'}")
    try:
        rollouts = {r.id: r for r in store.query_rollouts(mode="train")}
        assert all(rollouts[rid].status in ("succeeded", "failed") for rid in trained)
        groups: dict[str, list[Any]] = {}
        for r in rollouts.values():
            groups.setdefault(r.group_id, []).append(r)
        done_before_kill = {
            gid
            for gid, rs in groups.items()
            if all(r.ended_at is not None and r.ended_at < killed_at and r.status != "cancelled" for r in rs)
        }
        untrained_at_kill = done_before_kill - set(state["consumed_groups"])
        used = {rollouts[rid].group_id for rid in trained} | {rollouts[rid].group_id for rid in dropped}
        assert untrained_at_kill <= used  # finished while no one trained: picked up, none lost
    finally:
        store.close()


def test_examples_take_max_staleness() -> None:
    import importlib

    parser = importlib.import_module("examples.calc_agent.cli").parser()
    assert parser.parse_args(["train", "--max-staleness", "2"]).max_staleness == 2
    assert parser.parse_args(["train"]).max_staleness == 0
