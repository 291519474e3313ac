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

from agl.store._common import (
    BACKOFF_MAX_S,
    Backoff,
    ChangeFeed,
    check_attempt_number,
    check_error,
    check_finish_status,
    check_ids,
    check_limit,
    check_mode,
    check_modes,
    check_offset,
    check_statuses,
    check_timeout,
    coerce_many,
    make_resources,
)
from agl.store._rows import (
    _ID,
    _INF,
    _N,
    _PINNED,
    _ROLLOUT_COLS,
    _SPAN_CHUNK_COLS,
    _STATUS,
    End,
    SpanBatch,
    Start,
    _dumps,
    _loads,
    _rollout,
    _spans_from_chunk,
    cancelled_queued,
    expiry,
    insert_rows,
    queued,
    renew,
    running_attempt,
    spans_of,
)
from agl.store.base import ConflictError, InvalidInputError, NotFoundError, StoreError
from agl.types import (
    Attempt,
    AttemptError,
    Claim,
    Mode,
    NewRollout,
    Resource,
    Resources,
    Rollout,
    Span,
    Task,
    new_id,
)

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

_SPAN_TARGET_SQL = "SELECT n, n_attempts, lease_s, timeout_at, attempts FROM rollouts WHERE id = ?"
_LAST_SEQ_SQL = "SELECT MAX(last_seq) FROM span_chunks WHERE rollout_id = ? AND attempt = ?"
_INSERT_CHUNK_SQL = "INSERT INTO span_chunks (rollout_id, attempt, first_seq, last_seq, stale, body) VALUES (?, ?, ?, ?, ?, ?)"
_INSERT_TRACE_SQL = "INSERT OR IGNORE INTO span_traces (trace_id, chunk) VALUES (?, ?)"
_EXTEND_SQL = "UPDATE rollouts SET attempts = ?, deadline = ? WHERE n = ?"
_TERMINAL_SQL = "('succeeded', 'failed', 'cancelled')"
_UNKNOWN = object()


class SQLiteStore:
    """The Store protocol on one SQLite file (WAL). Safe for many threads and several processes."""

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
            self._end_attempt(row, status, now, err)
        row = self._conn.execute("SELECT MIN(deadline) FROM rollouts WHERE status = 'running'").fetchone()
        self._min_deadline = _INF if row[0] is None else row[0]
        if rows:
            self._notify()

    def _end_attempt(
        self,
        row: Sequence[Any],
        status: str,
        now: float,
        err: AttemptError | None,
        rollout_status: str | None = None,
    ) -> Rollout:
        """End the running attempt of ``row`` and move the rollout on; returns the rollout."""
        e = End(row, status, now, err, rollout_status)
        self._conn.execute(
            "UPDATE rollouts SET status = ?, attempts = ?, updated_at = ?, ended_at = ?, deadline = NULL, "
            "timeout_at = NULL WHERE n = ?",
            (e.status, e.attempts, now, e.ended, row[_N]),
        )
        if e.stale:
            self._conn.execute(
                "UPDATE span_chunks SET stale = 1 WHERE rollout_id = ? AND attempt = ?", (row[_ID], e.number)
            )
        return e.rollout

    def _reap(self, now: float) -> None:
        """Lazy expiry for read paths: only opens a write transaction when something is due."""
        if self._due(now):
            with self._write():
                self._reap_in_txn(now)

    def _row(self, rollout_id: str) -> Sequence[Any]:
        row = (
            self._conn.execute(f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE id = ?", (rollout_id,)).fetchone()
            if isinstance(rollout_id, str)
            else None
        )
        if row is None:
            raise NotFoundError(f"rollout {rollout_id!r} not found")
        return row

    def _rows_by_ids(self, ids: Sequence[str], extra_where: str = "", args: Sequence[Any] = ()) -> list[Any]:
        rows: list[Any] = []
        for i in range(0, len(ids), _CHUNK):
            chunk = ids[i : i + _CHUNK]
            rows.extend(
                self._conn.execute(
                    f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE id IN ({','.join('?' * len(chunk))}){extra_where}",
                    [*chunk, *args],
                ).fetchall()
            )
        rows.sort(key=lambda r: r[_N])
        return rows

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

    # ---------------------------------------------------------------- tasks
    def add_tasks(self, tasks: Sequence[Task]) -> list[Task]:
        items = coerce_many(Task, tasks, "task")
        rows = [(t.id, t.mode, t.model_dump_json()) for t in items]
        with self._lock:
            self._check_open()
            with self._write() as c:
                c.executemany(
                    "INSERT INTO tasks (id, mode, body) VALUES (?, ?, ?) "
                    "ON CONFLICT (id) DO UPDATE SET mode = excluded.mode, body = excluded.body",
                    rows,
                )
        return items

    def get_task(self, task_id: str) -> Task:
        with self._lock:
            self._check_open()
            row = self._conn.execute("SELECT body FROM tasks WHERE id = ?", (str(task_id),)).fetchone()
        if row is None:
            raise NotFoundError(f"task {task_id!r} not found")
        return Task.model_validate_json(row[0])

    def query_tasks(self, *, mode: Mode | None = None, limit: int | None = None) -> list[Task]:
        check_mode(mode)
        limit = check_limit(limit)
        q, args = "SELECT body FROM tasks", []
        if mode is not None:
            q += " WHERE mode = ?"
            args.append(mode)
        q += " ORDER BY n"
        if limit is not None:
            q += f" LIMIT {limit}"
        with self._lock:
            self._check_open()
            rows = self._conn.execute(q, args).fetchall()
        return [Task.model_validate_json(r[0]) for r in rows]

    # ------------------------------------------------------------- rollouts
    def enqueue(self, rollouts: Sequence[NewRollout], *, idempotency_key: str | None = None) -> list[Rollout]:
        items = coerce_many(NewRollout, rollouts, "rollout")
        now = time.time()
        ids = [nr.id or new_id("ro") for nr in items]
        rows = insert_rows(ids, items, now)
        with self._lock:
            self._check_open()
            with self._write() as c:
                if idempotency_key is not None:
                    prev = self._idempotent(f"enqueue:{idempotency_key}")
                    if prev is not None:
                        return [_rollout(r) for r in self._rows_by_ids(prev)]
                for i in range(0, len(ids), _CHUNK):
                    chunk = ids[i : i + _CHUNK]
                    hit = c.execute(
                        f"SELECT id FROM rollouts WHERE id IN ({','.join('?' * len(chunk))}) LIMIT 1", chunk
                    ).fetchone()
                    if hit is not None:
                        raise ConflictError(f"rollout {hit[0]!r} already exists; nothing was enqueued")
                for v in sorted({nr.resources_version for nr in items if nr.resources_version is not None}):
                    if c.execute("SELECT 1 FROM resources WHERE version = ?", (v,)).fetchone() is None:
                        raise NotFoundError(f"resources version {v} not found; nothing was enqueued")
                c.executemany(
                    "INSERT INTO rollouts (id, task_id, input, mode, group_id, pinned_version, resources_version, "
                    "status, timeout_s, lease_s, max_attempts, metadata, created_at, updated_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?)",
                    rows,
                )
                if idempotency_key is not None:
                    c.execute(
                        "INSERT INTO idempotency (key, result) VALUES (?, ?)",
                        (f"enqueue:{idempotency_key}", _dumps(ids)),
                    )
            self._notify()
        return queued(ids, items, now)

    def _try_claim(self, worker_id: str | None, modes: tuple[str, ...] | None, now: float) -> Claim | None:
        c = self._conn
        where, args = "status = 'queued'", []
        if modes is not None:
            where += f" AND mode IN ({','.join('?' * len(modes))})"
            args.extend(modes)
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

    def claim(
        self, worker_id: str, *, timeout_s: float = 0.0, modes: Sequence[Mode] | None = None
    ) -> Claim | None:
        timeout_s = check_timeout(timeout_s)
        mode_filter = check_modes(modes)
        if worker_id is not None and not isinstance(worker_id, str):
            raise InvalidInputError(f"worker_id must be a string, got {worker_id!r}")
        backoff = Backoff()
        with self._lock:
            deadline = time.time() + timeout_s
            while True:
                self._check_open()
                now = time.time()
                got = self._try_claim(worker_id, mode_filter, now)
                if got is not None or now >= deadline:
                    return got
                self._wait(deadline, backoff)

    def heartbeat(self, rollout_id: str, attempt: int) -> Attempt:
        check_attempt_number(attempt)
        with self._lock:
            self._check_open()
            now = time.time()
            with self._write() as c:
                self._reap_in_txn(now)
                row = self._row(rollout_id)
                attempts = running_attempt(row, attempt, "heartbeat")
                renewed, deadline = renew(row, attempts, attempt, now)
                c.execute(
                    "UPDATE rollouts SET attempts = ?, deadline = ? WHERE n = ?",
                    (_dumps(attempts), deadline, row[_N]),
                )
        return renewed

    def finish_attempt(
        self, rollout_id: str, attempt: int, status: str, *, error: AttemptError | None = None
    ) -> Rollout:
        check_finish_status(status)
        check_attempt_number(attempt)
        err = check_error(error)
        with self._lock:
            self._check_open()
            now = time.time()
            with self._write():
                self._reap_in_txn(now)
                row = self._row(rollout_id)
                running_attempt(row, attempt, "finish")
                rollout = self._end_attempt(row, status, now, err)
            self._notify()
        return rollout

    def cancel(self, rollout_id: str) -> Rollout:
        with self._lock:
            self._check_open()
            now = time.time()
            with self._write() as c:
                self._reap_in_txn(now)
                row = self._row(rollout_id)
                if row[_STATUS] == "running":
                    err = AttemptError(type="cancelled", message="the rollout was cancelled")
                    rollout = self._end_attempt(row, "failed", now, err, rollout_status="cancelled")
                elif row[_STATUS] == "queued":
                    c.execute(
                        "UPDATE rollouts SET status = 'cancelled', updated_at = ?, ended_at = ? WHERE n = ?",
                        (now, now, row[_N]),
                    )
                    rollout = cancelled_queued(row, now)
                else:
                    raise ConflictError(f"cannot cancel rollout {rollout_id!r}: it is already {row[_STATUS]}")
            self._notify()
        return rollout

    def get_rollout(self, rollout_id: str) -> Rollout:
        with self._lock:
            self._check_open()
            self._reap(time.time())
            row = self._row(rollout_id)
        return _rollout(row)

    def query_rollouts(
        self,
        *,
        status: str | Sequence[str] | None = None,
        mode: Mode | None = None,
        group_id: str | None = None,
        ids: Sequence[str] | None = None,
        limit: int | None = None,
        offset: int | None = None,
    ) -> list[Rollout]:
        statuses = check_statuses(status)
        check_mode(mode)
        limit = check_limit(limit)
        skip = check_offset(offset)
        id_list = None if ids is None else list(dict.fromkeys(check_ids(ids)))
        where: list[str] = []
        args: list[Any] = []
        if statuses is not None:
            where.append(f"status IN ({','.join('?' * len(statuses))})")
            args.extend(statuses)
        if mode is not None:
            where.append("mode = ?")
            args.append(mode)
        if group_id is not None:
            where.append("group_id = ?")
            args.append(group_id)
        with self._lock:
            self._check_open()
            self._reap(time.time())
            if id_list is None:
                sql = f"SELECT {_ROLLOUT_COLS} FROM rollouts"
                sql += (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY n"
                if limit is not None or skip:
                    sql += f" LIMIT {-1 if limit is None else limit}"
                if skip:
                    sql += f" OFFSET {skip}"
                rows = self._conn.execute(sql, args).fetchall()
            else:
                with _ReadTxn(self._conn):
                    rows = self._rows_by_ids(id_list, "".join(f" AND {w}" for w in where), args)
                rows = rows[skip:] if limit is None else rows[skip : skip + limit]
        return [_rollout(r) for r in rows]

    def get_attempts(self, rollout_id: str) -> list[Attempt]:
        return list(self.get_rollout(rollout_id).attempts)

    def wait_for_rollouts(self, ids: Sequence[str], *, timeout_s: float) -> list[Rollout]:
        timeout_s = check_timeout(timeout_s)
        id_list = list(dict.fromkeys(check_ids(ids)))
        if not id_list:
            return []
        backoff = Backoff()
        with self._lock:
            self._check_open()
            with _ReadTxn(self._conn):
                known = {r[_ID] for r in self._rows_by_ids(id_list)}
            missing = [i for i in id_list if i not in known]
            if missing:
                raise NotFoundError(f"rollout {missing[0]!r} not found")
            deadline = time.time() + timeout_s
            while True:
                self._check_open()
                now = time.time()
                self._reap(now)
                done = 0
                for i in range(0, len(id_list), _CHUNK):
                    chunk = id_list[i : i + _CHUNK]
                    done += self._conn.execute(
                        f"SELECT COUNT(*) FROM rollouts WHERE status IN {_TERMINAL_SQL} "
                        f"AND id IN ({','.join('?' * len(chunk))})",
                        chunk,
                    ).fetchone()[0]
                if done == len(id_list) or now >= deadline:
                    with _ReadTxn(self._conn):
                        rows = self._rows_by_ids(id_list, f" AND status IN {_TERMINAL_SQL}")
                    order = {rid: i for i, rid in enumerate(id_list)}
                    rows.sort(key=lambda r: order[r[_ID]])
                    return [_rollout(r) for r in rows]
                self._wait(deadline, backoff)

    # ---------------------------------------------------------------- spans
    def add_spans(self, spans: Sequence[Span], *, idempotency_key: str | None = None) -> list[Span]:
        items = coerce_many(Span, spans, "span")
        if not items:
            return []
        batch = SpanBatch(items)
        with self._lock:
            self._check_open()
            now = time.time()
            with self._write() as c:
                if idempotency_key is not None:
                    prev = self._idempotent(f"spans:{idempotency_key}")
                    if prev is not None:
                        return self._spans_of_chunks(prev)
                self._reap_in_txn(now)
                # every (rollout, attempt) is checked before anything is written
                targets = []
                for rid, number in batch.groups:
                    target = c.execute(_SPAN_TARGET_SQL, (rid,)).fetchone()
                    error = batch.missing(rid, number, target)
                    if error is not None:
                        raise error
                    targets.append(target)
                chunk_ns: list[int] = []
                placed: list[tuple[int, bool]] = []  # (first seq, stale) per group
                for ((rid, number), idx), target, body, traces in zip(
                    batch.groups.items(), targets, batch.bodies, batch.traces, strict=True
                ):
                    first = (c.execute(_LAST_SEQ_SQL, (rid, number)).fetchone()[0] or 0) + 1
                    stale, extend = batch.placement(target, number, now)
                    chunk = c.execute(
                        _INSERT_CHUNK_SQL, (rid, number, first, first + len(idx) - 1, stale, body)
                    ).lastrowid
                    chunk_ns.append(chunk)  # type: ignore[arg-type]
                    c.executemany(_INSERT_TRACE_SQL, [(t, chunk) for t in traces])
                    if extend is not None:  # a span arrival is a sign of life: extend the lease
                        c.execute(_EXTEND_SQL, (*extend, target[0]))
                    placed.append((first, stale))
                if idempotency_key is not None:
                    c.execute(
                        "INSERT INTO idempotency (key, result) VALUES (?, ?)",
                        (f"spans:{idempotency_key}", _dumps(chunk_ns)),
                    )
        return batch.stored(placed)

    def _spans_of_chunks(self, chunk_ns: list[int]) -> list[Span]:
        out: list[Span] = []
        for n in chunk_ns:
            row = self._conn.execute(
                f"SELECT {_SPAN_CHUNK_COLS} FROM span_chunks WHERE n = ?", (n,)
            ).fetchone()
            out.extend(_spans_from_chunk(row, None, None))
        return out

    def query_spans(
        self,
        *,
        rollout_id: str | None = None,
        attempt: int | None = None,
        name: str | None = None,
        trace_id: str | None = None,
        include_stale: bool = True,
        limit: int | None = None,
    ) -> list[Span]:
        limit = check_limit(limit)
        if attempt is not None:
            check_attempt_number(attempt)
        where: list[str] = []
        args: list[Any] = []
        if rollout_id is not None:
            where.append("rollout_id = ?")
            args.append(rollout_id)
        if attempt is not None:
            where.append("attempt = ?")
            args.append(attempt)
        if trace_id is not None:
            where.append("n IN (SELECT chunk FROM span_traces WHERE trace_id = ?)")
            args.append(trace_id)
        if not include_stale:
            where.append("stale = 0")
        sql = f"SELECT {_SPAN_CHUNK_COLS} FROM span_chunks"
        sql += (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY n"
        with self._lock:
            self._check_open()
            self._reap(time.time())
            rows = self._conn.execute(sql, args).fetchall()
        return spans_of(rows, name, trace_id, limit)

    # ------------------------------------------------------------ resources
    def add_resources(
        self, items: dict[str, Resource | dict[str, Any]], *, idempotency_key: str | None = None
    ) -> Resources:
        make_resources(1, items)  # validate before taking the write lock
        key = None if idempotency_key is None else f"resources:{idempotency_key}"
        with self._lock:
            self._check_open()
            with self._write() as c:
                if key is not None:
                    prev = self._idempotent(key)
                    if prev is not None:
                        row = c.execute("SELECT body FROM resources WHERE version = ?", (prev,)).fetchone()
                        return Resources.model_validate_json(row[0])
                latest = c.execute("SELECT MAX(version) FROM resources").fetchone()[0]
                res = make_resources((latest or 0) + 1, items)
                c.execute(
                    "INSERT INTO resources (version, body) VALUES (?, ?)",
                    (res.version, res.model_dump_json()),
                )
                if key is not None:
                    c.execute("INSERT INTO idempotency (key, result) VALUES (?, ?)", (key, str(res.version)))
            self._latest_version = res.version
        return res

    def get_resources(self, version: int | None = None) -> Resources | None:
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise InvalidInputError(f"resources version must be an integer, got {version!r}")
        with self._lock:
            self._check_open()
            if version is None:
                row = self._conn.execute(
                    "SELECT body FROM resources ORDER BY version DESC LIMIT 1"
                ).fetchone()
                return None if row is None else Resources.model_validate_json(row[0])
            row = self._conn.execute("SELECT body FROM resources WHERE version = ?", (version,)).fetchone()
        if row is None:
            raise NotFoundError(f"resources version {version} not found")
        return Resources.model_validate_json(row[0])

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
