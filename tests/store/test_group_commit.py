"""Group commit of ``add_spans`` in the SQL stores (``agl.store._group``): concurrent calls share one
transaction, each caller returns only once its rows are committed, one caller's bad input fails that
caller only, and a failed transaction fails every caller of it with nothing of it stored."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conformance import span
from conftest import drop_pg_database, new_pg_database

from agl.store.base import NotFoundError
from agl.types import NewRollout

N = 12


@contextlib.contextmanager
def _sqlite(tmp_path: Path) -> Iterator[tuple[Any, Callable[[], Any]]]:
    from agl.store.sqlite import SQLiteStore

    path = tmp_path / "spans.db"
    store = SQLiteStore(path)
    try:
        yield store, lambda: SQLiteStore(path)  # a second connection: sees only committed rows
    finally:
        store.close()


@contextlib.contextmanager
def _postgres(tmp_path: Path) -> Iterator[tuple[Any, Callable[[], Any]]]:
    from agl.store.postgres import PostgresStore

    server, name, url = new_pg_database()
    store = PostgresStore(url)
    try:
        yield store, lambda: PostgresStore(url, pool_size=1)
    finally:
        store.close()
        drop_pg_database(server, name)


@pytest.fixture(params=["sqlite", "postgres"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Any, Callable[[], Any]]]:
    with {"sqlite": _sqlite, "postgres": _postgres}[request.param](tmp_path) as pair:
        yield pair


def _rollouts(store: Any, n: int) -> list[str]:
    ids = [r.id for r in store.enqueue([NewRollout() for _ in range(n)])]
    for _ in ids:
        assert store.claim("w") is not None
    return ids


def _queued_group(store: Any, calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` in threads while the group's leader lock is held, so all of them queue, then let
    them go: the first to get the lock writes them all in one transaction. Each thread's outcome
    (its return value or the exception it raised)."""
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - the outcome under test
            out[i] = exc

    group = store._group
    with group.leader:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(group._queue) < len(calls):
            assert time.monotonic() < deadline, "the calls did not queue"
            time.sleep(0.001)
    for t in threads:
        t.join(10)
    return out


def test_concurrent_calls_share_one_transaction_and_are_stored_when_they_return(stores: Any) -> None:
    store, reopen = stores
    rids = _rollouts(store, N)
    other = reopen()  # a reader on its own connection: a returned call's rows must be committed
    seen: dict[str, int] = {}

    def call(rid: str) -> Callable[[], Any]:
        def go() -> Any:
            got = store.add_spans([span(rid), span(rid)])
            # right after this call returned, another connection reads its rows
            seen[rid] = len(other.query_spans(rollout_id=rid))
            return got

        return go

    groups, calls = store._group.groups, store._group.calls
    try:
        results = _queued_group(store, [call(r) for r in rids])
    finally:
        other.close()
    assert store._group.groups == groups + 1  # one transaction ...
    assert store._group.calls == calls + N  # ... for every call
    for rid, res in zip(rids, results, strict=True):
        assert not isinstance(res, BaseException), res
        assert [s.seq for s in res] == [1, 2] and all(s.rollout_id == rid for s in res)
        assert seen[rid] == 2
        assert [s.span_id for s in store.query_spans(rollout_id=rid)] == [s.span_id for s in res]


def test_one_callers_bad_input_fails_that_caller_only(stores: Any) -> None:
    store, _ = stores
    rids = _rollouts(store, N)
    bad = span("ro-does-not-exist")
    calls = [(lambda r=r: store.add_spans([span(r)])) for r in rids]
    calls.insert(N // 2, lambda: store.add_spans([span(rids[0]), bad]))  # half known: nothing of it
    results = _queued_group(store, calls)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], NotFoundError)
    assert isinstance(results[N // 2], NotFoundError)
    assert len(store.query_spans(rollout_id=rids[0])) == 1  # the failed call's known span is not there
    for rid in rids[1:]:
        assert len(store.query_spans(rollout_id=rid)) == 1


def test_a_failed_transaction_fails_every_caller_and_leaves_nothing(
    stores: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = stores
    rids = _rollouts(store, N)
    real = type(store)._add_spans
    boom = RuntimeError("the database refused a statement")

    def add_spans(self: Any, c: Any, batch: Any, now: float) -> Any:
        out = real(self, c, batch, now)  # rows written inside the transaction ...
        if batch.items[0].rollout_id == rids[-1]:
            raise boom  # ... then the last call's statement fails: not a caller's input error
        return out

    monkeypatch.setattr(type(store), "_add_spans", add_spans)
    results = _queued_group(store, [(lambda r=r: store.add_spans([span(r)])) for r in rids])
    monkeypatch.undo()
    assert all(r is boom for r in results)
    assert store.query_spans() == []  # the whole group rolled back
    assert len(store.add_spans([span(rids[0])])) == 1  # and the store still works


def test_one_caller_alone_pays_no_savepoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _sqlite(tmp_path) as (store, _):
        (rid,) = _rollouts(store, 1)
        statements: list[str] = []
        store._conn.set_trace_callback(statements.append)
        store.add_spans([span(rid)])
        store._conn.set_trace_callback(None)
        assert not any("SAVEPOINT" in s for s in statements)
        assert statements[0].startswith("BEGIN IMMEDIATE") and statements[-1] == "COMMIT"


def test_sqlite_refused_write_fails_the_group(tmp_path: Path) -> None:
    """A write the database refuses (here: the connection made read-only) fails every caller."""
    with _sqlite(tmp_path) as (store, _):
        rids = _rollouts(store, 3)
        store._conn.execute("PRAGMA query_only = ON")
        try:
            results = _queued_group(store, [(lambda r=r: store.add_spans([span(r)])) for r in rids])
        finally:
            store._conn.execute("PRAGMA query_only = OFF")
        assert all(isinstance(r, sqlite3.Error) for r in results), results
        assert store.query_spans() == []


def test_postgres_group_locks_its_rollouts_in_one_order(tmp_path: Path) -> None:
    """Each call locks its rollouts in id order, but a group of calls must too (else two groups could
    lock the same rows in opposite orders and deadlock): the group locks them all first, sorted."""
    with _postgres(tmp_path) as (store, _):
        rids = _rollouts(store, 4)
        locked: list[str] = []
        real = store._lock_rollouts

        def recording(c: Any, tickets: list[Any]) -> None:
            locked.extend(rid for t in tickets for rid, _ in t.batch.groups)
            real(c, tickets)

        store._lock_rollouts = recording
        results = _queued_group(store, [(lambda r=r: store.add_spans([span(r)])) for r in reversed(rids)])
        assert not any(isinstance(r, BaseException) for r in results)
        assert sorted(locked) == sorted(rids)
        assert all(len(store.query_spans(rollout_id=r)) == 1 for r in rids)
