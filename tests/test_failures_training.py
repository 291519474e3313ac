"""Under an injected engine fault a seeded run trains exactly what the same run without it trains
(issue 64): the failed rollout is classified ``infra``, requeued at its seed place, and never scored.

Real pieces throughout, as in tests/test_reproducible.py: the embedded transformers engine (deterministic
mode) on a tiny random Llama, agl's gateway on 127.0.0.1, 4 runners, the OpenAI SDK as the agent's
client, the real update. The fault switch makes the real engine fail one chosen call; the gateway then
answers a real 502 and the agent's client raises.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("openai")

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.algorithms.update import PolicyUpdate  # noqa: E402
from agl.config import LoopConfig, RolloutSettings  # noqa: E402
from agl.engine import EngineSettings  # noqa: E402
from agl.errors import BackendError  # noqa: E402
from agl.gateway.backends.transformers import TransformersBackend  # noqa: E402
from agl.run.settings import Serving  # noqa: E402
from agl.tracing import provider as tracing  # noqa: E402
from agl.trainer.trainer import Trainer, load_tokenizer  # noqa: E402


@pytest.fixture(autouse=True)
def _instrumented() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    agl.instrument("openai")
    yield
    agl.uninstrument()
    tracing.reset_tracing()
    torch.set_num_threads(n)


class FaultSwitch:
    """Makes the engine fail the first ``times`` calls whose prompt mentions ``word``."""

    def __init__(self, word: str, times: int) -> None:
        self.word, self.left, self.fired = word, times, 0

    def __enter__(self) -> FaultSwitch:
        real = self.real = TransformersBackend.generate
        switch = self

        async def generate(backend: TransformersBackend, request: Any) -> Any:
            if switch.left > 0 and switch.word in str(request.messages or request.prompt):
                switch.left -= 1
                switch.fired += 1
                raise BackendError("the engine restarted under the call")
            return await real(backend, request)

        TransformersBackend.generate = generate  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        TransformersBackend.generate = self.real  # type: ignore[method-assign]


def _fit(
    tmp_path: Path, name: str, infra_retries: int = 2, **loop: Any
) -> tuple[Trainer, list[tuple[Any, ...]]]:
    from tests.test_reproducible import TASKS, tiny_model, two_call_agent

    trainer = Trainer(
        agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8),
        serving=Serving(
            model=tiny_model(),
            backend="transformers",
            engine=EngineSettings(deterministic=True),
            runners=4,
            run_dir=tmp_path / name,
            tokenizer=load_tokenizer(),
            progress=False,
        ),
        loop=LoopConfig(tasks_per_step=2, steps=1, val_every=0, val_before=False, seed=5, **loop),
        # every retry is the trainer's requeue at the seed place (a store retry is a new, reseeded attempt)
        rollout=RolloutSettings(max_attempts=1, infra_retries=infra_retries),
    )
    seen: list[tuple[Any, ...]] = []
    real = PolicyUpdate.step

    def spy(self: PolicyUpdate, transitions: Any, advantages: Any, **k: Any) -> Any:
        seen.extend(
            (t.prompt_ids, t.response_ids, t.seed, round(a, 6), t.failure_kind)
            for t, a in zip(transitions, advantages, strict=True)
        )
        return real(self, transitions, advantages, **k)

    PolicyUpdate.step = spy  # type: ignore[method-assign]
    try:
        trainer.fit(two_call_agent, TASKS)
    finally:
        PolicyUpdate.step = real  # type: ignore[method-assign]
    return trainer, seen


def test_a_502_is_requeued_and_the_step_trains_what_the_faultless_run_trains(tmp_path: Path) -> None:
    a, ts_a = _fit(tmp_path, "a")
    with FaultSwitch("Say something", times=1) as switch:
        b, ts_b = _fit(tmp_path, "b")
    assert switch.fired == 1
    assert ts_a and ts_b == ts_a  # member for member: token ids, seeds, advantages
    assert all(t[4] == "task" for t in ts_b)
    rec_a, rec_b = a.history[-1], b.history[-1]
    assert rec_b["errored_rollouts/infra"] == 1 and rec_b["requeued_rollouts"] == 1
    assert rec_a["errored_rollouts/infra"] == 0 and rec_a["requeued_rollouts"] == 0
    assert rec_b["train_reward"] == rec_a["train_reward"]
    assert rec_b["effective_group_size"] == 2 and rec_b["dropped_groups"] == 0


def test_a_spent_retry_budget_leaves_the_rollout_out_and_no_nan(tmp_path: Path) -> None:
    """Every call fails: nothing is scored, no update sees a zero from a failure, nothing is NaN."""
    with FaultSwitch("Say something", times=10**6):
        b, ts_b = _fit(tmp_path, "b", infra_retries=1)
    assert ts_b == []
    rec = b.history[-1]
    assert rec["requeued_rollouts"] == 4 and rec["errored_rollouts/infra"] == 8  # 4 places, 2 tries each
    assert rec["train_reward"] is None and rec["dropped_groups"] == 0 and rec["effective_group_size"] is None
    assert b.policy.global_step == 0  # no update: nothing a failure produced reached one


def test_the_async_schedule_requeues_a_502_in_its_group_and_trains_what_the_faultless_run_trains(
    tmp_path: Path,
) -> None:
    """max_staleness=1: the pipeline's member that got the 502 is classified infra and requeued at its
    seed place; its replacement takes its place in the group, so the step trains the faultless run's
    transitions (as a set: the asynchronous schedule takes groups in completion order)."""
    a, ts_a = _fit(tmp_path, "a", max_staleness=1)
    with FaultSwitch("Say something", times=1) as switch:
        b, ts_b = _fit(tmp_path, "b", max_staleness=1)
    assert switch.fired == 1
    assert ts_a and sorted(ts_b) == sorted(ts_a)  # token ids, seeds, advantages
    assert all(t[4] == "task" for t in ts_b)
    rec_a, rec_b = a.history[-1], b.history[-1]
    assert rec_a["errored_rollouts/infra"] == 0 and rec_a["requeued_rollout_ids"] == []
    assert rec_b["errored_rollouts/infra"] == 1 and rec_b["requeued_rollouts"] == 1
    (failed_id,) = rec_b["requeued_rollout_ids"]
    assert failed_id not in rec_b["trained_rollout_ids"] and len(rec_b["trained_rollout_ids"]) == 4
    failed = b.store.get_rollout(failed_id)
    assert b.adapter.failure_kind(b.store, failed) == "infra"  # its client retried: the 502 span decides
    (again,) = [
        r for r in b.store.query_rollouts(mode="train") if r.metadata.get("agl.requeued_from") == failed_id
    ]
    assert again.id in rec_b["trained_rollout_ids"] and again.group_id == failed.group_id
    assert again.metadata[sc.ROLLOUT_PLACE_KEY] == failed.metadata[sc.ROLLOUT_PLACE_KEY]
    assert again.metadata[sc.ROLLOUT_SEED_KEY] == failed.metadata[sc.ROLLOUT_SEED_KEY]
    assert rec_b["train_reward"] == rec_a["train_reward"] and rec_b["effective_group_size"] == 2
