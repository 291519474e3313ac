"""SQLite-only guarantees: durability across SIGKILL, several processes sharing one file, reopening."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import agl.store
from agl.store.base import InvalidInputError, Store
from agl.store.sqlite import SQLiteStore
from agl.types import NewRollout, RolloutConfig, Span

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")

ROOT = Path(__file__).resolve().parents[2]


def _span(rid: str, attempt: int = 1) -> Span:
    now = time.time_ns()
    return Span(
        trace_id=os.urandom(16).hex(),
        span_id=os.urandom(8).hex(),
        name="s",
        start_ns=now,
        end_ns=now,
        rollout_id=rid,
        attempt=attempt,
    )


def _child(script: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


WRITER = """
import os, sys, time
from agl.store.sqlite import SQLiteStore
from agl.types import NewRollout, Span
store = SQLiteStore(sys.argv[1])
print("ready", flush=True)
i = 0
while True:
    i += 1
    rid = f"ro-{i}"
    store.enqueue([NewRollout(id=rid)])
    c = store.claim("w")
    now = time.time_ns()
    spans = [Span(trace_id=os.urandom(16).hex(), span_id=os.urandom(8).hex(), name="s", start_ns=now,
                  end_ns=now, rollout_id=rid, attempt=1) for _ in range(20)]
    store.add_spans(spans)
    store.finish_attempt(rid, 1, "succeeded")
    print("ack", rid, flush=True)
"""


def test_acknowledged_writes_survive_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "durable.db"
    proc = _child(WRITER, str(path))
    acked: list[str] = []
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
        while len(acked) < 150:
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else "writer died"
            acked.append(line.split()[1])
        os.kill(proc.pid, signal.SIGKILL)  # mid-stream: it is writing the next rollout right now
        proc.wait(timeout=10)
        # whatever it printed before dying was acknowledged too
        acked.extend(line.split()[1] for line in proc.stdout.read().splitlines() if line.startswith("ack"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with SQLiteStore(path) as store:
        got = {r.id: r for r in store.query_rollouts(ids=acked)}
        assert sorted(got) == sorted(acked)
        assert all(r.status == "succeeded" for r in got.values())
        for rid in acked[:: max(1, len(acked) // 20)] + acked[-3:]:
            assert [s.seq for s in store.query_spans(rollout_id=rid)] == list(range(1, 21))
        # the store still works after recovery
        store.enqueue([NewRollout(id="ro-after")])
        assert store.claim("w") is not None


CLAIMER = """
import json, sys
from agl.store.sqlite import SQLiteStore
store = SQLiteStore(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
ids = []
while True:
    c = store.claim(sys.argv[2])
    if c is None:
        break
    ids.append(c.rollout.id)
    store.finish_attempt(c.rollout.id, c.attempt.number, "succeeded")
print(json.dumps(ids), flush=True)
"""


def test_processes_sharing_a_file_claim_disjoint_rollouts(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    with SQLiteStore(path) as store:
        rollouts = store.enqueue([NewRollout() for _ in range(300)])
        procs = [_child(CLAIMER, str(path), f"p{i}") for i in range(2)]
        try:
            for p in procs:
                assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            for p in procs:  # start together
                assert p.stdin is not None
                p.stdin.write("\n")
                p.stdin.flush()
            mine: list[str] = []
            while (c := store.claim("parent")) is not None:
                mine.append(c.rollout.id)
                store.finish_attempt(c.rollout.id, c.attempt.number, "succeeded")
            results = [json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1]) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        claimed = [*mine, *results[0], *results[1]]
        assert sorted(claimed) == sorted(r.id for r in rollouts)  # every rollout exactly once
        assert all(len(r.attempts) == 1 for r in store.query_rollouts())


WAITER = """
import sys, time
from agl.store.sqlite import SQLiteStore
store = SQLiteStore(sys.argv[1])
print("ready", flush=True)
c = store.claim("waiter", timeout_s=30)
print(c.rollout.id if c else "none", time.time(), flush=True)
"""


def test_blocked_claim_wakes_on_another_process_enqueue(tmp_path: Path) -> None:
    path = tmp_path / "wake.db"
    with SQLiteStore(path) as store:
        proc = _child(WAITER, str(path))
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            time.sleep(0.5)  # the waiter is blocked and backed off to its cap by now
            store.enqueue([NewRollout(id="ro-x")])
            enqueued = time.time()
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        rid, woke = out.split()
        assert rid == "ro-x", err
        assert float(woke) - enqueued < 2.0  # the capped backoff, not the 30 s timeout


def test_two_store_objects_on_one_file_see_each_other(tmp_path: Path) -> None:
    path = tmp_path / "two.db"
    with SQLiteStore(path) as a, SQLiteStore(path) as b:
        r = a.enqueue([NewRollout(config=RolloutConfig(lease_s=0.3, max_attempts=2))])[0]
        got: list[object] = []
        th = threading.Thread(target=lambda: got.append(b.claim("b", timeout_s=20)))
        th.start()
        th.join(timeout=20)
        c = got[0]
        assert c is not None and c.rollout.id == r.id  # type: ignore[union-attr]
        a.add_spans([_span(r.id)])
        # b's lease expires; a observes it (written by b's connection) and requeues
        t0 = time.monotonic()
        while a.get_rollout(r.id).status != "queued" and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert a.get_rollout(r.id).attempts[0].status == "lost"
        assert all(s.stale for s in b.query_spans(rollout_id=r.id))
        c2 = a.claim("a")
        assert c2 is not None and c2.attempt.number == 2


def test_reopen_keeps_everything(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'reopen.db'}"
    store: Store = agl.store.open(url)
    assert isinstance(store, SQLiteStore)
    store.add_resources({"main": {"type": "llm", "base_url": "http://x/v1", "model": "m"}})
    r = store.enqueue([NewRollout(input={"q": [1, 2]}, metadata={"k": "v"})])[0]
    store.claim("w")
    store.add_spans([_span(r.id), _span(r.id)])
    before = (store.get_rollout(r.id), store.query_spans(), store.get_resources())
    store.close()
    with pytest.raises(Exception, match="closed"):
        store.get_rollout(r.id)
    store = agl.store.open(url)
    try:
        assert (store.get_rollout(r.id), store.query_spans(), store.get_resources()) == before
        assert store.add_spans([_span(r.id)])[0].seq == 3
        assert store.add_resources({}).version == 2
    finally:
        store.close()


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="synchronous"):
        SQLiteStore(tmp_path / "x.db", synchronous="OFF")
    with pytest.raises(InvalidInputError, match="path"):
        agl.store.open("sqlite://")
    with SQLiteStore(tmp_path / "full.db", synchronous="FULL") as store:
        assert store.enqueue([NewRollout()])[0].status == "queued"
