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

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from agl.store._common import ChangeFeed, check_wait_args
from agl.store._group import GroupCommit
from agl.store._local_postgres import LocalPostgres, find_postgres_bin  # re-exported: tests, bench
from agl.store._rows import _ID, _INF, _N, _ROLLOUT_COLS, End, Start, _dumps, _loads, _rollout, expiry
from agl.store._sql import POSTGRES, SqlStore
from agl.store.base import ConflictError, InvalidInputError, NotFoundError, StoreError
from agl.types import Claim, Rollout

__all__ = ["LocalPostgres", "PostgresStore", "find_postgres_bin"]

#: The NOTIFY channel. Topics: ``queue`` (something became claimable), ``done`` (a rollout ended),
#: ``lease`` (a running deadline appeared or moved earlier: waiters re-read the earliest).
CHANNEL = "agl_store"
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


class PostgresStore(SqlStore):
    """The Store protocol on PostgreSQL. Safe for many threads, processes and hosts at once."""

    d = POSTGRES

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
        self._group = GroupCommit()  # add_spans calls that overlap share one transaction (one commit)
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

    def _reap_now(self) -> None:
        with self._txn() as c:
            self._reap(c, time.time())

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

    # ---------------------------------------------------------------- hooks of SqlStore
    @contextmanager
    def _reading(self, reap: bool = True) -> Iterator[Any]:
        if not reap:
            with self._conn() as c:
                yield c
            return
        with self._txn() as c:
            self._reap(c, time.time())
            yield c

    @contextmanager
    def _writing(self, reap: bool = True) -> Iterator[Any]:
        with self._txn() as c:
            if reap:
                self._reap(c, time.time())
            yield c

    def _reap_in(self, c: Any, now: float) -> None:
        self._reap(c, now)

    def _announce(self, c: Any, topic: str) -> None:
        c.execute("SELECT pg_notify(%s, %s)", (CHANNEL, topic))

    def _set_ended(self, c: Any, e: End, now: float, n: int) -> None:
        c.execute(
            "WITH u AS (UPDATE rollouts SET status = %s, attempts = %s, updated_at = %s, ended_at = %s, "
            "deadline = NULL, timeout_at = NULL WHERE n = %s RETURNING 1) SELECT pg_notify(%s, %s) FROM u",
            (e.status, e.attempts, now, e.ended, n, CHANNEL, "queue" if e.ended is None else "done"),
        )

    def _key_result(self, c: Any, key: str) -> Any:
        return self._claim_key(c, key)

    def _save_key(self, c: Any, key: str, result: Any) -> None:
        self._store_key(c, key, result)

    def _insert_chunk(self, c: Any, values: tuple[Any, ...], traces: list[str]) -> int:
        return int(
            c.execute(
                "WITH c AS (INSERT INTO span_chunks (rollout_id, attempt, first_seq, last_seq, stale, body) "
                "VALUES (%s, %s, %s, %s, %s, %s) RETURNING n), "
                "t AS (INSERT INTO span_traces (trace_id, chunk) SELECT x, c.n FROM c, unnest(%s::text[]) AS x "
                "ON CONFLICT DO NOTHING) SELECT n FROM c",
                (*values, traces),
            ).fetchone()[0]
        )

    def _savepoint(self, c: Any) -> Any:
        return c.transaction()  # nested in the group's transaction: a SAVEPOINT

    def _many(self, c: Any, sql: str, rows: list[tuple[Any, ...]]) -> None:
        if rows:
            with c.cursor() as cur:
                cur.executemany(sql, rows)

    def _insert_rollouts(self, c: Any, rows: list[tuple[Any, ...]]) -> None:
        try:
            super()._insert_rollouts(c, rows)
        except self._errors.UniqueViolation:  # enqueued concurrently by another caller
            raise ConflictError("a rollout id of the batch already exists; nothing was enqueued") from None

    def _serialise_versions(self, c: Any) -> None:
        c.execute("SELECT pg_advisory_xact_lock(%s)", (_RESOURCES_LOCK,))

    # ------------------------------------------------------------- claims
    def _try_claim(self, worker_id: str | None, modes: tuple[str, ...] | None) -> Claim | None:
        where, args = "status = 'queued'", []
        if modes is not None:
            cond, args = self.d.in_list("mode", modes)
            where += f" AND {cond}"
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
                (now, st.version, st.number, st.attempts, st.timeout_at, st.deadline, got[_N])
                + (CHANNEL, f"lease:{st.deadline!r}"),
            )
        self._lower_deadline(st.deadline)
        return st.claim

    def _claim(self, worker_id: str | None, timeout_s: float, modes: tuple[str, ...] | None) -> Claim | None:
        deadline = time.time() + timeout_s
        while True:
            generation = self._generation
            got = self._try_claim(worker_id, modes)
            if got is not None or time.time() >= deadline:
                return got
            self._wait(generation, deadline)

    def wait_for_rollouts(self, ids: Sequence[str], *, timeout_s: float) -> list[Rollout]:
        timeout_s, id_list = check_wait_args(ids, timeout_s)
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
            with self._reading() as c:
                rows = self._terminal_rows(c, id_list)
            if len(rows) == len(id_list) or time.time() >= deadline:
                order = {rid: i for i, rid in enumerate(id_list)}
                rows.sort(key=lambda r: order[r[_ID]])
                return [_rollout(r) for r in rows]
            self._wait(generation, deadline)

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
