"""Under an injected engine fault a seeded run trains exactly what the same run without it trains
(issue 64): the failed rollout is classified ``infra``, requeued at its seed place, and never scored.

Real pieces throughout, as in tests/test_reproducible.py: the embedded transformers engine (deterministic
mode) on a tiny random Llama, agl's gateway on 127.0.0.1, 4 runners, the OpenAI SDK as the agent's
client, the real update. The fault switch makes the real engine fail one chosen call; the gateway then
answers a real 502 and the agent's client raises. The same in the asynchronous schedule; a real
``agl runner`` process SIGKILLed mid-rollout (over a store server) instead of a 502; and the honest
failures beside them: an agent raising in its own code (``agent``, penalised by AIR, never requeued)
and a wrong answer (``task``, its reward 0).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
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
    tmp_path: Path, name: str, infra_retries: int = 2, agent: Any = None, tasks: Any = None, **loop: Any
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
        trained.extend(transitions)
        return real(self, transitions, advantages, **k)

    trained: list[Any] = []
    trainer.trained = trained  # type: ignore[attr-defined] - the transitions the update got
    PolicyUpdate.step = spy  # type: ignore[method-assign]
    try:
        trainer.fit(agent or two_call_agent, tasks or TASKS)
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


#: the two-call agent of tests/test_reproducible.py as `agl runner` loads it; with HANG_FILE set, it
#: makes its first call, says so in that file and hangs there: the test SIGKILLs its runner
RUNNER_AGENT = """
import os
import time
import openai


def agent(task, resources):
    llm = resources.llm
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "x", max_retries=0)
    messages = [{"role": "user", "content": f"Say something about {task['q']}."}]
    first = client.chat.completions.create(model=llm.model, messages=messages, max_tokens=6)
    if os.environ.get("HANG_FILE"):
        open(os.environ["HANG_FILE"], "w").close()
        time.sleep(600)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""}]
    messages += [{"role": "user", "content": "Again."}]
    second = client.chat.completions.create(model=llm.model, messages=messages, max_tokens=6)
    text = (first.choices[0].message.content or "") + (second.choices[0].message.content or "")
    return float(sum(map(ord, text)) % 2)
"""


def _runner(tmp_path: Path, store_url: str, name: str, concurrency: int, **env: str) -> Any:
    """A real ``agl runner`` process for ``RUNNER_AGENT`` (it instruments the openai client itself)."""
    cmd = [sys.executable, "-m", "agl.cli", "runner", "--store", store_url, "--agent", "kill_agent:agent"]
    cmd += ["--concurrency", str(concurrency), "--idle-s", "0.5", "--worker-id", name]
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - the process owns it until it ends
    full_env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        **env,
    }
    return subprocess.Popen(cmd, cwd=tmp_path, env=full_env, stdout=log, stderr=log)


def _stop(proc: Any) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _fit_external(
    tmp_path: Path, name: str, kill: bool
) -> tuple[Trainer, list[tuple[Any, ...]], dict[str, Any]]:
    """The seeded run of :func:`_fit` with its rollouts run by ``agl runner`` processes over a store
    server (the trainer runs none). ``kill``: a first runner claims a rollout, makes its first call
    and is SIGKILLed; the healthy runner starts after. Returns what the store says of the victim's
    rollout and its replacement too."""
    from agl.store.server import ServerProcess
    from tests.test_reproducible import TASKS, tiny_model, two_call_agent

    run = tmp_path / name
    run.mkdir()
    (run / "kill_agent.py").write_text(RUNNER_AGENT)
    server = ServerProcess(run / "store.db", log_path=run / "store.log")
    store_url = server.start()
    trainer = Trainer(
        agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8),
        serving=Serving(
            model=tiny_model(),
            backend="transformers",
            engine=EngineSettings(deterministic=True),
            store=store_url,
            runners=0,
            run_dir=run,
            tokenizer=load_tokenizer(),
            progress=False,
        ),
        loop=LoopConfig(tasks_per_step=2, steps=1, val_every=0, val_before=False, seed=5),
        # the lease lapses 3 s after the kill; every retry is the trainer's requeue at the seed place
        rollout=RolloutSettings(max_attempts=1, infra_retries=2, lease_s=3.0),
    )
    seen: list[tuple[Any, ...]] = []
    real = PolicyUpdate.step

    def spy(self: PolicyUpdate, transitions: Any, advantages: Any, **k: Any) -> Any:
        seen.extend(
            (t.prompt_ids, t.response_ids, t.seed, round(a, 6), t.failure_kind)
            for t, a in zip(transitions, advantages, strict=True)
        )
        return real(self, transitions, advantages, **k)

    procs: list[Any] = []
    failed: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit(two_call_agent, TASKS)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            failed.append(exc)

    PolicyUpdate.step = spy  # type: ignore[method-assign]
    about: dict[str, Any] = {}
    try:
        hang = run / "hung"
        if kill:
            procs.append(victim := _runner(run, store_url, "victim", 1, HANG_FILE=str(hang)))
        fitting = threading.Thread(target=fit, daemon=True)
        fitting.start()
        if kill:
            deadline = time.monotonic() + 120
            while not hang.exists():
                assert victim.poll() is None, (run / "victim.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the victim runner never made its first call"
                time.sleep(0.05)
            os.kill(victim.pid, signal.SIGKILL)  # mid-rollout: after its first call, before its second
            victim.wait(timeout=30)
        procs.append(_runner(run, store_url, "healthy", 4))
        fitting.join(timeout=300)
        assert not fitting.is_alive(), "the run did not finish"
        if failed:
            raise failed[0]
        if kill:  # read while the store server runs
            rows = trainer.store.query_rollouts(mode="train")
            (victim,) = [r for r in rows if any(a.worker_id == "victim" for a in r.attempts)]
            (again,) = [r for r in rows if r.metadata.get("agl.requeued_from") == victim.id]
            about = {
                "attempts": [a.status for a in victim.attempts],
                "kind": trainer.adapter.failure_kind(trainer.store, victim),
                "same_place": again.metadata[sc.ROLLOUT_PLACE_KEY] == victim.metadata[sc.ROLLOUT_PLACE_KEY],
                "again_by": [a.worker_id for a in again.attempts],
                "again_status": again.status,
            }
    finally:
        PolicyUpdate.step = real  # type: ignore[method-assign]
        for p in procs:
            _stop(p)
        server.stop()
    return trainer, seen, about


def test_a_runner_sigkilled_mid_rollout_is_infra_requeued_and_the_step_trains_the_faultless_run(
    tmp_path: Path,
) -> None:
    """A real ``agl runner`` process is SIGKILLed after its rollout's first call: no attempt finished,
    the lease lapses — ``infra``; the trainer requeues it at its seed place and the healthy runner runs
    it, so the step trains exactly what the same run without the kill trains."""
    a, ts_a, _ = _fit_external(tmp_path, "a", kill=False)
    b, ts_b, victim = _fit_external(tmp_path, "b", kill=True)
    assert ts_a and ts_b == ts_a  # member for member: token ids, seeds, advantages
    assert all(t[4] == "task" for t in ts_b)
    assert victim["attempts"] == ["lost"] and victim["kind"] == "infra"
    assert (
        victim["same_place"] and victim["again_by"] == ["healthy"] and victim["again_status"] == "succeeded"
    )
    rec_a, rec_b = a.history[-1], b.history[-1]
    assert rec_a["requeued_rollouts"] == 0 and rec_b["requeued_rollouts"] >= 1
    assert rec_b["errored_rollouts/infra"] >= 1 and rec_b["errored_rollouts/agent"] == 0
    assert rec_b["train_reward"] == rec_a["train_reward"] and rec_b["effective_group_size"] == 2


def buggy_or_wrong(task: dict, resources: agl.Resources) -> float:
    """One call; then the ``bug`` task's own code raises (after the call that led to it), and the other
    task's answer is graded: a wrong one earns 0, as honestly as a right one earns 1."""
    import openai

    llm = resources.llm
    assert llm is not None
    client = openai.OpenAI(base_url=llm.base_url, api_key="x", max_retries=0)
    out = client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": f"Say something about {task['q']}."}],
        max_tokens=6,
    )
    if task.get("bug"):
        raise KeyError("the agent's own bug, after the call")
    return 1.0 if out.choices[0].message.content == "a right answer the random model never writes" else 0.0


def test_an_agent_that_raises_is_agent_penalised_by_air_never_requeued_a_wrong_answer_is_task(
    tmp_path: Path,
) -> None:
    """In a training step: the group whose agent raises in its own code is classified ``agent``, never
    requeued, and trained with AIR's exception penalty on the call before the raise (its final reward
    the adapter's default, 0); the wrong answers are ``task``, trained with their reward of 0."""
    tasks = [{"q": "cats", "bug": True}, {"q": "dogs"}]
    b, _ = _fit(tmp_path, "b", agent=buggy_or_wrong, tasks=tasks)
    rec = b.history[-1]
    assert rec["errored_rollouts/agent"] == 2 and rec["errored_rollouts/infra"] == 0
    assert rec["requeued_rollouts"] == 0 and rec["rollouts_failed"] == 2
    assert len(b.store.query_rollouts(mode="train")) == 4  # nothing enqueued again
    trained = b.trained  # type: ignore[attr-defined]
    assert len(trained) == 4  # one call per rollout, every rollout trained
    kinds = {t.rollout_id: t.failure_kind for t in trained}
    bug = [t for t in trained if kinds[t.rollout_id] == "agent"]
    wrong = [t for t in trained if kinds[t.rollout_id] == "task"]
    assert len(bug) == 2 and len(wrong) == 2
    assert all(t.intermediate_reward == pytest.approx(-0.1) and t.final_reward == 0.0 for t in bug)
    assert all(t.intermediate_reward == 0.0 and t.final_reward == 0.0 for t in wrong)
    assert rec["air_penalty"] == pytest.approx(-0.05)  # the step's record: -0.1 on 2 of its 4 rollouts
