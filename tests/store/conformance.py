"""The Store conformance suite: every implementation must pass these tests unchanged.

The tests use only the ``agl.store.base.Store`` protocol through the ``store`` fixture (see
``conftest.py`` for how implementations are registered). Timing-based tests use short leases but
generous margins, so a loaded machine slows them down instead of failing them.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from agl.store.base import ConflictError, InvalidInputError, NotFoundError, Store
from agl.types import AttemptError, NewRollout, Rollout, RolloutConfig, Span, Task

# ----------------------------------------------------------------------------------------- helpers


def hexid(n: int) -> str:
    return os.urandom(n).hex()


def span(
    rollout_id: str, attempt: int = 1, name: str = "step", trace_id: str | None = None, **kw: Any
) -> Span:
    now = time.time_ns()
    return Span(
        trace_id=trace_id or hexid(16),
        span_id=hexid(8),
        name=name,
        start_ns=now,
        end_ns=now + 1000,
        rollout_id=rollout_id,
        attempt=attempt,
        attributes=kw.pop("attributes", {"k": 1, "f": 0.5, "s": "v", "l": [1, 2]}),
        **kw,
    )


def span_dict(rollout_id: str, attempt: int = 1, **over: Any) -> dict[str, Any]:
    d = span(rollout_id, attempt).model_dump()
    d.pop("seq")
    d.pop("stale")
    d.update(over)
    return d


def enqueue(store: Store, n: int = 1, **kw: Any) -> list[Rollout]:
    cfg = kw.pop("config", None)
    items = [NewRollout(input={"i": i}, config=cfg or RolloutConfig(), **kw) for i in range(n)]
    return store.enqueue(items)


def snapshot(store: Store) -> Any:
    """Everything a query can see, as plain data: compared before/after refused calls."""
    res = store.get_resources()
    return (
        [r.model_dump() for r in store.query_rollouts()],
        [s.model_dump() for s in store.query_spans()],
        [t.model_dump() for t in store.query_tasks()],
        None if res is None else res.model_dump(),
    )


def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


LLM = {"type": "llm", "base_url": "http://127.0.0.1:1/v1", "model": "m"}

# ------------------------------------------------------------------------------------------- tasks


def test_tasks_add_get_query(store: Store) -> None:
    tasks = [Task(id="t1", input={"q": 1}), Task(id="t2", input="x", mode="val"), Task(id="t3")]
    assert store.add_tasks(tasks) == tasks
    assert store.get_task("t2") == tasks[1]
    assert [t.id for t in store.query_tasks()] == ["t1", "t2", "t3"]
    assert [t.id for t in store.query_tasks(mode="val")] == ["t2"]
    assert [t.id for t in store.query_tasks(limit=2)] == ["t1", "t2"]
    # replace by id keeps the task's place
    store.add_tasks([Task(id="t1", input={"q": 2})])
    assert store.get_task("t1").input == {"q": 2}
    assert [t.id for t in store.query_tasks()] == ["t1", "t2", "t3"]
    with pytest.raises(NotFoundError, match="t9"):
        store.get_task("t9")


def test_tasks_bad_input_changes_nothing(store: Store) -> None:
    store.add_tasks([Task(id="t1")])
    before = snapshot(store)
    with pytest.raises(InvalidInputError, match="finite"):
        store.add_tasks([{"id": "t2"}, {"id": "t3", "input": {"x": math.nan}}])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="id"):
        store.add_tasks([{"id": "bad id with spaces"}])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="mode"):
        store.query_tasks(mode="prod")  # type: ignore[arg-type]
    assert snapshot(store) == before


# ---------------------------------------------------------------------------------------- rollouts


def test_enqueue_and_get(store: Store) -> None:
    out = store.enqueue(
        [
            NewRollout(input={"a": 1}, group_id="g1", metadata={"m": [1, 2]}),
            NewRollout(id="ro-fixed", task_id="t1", mode="val", config=RolloutConfig(max_attempts=3)),
            {"input": "as a dict"},  # type: ignore[list-item]
        ]
    )
    assert len(out) == 3 and len({r.id for r in out}) == 3
    assert out[1].id == "ro-fixed" and out[1].config.max_attempts == 3 and out[1].mode == "val"
    assert out[2].input == "as a dict"
    for r in out:
        assert r.status == "queued" and r.attempts == () and r.ended_at is None
        assert store.get_rollout(r.id) == r
    assert [r.id for r in store.query_rollouts()] == [r.id for r in out]
    with pytest.raises(NotFoundError, match="ro-missing"):
        store.get_rollout("ro-missing")
    with pytest.raises(NotFoundError, match="ro-missing"):
        store.get_attempts("ro-missing")


def test_enqueue_duplicate_ids_refused_atomically(store: Store) -> None:
    store.enqueue([NewRollout(id="ro-1")])
    before = snapshot(store)
    with pytest.raises(ConflictError, match="ro-2"):
        store.enqueue([NewRollout(id="ro-2"), NewRollout(id="ro-3"), NewRollout(id="ro-2")])
    with pytest.raises(ConflictError, match="ro-1"):
        store.enqueue([NewRollout(id="ro-4"), NewRollout(id="ro-1")])
    assert snapshot(store) == before
    assert store.enqueue([]) == []


def test_enqueue_bad_input_changes_nothing(store: Store) -> None:
    enqueue(store, 1)
    before = snapshot(store)
    with pytest.raises(InvalidInputError, match="finite"):
        store.enqueue([{"input": {"x": 1}}, {"input": {"reward": math.inf}}])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="mode"):
        store.enqueue([{"mode": "prod"}])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="lease_s"):
        store.enqueue([{"config": {"lease_s": -1}}])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="unexpected|extra|forbid|not permitted"):
        store.enqueue([{"inptu": 1}])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError):
        store.enqueue([42])  # type: ignore[list-item]
    with pytest.raises(NotFoundError, match="resources version 7"):
        store.enqueue([NewRollout(resources_version=7)])
    assert snapshot(store) == before
    with pytest.raises(ValidationError, match="finite"):
        NewRollout(input=[1.0, math.nan])


def test_claim_oldest_first_with_attempt_and_lease(store: Store) -> None:
    assert store.claim("w0") is None
    rs = enqueue(store, 3, config=RolloutConfig(lease_s=30))
    before = time.time()
    c = store.claim("w1")
    assert c is not None
    assert c.rollout.id == rs[0].id and c.rollout.status == "running"
    a = c.attempt
    assert (a.rollout_id, a.number, a.worker_id, a.status) == (rs[0].id, 1, "w1", "running")
    assert a.lease_expires_at is not None and before + 29 <= a.lease_expires_at <= time.time() + 31
    assert c.rollout.attempts == (a,)
    assert store.get_rollout(rs[0].id).attempts == (a,)
    assert store.get_attempts(rs[0].id) == [a]
    c2 = store.claim("w2")
    assert c2 is not None and c2.rollout.id == rs[1].id


def test_claim_modes_filter(store: Store) -> None:
    t = store.enqueue([NewRollout(mode="train")])[0]
    v = store.enqueue([NewRollout(mode="val")])[0]
    c = store.claim("w", modes=["val"])
    assert c is not None and c.rollout.id == v.id
    assert store.claim("w", modes=["val", "test"]) is None
    c = store.claim("w", modes=["train"])
    assert c is not None and c.rollout.id == t.id
    with pytest.raises(InvalidInputError, match="mode"):
        store.claim("w", modes=["prod"])  # type: ignore[list-item]


def test_finish_succeeded(store: Store) -> None:
    r = enqueue(store, 1)[0]
    c = store.claim("w")
    assert c is not None
    done = store.finish_attempt(r.id, 1, "succeeded")
    assert done.status == "succeeded" and done.ended_at is not None
    assert [a.status for a in done.attempts] == ["succeeded"]
    assert done.attempts[0].ended_at is not None
    assert store.get_rollout(r.id) == done
    assert store.claim("w") is None


def test_finish_failed_requeues_then_fails(store: Store) -> None:
    r = enqueue(store, 1, config=RolloutConfig(max_attempts=2))[0]
    store.claim("w")
    err = AttemptError(type="ValueError", message="boom", traceback="tb")
    after1 = store.finish_attempt(r.id, 1, "failed", error=err)
    assert after1.status == "queued" and after1.ended_at is None
    assert after1.attempts[0].status == "failed" and after1.attempts[0].error == err
    c = store.claim("w")
    assert c is not None and c.rollout.id == r.id and c.attempt.number == 2
    after2 = store.finish_attempt(r.id, 2, "failed", error={"type": "E"})  # type: ignore[arg-type]
    assert after2.status == "failed" and after2.ended_at is not None
    assert [a.status for a in after2.attempts] == ["failed", "failed"]
    assert store.claim("w") is None


def test_requeued_rollout_keeps_its_place(store: Store) -> None:
    first, second = enqueue(store, 2, config=RolloutConfig(max_attempts=3))
    store.claim("w")
    store.finish_attempt(first.id, 1, "failed")
    c = store.claim("w")
    assert c is not None and c.rollout.id == first.id and c.attempt.number == 2
    assert [a.number for a in c.rollout.attempts] == [1, 2]
    c = store.claim("w")
    assert c is not None and c.rollout.id == second.id


def test_illegal_finish_refused_without_change(store: Store) -> None:
    r = enqueue(store, 2)[0]
    store.claim("w")
    store.finish_attempt(r.id, 1, "succeeded")
    before = snapshot(store)
    with pytest.raises(ConflictError, match="succeeded"):
        store.finish_attempt(r.id, 1, "succeeded")
    with pytest.raises(ConflictError):
        store.finish_attempt(r.id, 1, "failed")
    with pytest.raises(NotFoundError, match="attempt 2"):
        store.finish_attempt(r.id, 2, "succeeded")
    with pytest.raises(NotFoundError, match="ro-nope"):
        store.finish_attempt("ro-nope", 1, "succeeded")
    with pytest.raises(InvalidInputError, match="lost"):
        store.finish_attempt(r.id, 1, "lost")
    with pytest.raises(InvalidInputError, match="attempt"):
        store.finish_attempt(r.id, 0, "succeeded")
    with pytest.raises(ConflictError):
        store.heartbeat(r.id, 1)
    with pytest.raises(NotFoundError):
        store.heartbeat("ro-nope", 1)
    assert snapshot(store) == before


def test_cancel(store: Store) -> None:
    q, running, done = enqueue(store, 3)
    store.claim("w")  # q
    store.claim("w")  # running
    store.finish_attempt(q.id, 1, "succeeded")
    store.enqueue([NewRollout(id="ro-queued")])
    c1 = store.cancel("ro-queued")
    assert c1.status == "cancelled" and c1.attempts == () and c1.ended_at is not None
    c2 = store.cancel(running.id)
    assert c2.status == "cancelled"
    assert c2.attempts[0].status == "failed" and c2.attempts[0].error is not None
    with pytest.raises(ConflictError):
        store.finish_attempt(running.id, 1, "succeeded")
    before = snapshot(store)
    with pytest.raises(ConflictError, match="succeeded"):
        store.cancel(q.id)
    with pytest.raises(ConflictError, match="cancelled"):
        store.cancel(running.id)
    with pytest.raises(NotFoundError):
        store.cancel("ro-nope")
    assert snapshot(store) == before
    # the cancelled queued rollout is never handed out; the third one is
    c = store.claim("w")
    assert c is not None and c.rollout.id == done.id
    assert store.claim("w") is None


def test_query_rollouts_filters(store: Store) -> None:
    a = store.enqueue([NewRollout(group_id="g1"), NewRollout(group_id="g1", mode="val")])
    b = store.enqueue([NewRollout(group_id="g2"), NewRollout()])
    ids = [r.id for r in a + b]
    store.claim("w")
    assert [r.id for r in store.query_rollouts()] == ids
    assert [r.id for r in store.query_rollouts(status="running")] == ids[:1]
    assert [r.id for r in store.query_rollouts(status=["queued", "running"])] == ids
    assert [r.id for r in store.query_rollouts(status="queued", group_id="g1")] == ids[1:2]
    assert [r.id for r in store.query_rollouts(mode="val")] == ids[1:2]
    assert [r.id for r in store.query_rollouts(ids=[ids[3], ids[0], "ro-unknown"])] == [ids[0], ids[3]]
    assert [r.id for r in store.query_rollouts(limit=3)] == ids[:3]
    assert store.query_rollouts(limit=0) == []
    assert [r.id for r in store.query_rollouts(offset=2)] == ids[2:]
    assert [r.id for r in store.query_rollouts(offset=1, limit=2)] == ids[1:3]
    assert [r.id for r in store.query_rollouts(status="queued", offset=1)] == ids[2:]
    assert [r.id for r in store.query_rollouts(ids=[ids[3], ids[0], ids[2]], offset=1)] == ids[2:4]
    assert store.query_rollouts(offset=len(ids)) == []
    with pytest.raises(InvalidInputError, match="offset"):
        store.query_rollouts(offset=-1)
    assert store.query_rollouts(group_id="nope") == []
    running = store.query_rollouts(status="running")[0]
    assert len(running.attempts) == 1 and running.attempts[0].status == "running"
    with pytest.raises(InvalidInputError, match="paused"):
        store.query_rollouts(status="paused")
    with pytest.raises(InvalidInputError, match="limit"):
        store.query_rollouts(limit=-1)


# ------------------------------------------------------------------------- leases and timeouts


def test_lease_expiry_requeues_then_fails(store: Store) -> None:
    r = enqueue(store, 1, config=RolloutConfig(lease_s=0.2, max_attempts=2))[0]
    c = store.claim("w")
    assert c is not None
    assert wait_until(lambda: store.get_rollout(r.id).status == "queued")
    got = store.get_rollout(r.id)
    assert got.attempts[0].status == "lost" and got.attempts[0].ended_at is not None
    with pytest.raises(ConflictError, match="lost"):
        store.heartbeat(r.id, 1)
    with pytest.raises(ConflictError, match="lost"):
        store.finish_attempt(r.id, 1, "succeeded")
    c2 = store.claim("w2")
    assert c2 is not None and c2.attempt.number == 2 and c2.attempt.worker_id == "w2"
    assert wait_until(lambda: store.get_rollout(r.id).status == "failed")
    assert [a.status for a in store.get_attempts(r.id)] == ["lost", "lost"]
    assert store.claim("w") is None


def test_heartbeats_keep_lease_alive(store: Store) -> None:
    r = enqueue(store, 1, config=RolloutConfig(lease_s=0.6))[0]
    c = store.claim("w")
    assert c is not None
    last = c.attempt.lease_expires_at
    end = time.monotonic() + 1.2
    while time.monotonic() < end:
        time.sleep(0.1)
        a = store.heartbeat(r.id, 1)
        assert a.status == "running"
        assert a.lease_expires_at is not None and last is not None and a.lease_expires_at >= last
        last = a.lease_expires_at
    assert store.get_rollout(r.id).status == "running"
    assert store.finish_attempt(r.id, 1, "succeeded").status == "succeeded"


def test_span_arrivals_extend_lease(store: Store) -> None:
    # spans every 0.1 s for 1.5x the lease; the lease is 1 s so a starved CI machine's pauses between
    # two spans (0.6 s seen at a load of 3 with PostgreSQL behind HTTP) do not expire it
    r = enqueue(store, 1, config=RolloutConfig(lease_s=1.0))[0]
    store.claim("w")
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        time.sleep(0.1)
        store.add_spans([span(r.id)])
    assert store.get_rollout(r.id).status == "running"
    assert not any(s.stale for s in store.query_spans(rollout_id=r.id))


def test_timeout_ends_attempt_timed_out(store: Store) -> None:
    r = enqueue(store, 1, config=RolloutConfig(timeout_s=0.5, lease_s=30))[0]
    store.claim("w")
    store.heartbeat(r.id, 1)
    assert wait_until(lambda: store.get_rollout(r.id).status == "failed")
    a = store.get_attempts(r.id)[0]
    assert a.status == "timed_out" and a.error is not None
    with pytest.raises(ConflictError, match="timed_out"):
        store.heartbeat(r.id, 1)


def test_blocked_claim_picks_up_expired_lease(store: Store) -> None:
    r = enqueue(store, 1, config=RolloutConfig(lease_s=0.2, max_attempts=2))[0]
    store.claim("w1")
    t0 = time.monotonic()
    c = store.claim("w2", timeout_s=10)
    assert c is not None and c.rollout.id == r.id and c.attempt.number == 2
    assert time.monotonic() - t0 < 5


# ------------------------------------------------------------------------------------------ spans


def test_spans_seq_and_query(store: Store) -> None:
    r1, r2 = enqueue(store, 2)
    store.claim("w")
    store.claim("w")
    trace = hexid(16)
    out1 = store.add_spans([span(r1.id, name="a", trace_id=trace), span(r1.id, name="b", trace_id=trace)])
    out2 = store.add_spans([span(r2.id, name="a"), span(r1.id, name="a")])
    assert [s.seq for s in out1] == [1, 2] and [s.seq for s in out2] == [1, 3]
    assert not any(s.stale for s in out1 + out2)
    stored = store.query_spans(rollout_id=r1.id)
    assert [s.seq for s in stored] == [1, 2, 3]
    assert stored[0] == out1[0]
    assert [s.name for s in store.query_spans(rollout_id=r1.id, name="a")] == ["a", "a"]
    assert [s.seq for s in store.query_spans(rollout_id=r1.id, attempt=1, limit=2)] == [1, 2]
    assert [s.span_id for s in store.query_spans(trace_id=trace)] == [s.span_id for s in out1]
    assert len(store.query_spans(name="a")) == 3
    assert store.query_spans(rollout_id=r1.id, attempt=2) == []
    assert store.query_spans(rollout_id="ro-unknown") == []
    assert store.add_spans([]) == []
    # the full span round-trips: attributes, events, status, resource
    rich = span(
        r2.id,
        attributes={"a.b": "x", "n": 3, "f": 1.5, "ok": True, "l": ["p", "q"]},
        events=({"name": "ev", "time_ns": 5, "attributes": {"x": 1}},),
        status={"code": "ERROR", "message": "bad"},
        resource={"service.name": "svc"},
        parent_id=hexid(8),
        kind="CLIENT",
    )
    stored_rich = store.add_spans([rich])[0]
    assert stored_rich.model_dump(exclude={"seq", "stale"}) == rich.model_dump(exclude={"seq", "stale"})
    assert store.query_spans(rollout_id=r2.id)[-1] == stored_rich


def test_seq_strictly_increasing_under_concurrency(store: Store) -> None:
    r = enqueue(store, 1)[0]
    store.claim("w")
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for _ in range(10):
                store.add_spans([span(r.id) for _ in range(5)])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    seqs = [s.seq for s in store.query_spans(rollout_id=r.id, attempt=1)]
    assert seqs == list(range(1, 401))


def test_stale_spans(store: Store) -> None:
    r = enqueue(store, 1, config=RolloutConfig(lease_s=0.5, max_attempts=2))[0]
    store.claim("w")
    early = store.add_spans([span(r.id), span(r.id)])
    assert not any(s.stale for s in early)
    assert wait_until(lambda: store.get_rollout(r.id).status == "queued")
    late = store.add_spans([span(r.id)])  # the lost worker is still sending
    assert late[0].stale and late[0].seq == 3
    assert all(s.stale for s in store.query_spans(rollout_id=r.id, attempt=1))
    c = store.claim("w2")
    assert c is not None and c.attempt.number == 2
    fresh = store.add_spans([span(r.id, attempt=2)])
    assert not fresh[0].stale and fresh[0].seq == 1
    assert [s.attempt for s in store.query_spans(rollout_id=r.id, include_stale=False)] == [2]
    store.finish_attempt(r.id, 2, "succeeded")
    after = store.add_spans([span(r.id, attempt=2)])  # flushed after finishing: kept, not stale
    assert not after[0].stale and after[0].seq == 2


def test_spans_bad_input_changes_nothing(store: Store) -> None:
    r = enqueue(store, 1)[0]
    store.claim("w")
    store.add_spans([span(r.id)])
    before = snapshot(store)
    with pytest.raises(NotFoundError, match="ro-unknown"):
        store.add_spans([span(r.id), span("ro-unknown")])
    with pytest.raises(NotFoundError, match="attempt 2"):
        store.add_spans([span(r.id), span(r.id, attempt=2)])
    with pytest.raises(InvalidInputError, match="trace_id"):
        store.add_spans([span_dict(r.id), span_dict(r.id, trace_id="xyz")])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="finite"):
        store.add_spans([span_dict(r.id, attributes={"reward": math.nan})])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="ends"):
        store.add_spans([span_dict(r.id, start_ns=10, end_ns=5)])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="attribute"):
        store.add_spans([span_dict(r.id, attributes={"obj": {"nested": 1}})])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="name"):
        store.add_spans([span_dict(r.id, name="")])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError):
        store.add_spans(["not a span"])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="limit"):
        store.query_spans(limit=-3)
    assert snapshot(store) == before
    with pytest.raises(ValidationError, match="finite"):
        span(r.id, attributes={"x": math.inf})


# -------------------------------------------------------------------------------------- resources


def test_resources_versions(store: Store) -> None:
    assert store.get_resources() is None
    r1 = store.add_resources({"main": LLM})
    assert r1.version == 1 and r1.llm is not None and r1.llm.model == "m"
    r2 = store.add_resources(
        {"main": {**LLM, "model": "m2"}, "p": {"type": "prompt_template", "template": "{x}"}}
    )
    assert r2.version == 2
    assert store.get_resources() == r2
    assert store.get_resources(1) == r1
    with pytest.raises(NotFoundError, match="3"):
        store.get_resources(3)
    before = snapshot(store)
    with pytest.raises(InvalidInputError, match="base_url"):
        store.add_resources({"main": {"type": "llm", "model": "m"}})
    with pytest.raises(InvalidInputError, match="finite"):
        store.add_resources({"main": {**LLM, "sampling": {"temperature": math.nan}}})
    with pytest.raises(InvalidInputError):
        store.add_resources({"x": {"type": "unknown"}})
    assert snapshot(store) == before
    assert store.add_resources({}).version == 3


def test_rollouts_record_resources_version(store: Store) -> None:
    r0 = enqueue(store, 1)[0]
    c0 = store.claim("w")
    assert c0 is not None and c0.rollout.id == r0.id
    assert c0.rollout.resources_version is None and c0.attempt.resources_version is None
    store.add_resources({"main": LLM})
    pinned = store.enqueue([NewRollout(resources_version=1)])[0]
    floating = enqueue(store, 1)[0]
    assert floating.resources_version is None
    store.add_resources({"main": LLM})
    cp = store.claim("w")
    cf = store.claim("w")
    assert cp is not None and cp.rollout.id == pinned.id
    assert cp.rollout.resources_version == 1 and cp.attempt.resources_version == 1
    assert cf is not None and cf.rollout.id == floating.id
    assert cf.rollout.resources_version == 2 and cf.attempt.resources_version == 2
    assert store.get_rollout(floating.id).resources_version == 2


# ------------------------------------------------------------------------------------- concurrency


def test_concurrent_claims_each_rollout_once(store: Store) -> None:
    rs = enqueue(store, 120)
    claimed: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            while True:
                c = store.claim(f"w{i}")
                if c is None:
                    return
                with lock:
                    claimed.append(c.rollout.id)
                store.finish_attempt(c.rollout.id, c.attempt.number, "succeeded")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(claimed) == sorted(r.id for r in rs)
    assert all(r.status == "succeeded" and len(r.attempts) == 1 for r in store.query_rollouts())


def test_blocking_claim_times_out_and_wakes_on_enqueue(store: Store) -> None:
    t0 = time.monotonic()
    assert store.claim("w", timeout_s=0.2) is None
    waited = time.monotonic() - t0
    assert 0.15 <= waited < 3

    result: list[Any] = []
    th = threading.Thread(target=lambda: result.append((store.claim("w", timeout_s=20), time.monotonic())))
    th.start()
    time.sleep(0.2)
    r = enqueue(store, 1)[0]
    enqueued_at = time.monotonic()
    th.join(timeout=20)
    assert result and result[0][0] is not None and result[0][0].rollout.id == r.id
    assert result[0][1] - enqueued_at < 2  # woken by the enqueue, not by the 20 s timeout


def test_wait_for_rollouts(store: Store) -> None:
    a, b = enqueue(store, 2)
    store.claim("w")
    store.claim("w")
    t0 = time.monotonic()
    partial = store.wait_for_rollouts([a.id, b.id], timeout_s=0.2)
    assert partial == [] and 0.15 <= time.monotonic() - t0 < 3
    store.finish_attempt(a.id, 1, "succeeded")
    got = store.wait_for_rollouts([a.id, b.id], timeout_s=0.1)
    assert [r.id for r in got] == [a.id] and got[0].attempts[0].status == "succeeded"

    def finish_later() -> None:
        time.sleep(0.2)
        store.finish_attempt(b.id, 1, "failed")

    th = threading.Thread(target=finish_later)
    th.start()
    t0 = time.monotonic()
    done = store.wait_for_rollouts([a.id, b.id], timeout_s=20)
    elapsed = time.monotonic() - t0
    th.join()
    assert {r.id: r.status for r in done} == {a.id: "succeeded", b.id: "failed"}
    assert elapsed < 5  # woken by the finish, not by the 20 s timeout
    assert store.wait_for_rollouts([], timeout_s=5) == []
    with pytest.raises(NotFoundError, match="ro-unknown"):
        store.wait_for_rollouts([a.id, "ro-unknown"], timeout_s=0)
    with pytest.raises(InvalidInputError, match="timeout"):
        store.wait_for_rollouts([a.id], timeout_s=math.nan)
    with pytest.raises(InvalidInputError, match="timeout"):
        store.claim("w", timeout_s=-1)


def test_wait_for_rollouts_sees_lease_expiry(store: Store) -> None:
    r = enqueue(store, 1, config=RolloutConfig(lease_s=0.2))[0]
    store.claim("w")
    t0 = time.monotonic()
    done = store.wait_for_rollouts([r.id], timeout_s=10)
    assert [x.status for x in done] == ["failed"] and time.monotonic() - t0 < 5
    assert done[0].attempts[0].status == "lost"


# ------------------------------------------------------------------------------------- idempotency


def test_idempotent_enqueue_and_spans(store: Store) -> None:
    first = store.enqueue([NewRollout(), NewRollout()], idempotency_key="batch-1")
    again = store.enqueue([NewRollout(), NewRollout()], idempotency_key="batch-1")
    assert [r.id for r in again] == [r.id for r in first]
    assert len(store.query_rollouts()) == 2
    store.claim("w")
    rid = first[0].id
    batch = [span(rid), span(rid)]
    s1 = store.add_spans(batch, idempotency_key="spans-1")
    s2 = store.add_spans(batch, idempotency_key="spans-1")
    assert [(s.span_id, s.seq) for s in s2] == [(s.span_id, s.seq) for s in s1]
    assert len(store.query_spans(rollout_id=rid)) == 2
    s3 = store.add_spans([span(rid)], idempotency_key="spans-2")
    assert s3[0].seq == 3
    # a key is not consumed by a refused write
    with pytest.raises(NotFoundError):
        store.add_spans([span("ro-unknown")], idempotency_key="spans-3")
    assert store.add_spans([span(rid)], idempotency_key="spans-3")[0].seq == 4


def test_idempotent_resources(store: Store) -> None:
    first = store.add_resources({"main": LLM}, idempotency_key="res-1")
    again = store.add_resources({"main": LLM}, idempotency_key="res-1")
    assert again.version == first.version == 1
    assert store.get_resources().version == 1  # type: ignore[union-attr]
    # a refused call does not consume its key
    with pytest.raises(InvalidInputError):
        store.add_resources({"x": {"type": "unknown"}}, idempotency_key="res-2")
    assert store.add_resources({}, idempotency_key="res-2").version == 2
