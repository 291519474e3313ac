"""A served adapter is proven, not assumed (issue 36): after each push the engine's reported weight
version must be the pushed one, and a trained call must have been served by a version the trainer
published; otherwise the step fails loudly, naming both versions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agl.run.served import prove_calls, prove_push
from agl.trainer.pipeline import VersionLedger
from agl.types import Transition


def call(version: int | None) -> Transition:
    return Transition(
        rollout_id="r", attempt=1, index=0, prompt_ids=(1,), response_ids=(2,), weight_version=version
    )


def test_prove_push_names_both_versions() -> None:
    prove_push(4, 4, "the gateway")
    for reported in (3, None, "4", True):
        with pytest.raises(RuntimeError, match=r"pushed weight version 4, but the gateway reports version"):
            prove_push(reported, 4, "the gateway")


def test_a_call_served_by_an_unpublished_version_fails() -> None:
    prove_calls([call(3), call(None)], {3}, "step 2")  # no recorded version: not judged here
    with pytest.raises(
        RuntimeError, match=r"step 2: calls were served by weight version\(s\) \[7\].*published \[3\]"
    ):
        prove_calls([call(3), call(7)], {3}, "step 2")


def test_the_async_ledger_refuses_a_version_the_trainer_never_pushed() -> None:
    ledger = VersionLedger()
    ledger.pushed(1, 0)
    ledger.pushed(2, 1)
    assert ledger.lag(1, 2) == 1 and ledger.lag(None, 2) is None
    with pytest.raises(
        RuntimeError, match=r"weight version 0, which this trainer did not publish \(it published \[1, 2\]"
    ):
        ledger.lag(0, 2)
    resumed = VersionLedger()
    resumed.restore(ledger.state(), resumed_update=1)
    resumed.pushed(5, 1)
    assert resumed.lag(3, 5) == 0  # pushed by the killed run after its checkpoint: the checkpoint's weights


torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

import agl  # noqa: E402
from agl.gateway.backends.transformers import TransformersBackend  # noqa: E402
from agl.trainer.trainer import Trainer, load_tokenizer  # noqa: E402


class StaleEngine(TransformersBackend):
    """An engine that keeps serving its first adapter after later pushes and says so (ART #661's bug)."""

    async def push(self, policy: Any, *, version: int | None = None, staging_dir: Any = None) -> int:
        if self.engine._pushed_from is not None:
            return self.weight_version
        return await super().push(policy, version=version, staging_dir=staging_dir)


def test_the_trainer_fails_the_step_when_the_engine_does_not_serve_the_push(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    model, tok = LlamaForCausalLM(cfg), load_tokenizer()
    engine = StaleEngine(tokenizer=tok, model_name="tiny")
    trainer = Trainer(
        agl.LightningRL(group_size=2, lora_r=4, lora_alpha=8),
        model=model,
        backend=engine,
        tokenizer=tok,
        model_name="tiny",
        store="memory://",
        run_dir=tmp_path,
        runners=2,
        tasks_per_step=1,
        steps=3,
        val_every=0,
        config=agl.RunConfig(max_tokens=2),
        progress=False,
    )
    with pytest.raises(
        RuntimeError, match=r"pushed weight version (\d+), but the in-process gateway reports version"
    ):
        trainer.fit(lambda task, resources: 1.0, [{"q": "a"}])
    assert len(trainer.history) == 1  # the first push was served; the second was not


def test_step_timeout_cancels_the_needed_groups_and_leaves_the_ones_ahead_running() -> None:
    """The async loop's ``step_timeout_s``: no runner claims anything, so after the timeout the oldest
    group the step needs is cancelled (and completes without its rollouts); the group enqueued ahead
    is left queued for the runners."""
    import time

    import agl.store
    from agl.config import RolloutSettings
    from agl.trainer.pipeline import GroupPipeline, wait_for_groups
    from agl.types import Task

    store = agl.store.open("memory://")
    try:
        pipe = GroupPipeline(store, lambda r: ([], None), 2, RolloutSettings().for_store())
        first, ahead = pipe.enqueue([Task(id="a", input={"q": "a"}), Task(id="b", input={"q": "b"})], 0)
        t0 = time.monotonic()
        (got,) = wait_for_groups(pipe, 1, lambda g: True, lambda g: None, timeout_s=0.3)
        assert time.monotonic() - t0 >= 0.3
        assert got.group_id == first.group_id
        assert [store.get_rollout(rid).status for rid in first.ids] == ["cancelled", "cancelled"]
        assert [store.get_rollout(rid).status for rid in ahead.ids] == ["queued", "queued"]
        assert list(pipe.outstanding) == [ahead.group_id]
    finally:
        store.close()
