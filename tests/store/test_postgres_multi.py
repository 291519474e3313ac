"""Several store servers on one PostgreSQL database: claims stay exclusive across servers, and a
long-poll on one server wakes on another server's writes (LISTEN/NOTIFY), also after a server dies."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agl.store.http import HttpStore
from agl.store.server import ServerProcess
from agl.types import NewRollout, RolloutConfig


@pytest.fixture
def two_servers(tmp_path: Path, pg_database_url: Callable[[], str]) -> Iterator[list[ServerProcess]]:
    url = pg_database_url()
    servers = [ServerProcess(store_url=url, log_path=tmp_path / f"server{i}.log") for i in range(2)]
    for s in servers:
        s.start()
    yield servers
    for s in servers:
        s.stop()


def test_concurrent_claims_across_two_servers_each_rollout_once(two_servers: list[ServerProcess]) -> None:
    a, b = (HttpStore(s.url or "") for s in two_servers)
    ids = [r.id for r in a.enqueue([NewRollout() for _ in range(120)])]
    claimed: list[str] = []
    lock = threading.Lock()

    def runner(k: int) -> None:
        store = HttpStore(two_servers[k % 2].url or "")
        while True:
            c = store.claim(f"w{k}")
            if c is None:
                break
            with lock:
                claimed.append(c.rollout.id)
            store.finish_attempt(c.rollout.id, c.attempt.number, "succeeded")
        store.close()

    threads = [threading.Thread(target=runner, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    counts = Counter(claimed)
    assert sorted(counts) == sorted(ids) and max(counts.values()) == 1
    assert {r.status for r in b.query_rollouts()} == {"succeeded"}
    a.close()
    b.close()


def test_long_polls_wake_on_the_other_servers_writes(two_servers: list[ServerProcess]) -> None:
    a, b = (HttpStore(s.url or "") for s in two_servers)
    got: list[object] = []
    t0 = time.monotonic()
    waiter = threading.Thread(target=lambda: got.append(a.claim("w", timeout_s=20)))
    waiter.start()
    time.sleep(0.5)  # the claim is parked on server A
    (r,) = b.enqueue([NewRollout(config=RolloutConfig(lease_s=3600))])
    waiter.join(30)
    assert got and got[0] is not None and time.monotonic() - t0 < 10
    done: list[list[object]] = []
    t1 = time.monotonic()
    waiter = threading.Thread(target=lambda: done.append(a.wait_for_rollouts([r.id], timeout_s=20)))  # type: ignore[arg-type]
    waiter.start()
    time.sleep(0.5)
    b.finish_attempt(r.id, 1, "succeeded")
    waiter.join(30)
    assert done and len(done[0]) == 1 and time.monotonic() - t1 < 10
    a.close()
    b.close()


def test_a_dead_servers_expired_lease_is_ended_by_the_other(two_servers: list[ServerProcess]) -> None:
    a, b = (HttpStore(s.url or "", retry_timeout_s=1) for s in two_servers)
    (r,) = b.enqueue([NewRollout(config=RolloutConfig(lease_s=1.0, max_attempts=1))])
    assert b.claim("w") is not None
    two_servers[1].kill()  # the server that made the claim is gone; its runner never heartbeats
    t0 = time.monotonic()
    (done,) = a.wait_for_rollouts([r.id], timeout_s=20)
    assert done.status == "failed" and done.attempts[0].status == "lost"
    assert time.monotonic() - t0 < 10
    a.close()
    b.close()
