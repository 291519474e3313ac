"""Crash drill: SIGKILL the store server under write load, restart it on the same database, and find
every acknowledged write there exactly once (retries with idempotency keys, SQLite WAL durability).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from agl.store.http import HttpStore
from agl.store.server import ServerProcess
from agl.types import NewRollout, RolloutConfig, Span


@pytest.fixture(params=["sqlite", "postgres"])
def make_server(
    request: pytest.FixtureRequest, tmp_path: Path, pg_database_url: Callable[[], str]
) -> Callable[[], ServerProcess]:
    """A store server process (not started) over a fresh SQLite file or PostgreSQL database."""
    if request.param == "sqlite":
        return lambda: ServerProcess(tmp_path / "crash.db", log_path=tmp_path / "server.log")
    url = pg_database_url()
    return lambda: ServerProcess(store_url=url, log_path=tmp_path / "server.log")


def test_resources_retry_across_sigkill_publishes_one_version(
    make_server: Callable[[], ServerProcess],
) -> None:
    server = make_server()
    url = server.start()
    client = HttpStore(url)
    first = client.add_resources(
        {"main": {"type": "llm", "base_url": "http://127.0.0.1:1/v1", "model": "m"}}, idempotency_key="k1"
    )
    server.kill()  # the server forgets its in-memory answers; only the store's copy of the key is left
    server.start()
    again = client.add_resources(
        {"main": {"type": "llm", "base_url": "http://127.0.0.1:1/v1", "model": "m"}}, idempotency_key="k1"
    )
    assert again.version == first.version == 1 and again == first
    latest = client.get_resources()
    assert latest is not None and latest.version == 1
    assert client.add_resources({}, idempotency_key="k2").version == 2
    client.close()
    server.stop()


def test_sigkill_under_write_load_loses_no_acknowledged_write(
    make_server: Callable[[], ServerProcess],
) -> None:
    server = make_server()
    url = server.start()
    setup = HttpStore(url)
    rid = setup.enqueue([NewRollout(id="ro-target", config=RolloutConfig(lease_s=3600))])[0].id
    assert setup.claim("w") is not None

    retries: list[int] = []
    acked_spans: list[str] = []
    acked_rollouts: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    lock = threading.Lock()

    def writer(n: int) -> None:
        client = HttpStore(url, retry_timeout_s=60)
        i = 0
        try:
            while not stop.is_set():
                i += 1
                batch = [
                    Span(
                        trace_id=os.urandom(16).hex(),
                        span_id=os.urandom(8).hex(),
                        name=f"w{n}-{i}-{k}",
                        start_ns=1,
                        end_ns=2,
                        rollout_id=rid,
                        attempt=1,
                    )
                    for k in range(20)
                ]
                stored = client.add_spans(batch)
                assert [s.span_id for s in stored] == [s.span_id for s in batch]
                (new,) = client.enqueue([NewRollout(id=f"ro-w{n}-{i}")])
                with lock:
                    acked_spans.extend(s.span_id for s in stored)
                    acked_rollouts.append(new.id)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            retries.append(client.retries)
            client.close()

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()

    def acked() -> int:
        with lock:
            return len(acked_rollouts)

    try:
        for _ in range(2):
            target = acked() + 15
            deadline = time.monotonic() + 60
            while acked() < target and time.monotonic() < deadline and not errors:
                time.sleep(0.01)
            server.kill()  # mid-write: some requests are in flight
            killed_at = acked()
            time.sleep(0.2)
            server.start()
            assert server.url == url
        target = acked() + 15
        deadline = time.monotonic() + 60
        while acked() < target and time.monotonic() < deadline and not errors:
            time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(90)
    assert not errors, errors
    assert acked() > killed_at  # the writers went on through the restarts
    assert sum(retries) >= 2  # each kill cut off at least one writer mid-request or between requests

    check = HttpStore(url)
    spans = check.query_spans(rollout_id=rid)
    counts = Counter(s.span_id for s in spans)
    missing = [s for s in acked_spans if s not in counts]
    assert not missing, f"{len(missing)} acknowledged spans lost"
    assert max(counts.values()) == 1, "a retried batch was stored twice"
    assert [s.seq for s in spans] == list(range(1, len(spans) + 1))
    stored_rollouts = {r.id for r in check.query_rollouts()}
    assert set(acked_rollouts) <= stored_rollouts
    assert len(stored_rollouts) == len(set(stored_rollouts))
    check.close()
    setup.close()
    server.stop()
