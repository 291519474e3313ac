"""The embedded default store: one SQLite file, WAL mode, shared by threads and processes.

Durability: every write is one transaction, committed before the call returns. With WAL and
``synchronous=NORMAL`` (the default) a committed transaction survives the *process* dying at any
point (SIGKILL included): its WAL frames are in the OS page cache and SQLite recovers them on the
next open. Only an OS crash or power loss can lose the last transactions; pass
``synchronous="FULL"`` to fsync the WAL on every commit when that matters more than speed.

Concurrency: one connection per store object, guarded by a lock (SQLite serialises writers anyway,
and on a 2-core machine one connection measured faster than a connection per thread). Every write
starts with ``BEGIN IMMEDIATE`` so a claim is atomic across processes too; ``busy_timeout`` makes
writers from other processes queue instead of failing.

Blocking ``claim``/``wait_for_rollouts`` sleep on a ``threading.Condition`` that every local write
notifies, so waiters in this process wake at once. Writes by other processes cannot notify us: a
waiter re-checks after a capped exponential backoff (5 ms -> 100 ms), and ``PRAGMA data_version``
(which changes only when another connection commits) tells it cheaply whether anything changed.

Lease expiry and timeouts are handled lazily: every call first checks the earliest deadline of a
running attempt (cached; re-read only when another process wrote or the cached one passed) and, when
one has passed, ends those attempts in a write transaction before doing its own work.

Layout, chosen for few pages written per transaction (each written page is a WAL frame, and frames
are what a commit costs):
- ``rollouts``: one row per rollout; its attempts are a small JSON array in the row, so claim and
  finish each rewrite one row. A partial index holds only queued rollouts (the claim order) and
  another only running ones (their lease/timeout deadline).
- ``span_chunks``: spans are stored in the batches they arrive in, one row per (batch, rollout,
  attempt) holding a compact JSON array; ``seq`` is ``first_seq`` + position. ``span_traces`` maps
  trace ids to chunks. Queries filter by rollout/attempt/trace in SQL and by name in Python.
- A span arrival extends the lease, coalesced to at most one write per tenth of ``lease_s``.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agl.store._common import BACKOFF_MAX_S, Backoff, ChangeFeed, check_wait_args
from agl.store._group import GroupCommit
from agl.store._rows import (
    _ID,
    _INF,
    _N,
    _PINNED,
    _ROLLOUT_COLS,
    End,
    Start,
    _dumps,
    _loads,
    _rollout,
    expiry,
)
from agl.store._sql import SQLITE, SqlStore, chunks
from agl.store.base import ConflictError, InvalidInputError, NotFoundError, StoreError
from agl.types import Claim, Rollout

__all__ = ["SQLiteStore"]

_CHUNK = 500  # ids per IN (...) clause, well under SQLite's variable limit

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    n INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    mode TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS rollouts (
    n INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    task_id TEXT,
    input TEXT,
    mode TEXT NOT NULL,
    group_id TEXT,
    resources_version INTEGER,
    status TEXT NOT NULL,
    timeout_s REAL,
    lease_s REAL NOT NULL,
    max_attempts INTEGER NOT NULL,
    metadata TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    ended_at REAL,
    n_attempts INTEGER NOT NULL DEFAULT 0,
    pinned_version INTEGER,
    attempts TEXT NOT NULL DEFAULT '[]',
    timeout_at REAL,
    deadline REAL
);
CREATE INDEX IF NOT EXISTS rollouts_queued ON rollouts (n) WHERE status = 'queued';
CREATE INDEX IF NOT EXISTS rollouts_deadline ON rollouts (deadline) WHERE status = 'running';
CREATE INDEX IF NOT EXISTS rollouts_group ON rollouts (group_id) WHERE group_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS span_chunks (
    n INTEGER PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    first_seq INTEGER NOT NULL,
    last_seq INTEGER NOT NULL,
    stale INTEGER NOT NULL DEFAULT 0,
    body TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS span_chunks_attempt ON span_chunks (rollout_id, attempt, last_seq);
CREATE TABLE IF NOT EXISTS span_traces (
    trace_id TEXT NOT NULL,
    chunk INTEGER NOT NULL,
    PRIMARY KEY (trace_id, chunk)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS resources (
    version INTEGER PRIMARY KEY,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency (
    key TEXT PRIMARY KEY,
    result TEXT NOT NULL
) WITHOUT ROWID;
"""

_INSERT_CHUNK_SQL = "INSERT INTO span_chunks (rollout_id, attempt, first_seq, last_seq, stale, body) VALUES (?, ?, ?, ?, ?, ?)"
_INSERT_TRACE_SQL = "INSERT OR IGNORE INTO span_traces (trace_id, chunk) VALUES (?, ?)"
_TERMINAL_SQL = "('succeeded', 'failed', 'cancelled')"
_UNKNOWN = object()


class SQLiteStore(SqlStore):
    """The Store protocol on one SQLite file (WAL). Safe for many threads and several processes."""

    d = SQLITE
    #: lives in this process and answers in microseconds: the gateway may call it on its event loop
    in_process = True
    #: each write is a transaction with a commit: the gateway batches the spans of overlapping calls
    commit_per_write = True

    def __init__(
        self, path: str | os.PathLike[str], *, synchronous: str = "NORMAL", busy_timeout_s: float = 30.0
    ) -> None:
        if not isinstance(synchronous, str) or synchronous.upper() not in ("NORMAL", "FULL", "EXTRA"):
            raise InvalidInputError(f"synchronous must be NORMAL, FULL or EXTRA, got {synchronous!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(
            str(self.path), isolation_level=None, check_same_thread=False, timeout=busy_timeout_s
        )
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._group = GroupCommit(self._lock)  # the leader of a span group is the store's one writer
        self.changes = ChangeFeed()
        self._closed = False
        c = self._conn
        c.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        mode = c.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            c.close()
            raise StoreError(f"could not switch {path} to WAL mode (got {mode!r})")
        c.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        c.execute("PRAGMA temp_store = MEMORY")
        c.execute("PRAGMA cache_size = -65536")
        with self._lock, self._write():
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    c.execute(stmt)
        self._data_version = -1
        self._min_deadline = -_INF  # unknown: the first call reads it
        self._latest_version: Any = _UNKNOWN  # latest resources version, while no other process wrote
        self._maybe_queued = True  # False after a claim found the queue empty: then peek before writing
        self._dirty = False  # a write of this transaction wakes waiters once it commits

    # ------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise ConflictError("the store is closed")

    def _notify(self, topic: str = "change") -> None:
        """Wake local waiters: threads in ``claim``/``wait_for_rollouts`` and the server's async polls."""
        self._cond.notify_all()
        self.changes.notify(topic)

    def poke(self) -> float:
        """For the store server's one pump task: end expired attempts, notice other processes' writes
        (waking waiters), and say in how many seconds to poke again."""
        with self._lock:
            if self._closed:
                return _INF
            now = time.time()
            if self._others_wrote():
                self._notify()
            self._reap(now)
            return max(0.0, min(self._min_deadline - now, BACKOFF_MAX_S))

    def _write(self) -> _WriteTxn:
        """A write transaction; the caller holds ``self._lock``."""
        return _WriteTxn(self._conn)

    def _others_wrote(self) -> bool:
        dv = self._conn.execute("PRAGMA data_version").fetchone()[0]
        if dv != self._data_version:
            self._data_version = dv
            self._min_deadline = -_INF  # another process may have started or extended attempts
            self._latest_version = _UNKNOWN  # ... or published resources
            self._maybe_queued = True  # ... or enqueued
            return True
        return False

    def _due(self, now: float) -> bool:
        """Whether some running attempt's lease or timeout has passed (cheap; never writes)."""
        if self._others_wrote() or self._min_deadline <= now:  # the cache is a lower bound
            row = self._conn.execute("SELECT MIN(deadline) FROM rollouts WHERE status = 'running'").fetchone()
            self._min_deadline = _INF if row[0] is None else row[0]
        return self._min_deadline <= now

    def _reap_in_txn(self, now: float) -> None:
        """End expired attempts; the caller holds a write transaction."""
        if not self._due(now):
            return
        rows = self._conn.execute(
            f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE status = 'running' AND deadline <= ?", (now,)
        ).fetchall()
        for row in rows:
            status, err = expiry(row, now)
            self._end_attempt(self._conn, row, status, now, err)
        row = self._conn.execute("SELECT MIN(deadline) FROM rollouts WHERE status = 'running'").fetchone()
        self._min_deadline = _INF if row[0] is None else row[0]
        if rows:
            self._notify()

    def _reap(self, now: float) -> None:
        """Lazy expiry for read paths: only opens a write transaction when something is due."""
        if self._due(now):
            with self._write():
                self._reap_in_txn(now)

    def _wait(self, until: float, backoff: Backoff) -> None:
        """Sleep until a local notify, the backoff step, ``until`` or the next deadline (lock held)."""
        now = time.time()
        wake = min(until, now + backoff.next(), max(self._min_deadline, now))
        self._cond.wait(max(0.0, wake - now))
        if not self._closed and self._others_wrote():
            backoff.reset()

    def _idempotent(self, key: str) -> Any:
        row = self._conn.execute("SELECT result FROM idempotency WHERE key = ?", (key,)).fetchone()
        return None if row is None else _loads(row[0])

    # ---------------------------------------------------------------- hooks of SqlStore
    def _reading(self, reap: bool = True) -> _Reading:
        return _Reading(self, reap)

    def _writing(self, reap: bool = True) -> _Writing:
        return _Writing(self, reap)

    def _reap_in(self, c: Any, now: float) -> None:
        self._reap_in_txn(now)

    def _announce(self, c: Any, topic: str) -> None:
        self._dirty = True

    def _set_ended(self, c: Any, e: End, now: float, n: int) -> None:
        c.execute(
            "UPDATE rollouts SET status = ?, attempts = ?, updated_at = ?, ended_at = ?, deadline = NULL, "
            "timeout_at = NULL WHERE n = ?",
            (e.status, e.attempts, now, e.ended, n),
        )
        self._dirty = True

    def _key_result(self, c: Any, key: str) -> Any:
        return self._idempotent(key)

    def _save_key(self, c: Any, key: str, result: Any) -> None:
        c.execute("INSERT INTO idempotency (key, result) VALUES (?, ?)", (key, _dumps(result)))

    def _insert_chunk(self, c: Any, values: tuple[Any, ...], traces: list[str]) -> int:
        chunk: int = c.execute(_INSERT_CHUNK_SQL, values).lastrowid
        if len(traces) == 1:  # the usual case: execute costs less than executemany of one row
            c.execute(_INSERT_TRACE_SQL, (traces[0], chunk))
        else:
            c.executemany(_INSERT_TRACE_SQL, [(t, chunk) for t in traces])
        return chunk

    def _many(self, c: Any, sql: str, rows: list[tuple[Any, ...]]) -> None:
        c.executemany(sql, rows)

    def _savepoint(self, c: Any) -> _Savepoint:
        return _Savepoint(c)

    def _published(self, version: int) -> None:
        self._latest_version = version

    def _rows_by_ids(
        self, c: Any, ids: Sequence[str], extra_where: str = "", args: Sequence[Any] = ()
    ) -> list[Any]:
        rows: list[Any] = []
        for chunk in chunks(ids, _CHUNK):
            rows.extend(super()._rows_by_ids(c, chunk, extra_where, args))
        rows.sort(key=lambda r: r[_N])
        return rows

    def _first_existing(self, c: Any, ids: list[str]) -> Any:
        for chunk in chunks(ids, _CHUNK):
            hit = super()._first_existing(c, list(chunk))
            if hit is not None:
                return hit
        return None

    def _query_rows(
        self,
        c: Any,
        where: list[str],
        args: list[Any],
        id_list: list[str] | None,
        limit: int | None,
        skip: int,
    ) -> list[Any]:
        if id_list is None:
            return super()._query_rows(c, where, args, None, limit, skip)
        with _ReadTxn(c):
            rows = self._rows_by_ids(c, id_list, "".join(f" AND {w}" for w in where), args)
        return rows[skip:] if limit is None else rows[skip : skip + limit]

    # ------------------------------------------------------------- claims
    def _try_claim(self, worker_id: str | None, modes: tuple[str, ...] | None, now: float) -> Claim | None:
        c = self._conn
        where, args = "status = 'queued'", []
        if modes is not None:
            cond, args = self.d.in_list("mode", modes)
            where += f" AND {cond}"
        due = self._due(now)
        # when the queue looked empty, a read first: idle workers never take the write lock
        if (
            not due
            and not self._maybe_queued
            and c.execute(f"SELECT n FROM rollouts WHERE {where} LIMIT 1", args).fetchone() is None
        ):
            return None
        with self._write():
            if due:
                self._reap_in_txn(now)
            row = c.execute(
                f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE {where} ORDER BY n LIMIT 1", args
            ).fetchone()
            if row is None:
                self._maybe_queued = False
                return None
            self._maybe_queued = True
            version = None
            if row[_PINNED] is None:
                if self._latest_version is _UNKNOWN:
                    self._latest_version = c.execute("SELECT MAX(version) FROM resources").fetchone()[0]
                version = self._latest_version
            st = Start(row, worker_id, now, version)
            c.execute(
                "UPDATE rollouts SET status = 'running', updated_at = ?, resources_version = ?, n_attempts = ?, "
                "attempts = ?, timeout_at = ?, deadline = ? WHERE n = ?",
                (now, st.version, st.number, st.attempts, st.timeout_at, st.deadline, row[_N]),
            )
        if st.deadline < self._min_deadline:
            self._min_deadline = st.deadline
            self.changes.notify("lease")
        return st.claim

    def _claim(self, worker_id: str | None, timeout_s: float, modes: tuple[str, ...] | None) -> Claim | None:
        backoff = Backoff()
        with self._lock:
            deadline = time.time() + timeout_s
            while True:
                self._check_open()
                now = time.time()
                got = self._try_claim(worker_id, modes, now)
                if got is not None or now >= deadline:
                    return got
                self._wait(deadline, backoff)

    def wait_for_rollouts(self, ids: Sequence[str], *, timeout_s: float) -> list[Rollout]:
        timeout_s, id_list = check_wait_args(ids, timeout_s)
        if not id_list:
            return []
        backoff = Backoff()
        with self._lock:
            self._check_open()
            with _ReadTxn(self._conn):
                known = {r[_ID] for r in self._rows_by_ids(self._conn, id_list)}
            missing = [i for i in id_list if i not in known]
            if missing:
                raise NotFoundError(f"rollout {missing[0]!r} not found")
            deadline = time.time() + timeout_s
            while True:
                self._check_open()
                now = time.time()
                self._reap(now)
                done = 0
                for chunk in chunks(id_list, _CHUNK):
                    done += self._conn.execute(
                        f"SELECT COUNT(*) FROM rollouts WHERE status IN {_TERMINAL_SQL} "
                        f"AND id IN ({','.join('?' * len(chunk))})",
                        chunk,
                    ).fetchone()[0]
                if done == len(id_list) or now >= deadline:
                    with _ReadTxn(self._conn):
                        rows = self._terminal_rows(self._conn, id_list)
                    order = {rid: i for i, rid in enumerate(id_list)}
                    rows.sort(key=lambda r: order[r[_ID]])
                    return [_rollout(r) for r in rows]
                self._wait(deadline, backoff)

    # ----------------------------------------------------------- lifecycle
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._notify()
            self._conn.close()

    def __enter__(self) -> SQLiteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _WriteTxn:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on any exception, so refused calls change nothing)."""

    __slots__ = ("conn",)

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.conn.execute("COMMIT")
        elif self.conn.in_transaction:
            self.conn.execute("ROLLBACK")


class _Savepoint:
    """One ``add_spans`` call of a group: ``SAVEPOINT`` ... ``RELEASE`` (rolled back to on an exception)."""

    __slots__ = ("conn",)

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("SAVEPOINT agl_spans")
        return self.conn

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.conn.execute("ROLLBACK TO agl_spans")
        self.conn.execute("RELEASE agl_spans")


class _ReadTxn:
    """``BEGIN`` ... ``COMMIT`` around several reads so they see one snapshot (no-op inside a write)."""

    __slots__ = ("conn", "owned")

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.owned = False

    def __enter__(self) -> sqlite3.Connection:
        if not self.conn.in_transaction:
            self.conn.execute("BEGIN")
            self.owned = True
        return self.conn

    def __exit__(self, *exc: object) -> None:
        if self.owned and self.conn.in_transaction:
            self.conn.execute("COMMIT")


class _Reading:
    """``SQLiteStore._reading``: the lock, an open store, expired attempts ended (a class, not a
    generator: it runs on every read)."""

    __slots__ = ("reap", "store")

    def __init__(self, store: SQLiteStore, reap: bool) -> None:
        self.store, self.reap = store, reap

    def __enter__(self) -> sqlite3.Connection:
        st = self.store
        st._lock.acquire()
        try:
            st._check_open()
            if self.reap:
                st._reap(time.time())
        except BaseException:
            st._lock.release()
            raise
        return st._conn

    def __exit__(self, *exc: object) -> None:
        self.store._lock.release()


class _Writing:
    """``SQLiteStore._writing``: the lock and one ``BEGIN IMMEDIATE`` transaction, expired attempts
    ended first; on commit, waiters are woken if the write announced a change; any exception rolls
    back (so a refused call changes nothing) and forgets the cached latest resources version."""

    __slots__ = ("reap", "store")

    def __init__(self, store: SQLiteStore, reap: bool) -> None:
        self.store, self.reap = store, reap

    def __enter__(self) -> sqlite3.Connection:
        st = self.store
        st._lock.acquire()
        try:
            st._check_open()
            st._dirty = False
            st._conn.execute("BEGIN IMMEDIATE")
        except BaseException:
            st._lock.release()
            raise
        if self.reap:
            try:
                st._reap_in_txn(time.time())
            except BaseException as exc:
                self.__exit__(type(exc), exc, None)
                raise
        return st._conn

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        st = self.store
        try:
            if exc_type is None:
                st._conn.execute("COMMIT")
                if st._dirty:  # committed: wake the waiters
                    st._dirty = False
                    st._notify()
                return
            st._latest_version = _UNKNOWN
            if st._conn.in_transaction:
                st._conn.execute("ROLLBACK")
        except BaseException:
            st._latest_version = _UNKNOWN
            if st._conn.in_transaction:
                st._conn.execute("ROLLBACK")
            raise
        finally:
            st._lock.release()
