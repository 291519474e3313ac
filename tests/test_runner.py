"""The Runner against a real store: rewards, errors, timeouts, heartbeats, leases, shutdown, the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import agl
from agl import semconv as sc
from agl.runner.runner import Runner, load_agent, rollout, rollout_resources
from agl.store.memory import MemoryStore
from agl.tracing import provider as tracing
from agl.types import LLM, NewRollout, RolloutConfig


@pytest.fixture()
def store() -> Iterator[MemoryStore]:
    s = MemoryStore()
    yield s
    tracing.reset_tracing()
    s.close()


def _enqueue(store: MemoryStore, inputs: list, **config: float) -> list[str]:
    cfg = RolloutConfig(**config) if config else RolloutConfig()
    return [r.id for r in store.enqueue([NewRollout(input=x, config=cfg) for x in inputs])]


def _spans(store: MemoryStore, rid: str, name: str) -> list:
    return store.query_spans(rollout_id=rid, name=name)


def test_sync_agent_return_value_becomes_the_primary_reward(store: MemoryStore) -> None:
    store.add_resources({"main": LLM(base_url="http://127.0.0.1:9/v1", model="m")})
    seen: dict[str, tuple] = {}

    def agent(task: dict, resources: agl.Resources) -> float:
        seen[task["k"]] = (agl.current_rollout(), resources.llm.base_url, threading.current_thread().name)
        return task["k"] * 0.5

    ids = _enqueue(store, [{"k": 1}, {"k": 2}, {"k": 3}])
    stats = Runner(agent, store, concurrency=2, claim_timeout_s=0.05).run(until_idle=True)
    assert stats.succeeded == 3 and stats.failed == 0
    for rid, k in zip(ids, (1, 2, 3), strict=True):
        r = store.get_rollout(rid)
        assert r.status == "succeeded"
        (ctx, url, thread) = seen[k]
        assert ctx == (rid, 1)  # the rollout context reached the agent's thread
        assert url == f"http://127.0.0.1:9/rollouts/{rid}/attempts/1/v1"
        assert thread != threading.main_thread().name
        [reward] = _spans(store, rid, sc.SPAN_REWARD)
        assert reward.attributes[sc.AGL_REWARD_VALUE] == k * 0.5
        assert reward.attributes[sc.AGL_REWARD_PRIMARY] is True
        assert reward.attributes[sc.AGL_REWARD_SOURCE] == "return"
        # the reward span sits in the rollout's trace, under its agl.rollout span
        [root] = _spans(store, rid, sc.SPAN_ROLLOUT)
        assert reward.trace_id == root.trace_id and reward.parent_id == root.span_id


def test_async_agents_run_concurrently_and_none_means_emitted_rewards(store: MemoryStore) -> None:
    running = 0
    peak = 0

    @rollout
    async def agent(task: int) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.05)
        agl.emit_reward(float(task), name="score")
        running -= 1
        return None

    ids = _enqueue(store, list(range(6)))
    stats = Runner(agent, store, concurrency=3, claim_timeout_s=0.05).run(until_idle=True)
    assert stats.succeeded == 6
    assert peak == 3
    for i, rid in enumerate(ids):
        [reward] = _spans(store, rid, sc.SPAN_REWARD)
        assert reward.attributes[sc.AGL_REWARD_SOURCE] == "emit"
        assert reward.attributes[sc.AGL_REWARD_VALUE] == float(i)


def test_exception_is_an_error_span_with_traceback_and_the_attempt_error(store: MemoryStore) -> None:
    def agent(task: str, resources: object) -> float:
        raise RuntimeError(f"tool broke on {task}")

    [rid] = _enqueue(store, ["x"])
    stats = Runner(agent, store, claim_timeout_s=0.05).run(until_idle=True)
    assert stats.failed == 1
    r = store.get_rollout(rid)
    assert r.status == "failed"
    err = r.attempts[0].error
    assert err is not None and err.type == "RuntimeError" and err.message == "tool broke on x"
    assert "raise RuntimeError" in (err.traceback or "")
    [exc] = _spans(store, rid, sc.SPAN_EXCEPTION)
    assert exc.status.code == "ERROR"
    assert exc.attributes[sc.AGL_EXCEPTION_TYPE] == "RuntimeError"
    assert any(
        "raise RuntimeError" in str(e.attributes.get(sc.AGL_EXCEPTION_STACKTRACE, "")) for e in exc.events
    )
    assert not _spans(store, rid, sc.SPAN_REWARD)


def test_bad_return_value_fails_the_attempt_with_a_clear_error(store: MemoryStore) -> None:
    [rid] = _enqueue(store, ["x"])
    Runner(lambda task, res: "great", store, claim_timeout_s=0.05).run(until_idle=True)
    err = store.get_rollout(rid).attempts[0].error
    assert err is not None and err.type == "TypeError" and "returned str" in err.message


def test_timeout_fails_the_attempt_and_a_retry_can_succeed(store: MemoryStore) -> None:
    calls: list[int] = []

    async def agent(task: str) -> float:
        calls.append(1)
        if len(calls) == 1:
            await asyncio.sleep(5)
        return 1.0

    [rid] = _enqueue(store, ["slow"], max_attempts=2)
    stats = Runner(agent, store, timeout_s=0.2, claim_timeout_s=0.05).run(until_idle=True)
    assert stats.timed_out == 1 and stats.succeeded == 1
    r = store.get_rollout(rid)
    assert r.status == "succeeded"
    assert [a.status for a in r.attempts] == ["failed", "succeeded"]
    assert r.attempts[0].error is not None and r.attempts[0].error.type == "TimeoutError"
    assert [
        s.attributes[sc.AGL_EXCEPTION_TYPE]
        for s in store.query_spans(rollout_id=rid, attempt=1, name=sc.SPAN_EXCEPTION)
    ] == ["TimeoutError"]


def test_heartbeats_keep_a_long_rollout_alive(store: MemoryStore) -> None:
    def agent(task: str) -> float:
        time.sleep(0.6)  # three leases long
        return 1.0

    [rid] = _enqueue(store, ["long"], lease_s=0.2)
    stats = Runner(agent, store, claim_timeout_s=0.05).run(until_idle=True)
    assert stats.succeeded == 1 and stats.lost == 0
    assert [a.status for a in store.get_rollout(rid).attempts] == ["succeeded"]


def test_lost_lease_is_retried_and_the_old_spans_are_stale(store: MemoryStore) -> None:
    """A runner whose heartbeats stop (a killed host) loses its attempt; another runner retries it."""
    first = threading.Event()

    def agent(task: str) -> float:
        if not first.is_set():
            first.set()
            agl.emit_message("from the lost attempt")
            time.sleep(0.5)
            return 0.0
        agl.emit_message("from the retry")
        return 1.0

    [rid] = _enqueue(store, ["x"], lease_s=0.15, max_attempts=2)
    # heartbeat_s beyond the lease: this runner behaves like one that died mid-rollout
    dead = Runner(agent, store, heartbeat_s=10, claim_timeout_s=0.05)
    stats = dead.run(max_rollouts=1)
    assert stats.lost == 1 and stats.succeeded == 0
    stats2 = Runner(agent, store, claim_timeout_s=0.05).run(until_idle=True)
    assert stats2.succeeded == 1
    r = store.get_rollout(rid)
    assert [a.status for a in r.attempts] == ["lost", "succeeded"]
    fresh = [
        s.attributes[sc.AGL_MESSAGE_BODY]
        for s in store.query_spans(rollout_id=rid, include_stale=False, name=sc.SPAN_MESSAGE)
    ]
    assert fresh == ["from the retry"]
    old = store.query_spans(rollout_id=rid, attempt=1, name=sc.SPAN_MESSAGE)
    assert old and all(s.stale for s in old)


def test_stop_releases_in_flight_work_so_it_is_requeued(store: MemoryStore) -> None:
    started = threading.Event()

    async def agent(task: str) -> float:
        started.set()
        await asyncio.sleep(10)
        return 1.0

    [rid] = _enqueue(store, ["x"], max_attempts=3)
    runner = Runner(agent, store, claim_timeout_s=0.05, grace_s=0.0)

    def stopper() -> None:
        started.wait(5)
        runner.stop()

    threading.Thread(target=stopper).start()
    t0 = time.monotonic()
    stats = runner.run()
    assert time.monotonic() - t0 < 5
    assert stats.released == 1
    r = store.get_rollout(rid)
    assert r.status == "queued"
    assert r.attempts[0].status == "failed" and r.attempts[0].error.type == "WorkerShutdown"


def test_stop_waits_for_in_flight_work_within_the_grace_period(store: MemoryStore) -> None:
    started = threading.Event()

    def agent(task: str) -> float:
        started.set()
        time.sleep(0.3)
        return 1.0

    ids = _enqueue(store, ["a", "b"])
    runner = Runner(agent, store, claim_timeout_s=0.05, grace_s=10.0)
    threading.Thread(target=lambda: (started.wait(5), runner.stop())).start()
    stats = runner.run()
    assert stats.succeeded == 1 and stats.released == 0
    assert sorted(store.get_rollout(i).status for i in ids) == ["queued", "succeeded"]


def test_resources_rewrite_and_bad_arguments() -> None:
    res = agl.Resources(version=3, items={"main": LLM(base_url="http://gw:8000/v1", model="m")})
    out = rollout_resources(res, "ro-1", 2)
    assert out is not None and out.llm is not None
    assert out.llm.base_url == "http://gw:8000/rollouts/ro-1/attempts/2/v1"
    assert res.llm is not None and res.llm.base_url == "http://gw:8000/v1"  # the snapshot is unchanged
    s = MemoryStore()
    with pytest.raises(ValueError, match="concurrency"):
        Runner(lambda t: 1.0, s, concurrency=0, trace=False)
    with pytest.raises(ValueError, match="timeout_s"):
        Runner(lambda t: 1.0, s, timeout_s=-1, trace=False)
    with pytest.raises(TypeError, match="task input"):
        rollout(lambda: 1.0)
    with pytest.raises(ValueError, match="module:function"):
        load_agent("nocolon")
    with pytest.raises(ValueError, match="cannot import"):
        load_agent("agl_no_such_module:agent")


def test_unpinned_rollouts_run_with_the_resources_current_at_each_attempt(store: MemoryStore) -> None:
    """An unpinned rollout takes the store's latest resources when its attempt starts (the store pins
    each attempt to the latest version at claim time), not the ones the runner saw first: a resumed
    trainer's gateway moves, APO publishes new prompts. A pinned one keeps its version."""
    v1 = store.add_resources({"main": LLM(base_url="http://127.0.0.1:9/v1", model="m")}).version
    seen: dict[str, str] = {}

    def agent(task: dict, resources: agl.Resources) -> float:
        assert resources.llm is not None
        seen[task["k"]] = resources.llm.base_url.split("/rollouts/")[0]
        return 1.0

    runner = Runner(agent, store, concurrency=1, claim_timeout_s=0.05)
    _enqueue(store, [{"k": "first"}])
    assert runner.run(until_idle=True).succeeded == 1
    store.add_resources({"main": LLM(base_url="http://127.0.0.1:10/v1", model="m")})
    _enqueue(store, [{"k": "after the update"}])
    store.enqueue([NewRollout(input={"k": "pinned"}, resources_version=v1)])
    assert runner.run(until_idle=True).succeeded == 3
    assert seen == {
        "first": "http://127.0.0.1:9",
        "after the update": "http://127.0.0.1:10",
        "pinned": "http://127.0.0.1:9",
    }


AGENT_MODULE = """
import time
import agl

@agl.rollout
def agent(task, resources):
    agl.emit_message("started " + str(task))
    if task == "slow":
        time.sleep(30)
    return 1.0
"""


def test_cli_runs_rollouts_and_sigterm_requeues_in_flight_work(tmp_path: Path) -> None:
    from agl.store.sqlite import SQLiteStore

    (tmp_path / "my_agent.py").write_text(textwrap.dedent(AGENT_MODULE))
    db = tmp_path / "store.db"
    store = SQLiteStore(str(db))
    fast = [r.id for r in store.enqueue([NewRollout(input=i) for i in range(3)])]
    env = {**os.environ, "PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [
        sys.executable,
        "-m",
        "agl.cli",
        "runner",
        "--store",
        f"sqlite:///{db}",
        "--agent",
        "my_agent:agent",
    ]
    done = subprocess.run(
        [*cmd, "--concurrency", "2", "--max-rollouts", "3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert [store.get_rollout(i).status for i in fast] == ["succeeded"] * 3
    assert all(store.query_spans(rollout_id=i, name=sc.SPAN_MESSAGE) for i in fast)

    [slow] = [r.id for r in store.enqueue([NewRollout(input="slow", config=RolloutConfig(max_attempts=2))])]
    proc = subprocess.Popen(
        [*cmd, "--idle-s", "0.2"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not store.query_spans(rollout_id=slow, name=sc.SPAN_MESSAGE):
            assert time.monotonic() < deadline, "the runner never started the slow rollout"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)  # graceful: stop claiming, give in-flight work its grace period
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)  # second signal: release now
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert (
        "released" in out
        and json.loads(out.strip().splitlines()[-1].replace("'", '"').replace("None", "null"))["released"]
        == 1
    )
    r = store.get_rollout(slow)
    assert r.status == "queued" and r.attempts[0].status == "failed"
    store.close()


def test_hung_sync_agents_are_counted_and_capped(store: MemoryStore) -> None:
    """A sync agent that ignores its timeout keeps its thread (Python cannot stop one): the runner
    finishes the attempt, counts the thread as hung, and stops claiming at ``max_hung`` until some
    return."""
    release = threading.Event()
    started: list[str] = []

    def agent(task: str) -> float:
        started.append(task)
        release.wait(60)  # wedged until the test lets go
        return 1.0

    ids = _enqueue(store, ["a", "b", "c", "d", "e"])
    runner = Runner(agent, store, timeout_s=0.2, claim_timeout_s=0.05, max_hung=2)
    done: list = []
    thread = threading.Thread(target=lambda: done.append(asyncio.run(runner.run_async())), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while runner.stats.hung < 2:
            assert time.monotonic() < deadline, runner.stats
            time.sleep(0.02)
        time.sleep(1.0)  # ten claim timeouts' worth: nothing more is claimed while two are hung
        assert runner.stats.claimed == 2 and runner.stats.timed_out == 2
        assert len(started) == 2
        statuses = [store.get_rollout(rid).status for rid in ids]
        assert statuses.count("failed") == 2 and statuses.count("queued") == 3
        assert runner.stats.as_dict()["hung"] == 2
        release.set()  # the hung agents return: their threads are reclaimed, claiming resumes
        while sum(store.get_rollout(rid).status == "succeeded" for rid in ids) < 3:
            assert time.monotonic() < deadline + 30, runner.stats
            time.sleep(0.02)
        assert runner.stats.hung == 0
    finally:
        release.set()
        runner.stop(now=True)
        thread.join(30)
    assert done and done[0].succeeded == 3


def test_until_idle_exits_when_max_hung_agents_are_running(store: MemoryStore) -> None:
    release = threading.Event()

    def agent(task: str) -> float:
        release.wait(60)
        return 1.0

    ids = _enqueue(store, ["a", "b", "c"])
    try:
        stats = Runner(agent, store, timeout_s=0.2, claim_timeout_s=0.05, max_hung=1).run(until_idle=True)
        assert stats.claimed == 1 and stats.timed_out == 1 and stats.hung == 1
        assert [store.get_rollout(rid).status for rid in ids].count("queued") == 2
    finally:
        release.set()
    with pytest.raises(ValueError, match="max_hung"):
        Runner(agent, store, max_hung=0)


class _StuckStore(MemoryStore):
    """A real MemoryStore whose span writes for one rollout hang until released."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck_id: str | None = None
        self.entered = threading.Event()
        self.release = threading.Event()

    def add_spans(self, spans, *, idempotency_key=None):  # type: ignore[no-untyped-def]
        if any(s.rollout_id == self.stuck_id for s in spans):
            self.entered.set()
            assert self.release.wait(30)
        return super().add_spans(spans, idempotency_key=idempotency_key)


def test_an_attempt_finishes_while_another_rollouts_span_write_hangs() -> None:
    store = _StuckStore()
    try:
        stuck, fast = _enqueue(store, ["stuck", "fast"])
        store.stuck_id = stuck

        def agent(task: str) -> float:
            if task == "fast":
                assert store.entered.wait(10)  # the stuck rollout's spans are being written (and hang)
            return 1.0

        runner = Runner(agent, store, concurrency=2, claim_timeout_s=0.05)
        result: list = []
        thread = threading.Thread(target=lambda: result.append(runner.run(until_idle=True)))
        thread.start()
        deadline = time.monotonic() + 10
        while store.get_rollout(fast).status != "succeeded" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.get_rollout(fast).status == "succeeded"
        assert [s.name for s in _spans(store, fast, sc.SPAN_REWARD)] == [sc.SPAN_REWARD]
        # the stuck attempt is not finished before its spans are stored
        assert store.get_rollout(stuck).attempts[0].status == "running"
        assert store.query_spans(rollout_id=stuck) == []
        store.release.set()
        thread.join(20)
        assert not thread.is_alive() and result[0].succeeded == 2
        assert store.get_rollout(stuck).status == "succeeded"
        assert _spans(store, stuck, sc.SPAN_REWARD)
    finally:
        store.release.set()
        tracing.reset_tracing()
        store.close()
