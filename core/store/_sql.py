"""The SQL text the two SQL stores (SQLite, PostgreSQL) share, written once over a small ``Dialect``.

Both stores keep the same tables and make the same decisions (``_rows.py``); what differs is the SQL
dialect (``?`` vs ``%s``, ``IN (?, ?)`` vs ``= ANY(%s)``, ``0``/``1`` vs ``FALSE``/``TRUE``, ``LIMIT
-1``), how a call gets a connection and a transaction, and how waiters are woken (SQLite: a local
condition plus polling; PostgreSQL: ``NOTIFY``). So ``SqlStore`` holds every method whose statements
are the same in both, and a subclass supplies its connection handling through a few hooks:

- ``_reading(reap)`` / ``_writing(reap)``: a connection inside a read or write transaction, after
  ending the attempts whose lease or timeout passed (``reap``);
- ``_announce(c, topic)``: tell waiters, once the write commits, that ``queue``/``done`` changed;
- ``_set_ended(c, e, now, n)``: write an ended attempt (PostgreSQL folds its NOTIFY into the update);
- ``_key_result(c, key)`` / ``_save_key(c, key, result)``: the idempotency table;
- ``_insert_chunk(c, ...)``: one span chunk and its trace ids;
- ``_many(c, sql, rows)``: ``executemany``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from agl.store._common import (
    check_attempt_number,
    check_claim_args,
    check_finish_args,
    check_limit,
    check_mode,
    check_resources_version,
    check_rollout_query,
    check_span_query,
    coerce_many,
    make_resources,
)
from agl.store._group import GroupCommit, Ticket
from agl.store._rows import (
    _ID,
    _N,
    _ROLLOUT_COLS,
    _SPAN_CHUNK_COLS,
    _STATUS,
    End,
    SpanBatch,
    _dumps,
    _rollout,
    _spans_from_chunk,
    cancelled_queued,
    insert_rows,
    queued,
    renew,
    running_attempt,
    spans_of,
)
from agl.store.base import ConflictError, NotFoundError
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

__all__ = ["POSTGRES", "SQLITE", "Dialect", "SqlStore"]

_TERMINAL = ("succeeded", "failed", "cancelled")
_MAX_INT = 2**63  # both databases keep 64-bit integers


@dataclass(frozen=True)
class Dialect:
    """What differs in the SQL text of SQLite and PostgreSQL. Statements are written with ``?``."""

    placeholder: str
    true: str
    false: str
    #: the LIMIT that means "all rows" when only an OFFSET is wanted (None: OFFSET alone is valid)
    limit_all: str | None
    #: appended to a row read that the write after it depends on
    for_update: str
    #: one writer at a time (SQLite's ``BEGIN IMMEDIATE``): a read in the write sees every commit, so
    #: a span chunk's next seq is read along with its rollout (PostgreSQL reads it after the row lock)
    serial_writes: bool = False
    #: statements already translated (a fixed set: the store's own SQL text)
    _translated: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def q(self, sql: str) -> str:
        """``sql`` with this dialect's placeholders."""
        try:
            return self._translated[sql]
        except KeyError:
            out = sql if self.placeholder == "?" else sql.replace("?", self.placeholder)
            self._translated[sql] = out
            return out

    def in_list(self, column: str, values: Sequence[Any]) -> tuple[str, list[Any]]:
        """``column`` is one of ``values``: the condition and its arguments."""
        if self.placeholder == "?":
            return f"{column} IN ({','.join('?' * len(values))})", list(values)
        return f"{column} = ANY(%s)", [list(values)]

    def limit(self, limit: int | None, skip: int) -> str:
        """The LIMIT/OFFSET clause (empty when neither is wanted)."""
        out = ""
        if limit is not None:
            out = f" LIMIT {limit}"
        elif skip and self.limit_all is not None:
            out = f" LIMIT {self.limit_all}"
        return out + (f" OFFSET {skip}" if skip else "")


SQLITE = Dialect(placeholder="?", true="1", false="0", limit_all="-1", for_update="", serial_writes=True)
POSTGRES = Dialect(placeholder="%s", true="TRUE", false="FALSE", limit_all=None, for_update=" FOR UPDATE")

_ROW_SQL = f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE id = ?"
_INSERT_ROLLOUTS = (
    "INSERT INTO rollouts (id, task_id, input, mode, group_id, pinned_version, resources_version, status, "
    "timeout_s, lease_s, max_attempts, metadata, created_at, updated_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?)"
)

_TARGET = "SELECT n, n_attempts, lease_s, timeout_at, attempts FROM rollouts WHERE id = ?"
_LAST_SEQ = "SELECT MAX(last_seq) FROM span_chunks WHERE rollout_id = ? AND attempt = ?"
_TARGET_WITH_SEQ = (
    "SELECT n, n_attempts, lease_s, timeout_at, attempts, "
    "(SELECT MAX(last_seq) FROM span_chunks WHERE rollout_id = ? AND attempt = ?) FROM rollouts WHERE id = ?"
)


class SqlStore:
    """The Store methods both SQL stores run with the same statements (see the module docstring)."""

    d: Dialect
    _group: GroupCommit  #: ``add_spans`` group commit; each subclass makes its own in ``__init__``

    # ---------------------------------------------------------------- hooks
    def _reading(self, reap: bool = True) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def _writing(self, reap: bool = True) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def _announce(self, c: Any, topic: str) -> None:
        raise NotImplementedError

    def _set_ended(self, c: Any, e: End, now: float, n: int) -> None:
        raise NotImplementedError

    def _key_result(self, c: Any, key: str) -> Any:
        raise NotImplementedError

    def _save_key(self, c: Any, key: str, result: Any) -> None:
        raise NotImplementedError

    def _insert_chunk(self, c: Any, values: tuple[Any, ...], traces: list[str]) -> int:
        raise NotImplementedError

    def _many(self, c: Any, sql: str, rows: list[tuple[Any, ...]]) -> None:
        raise NotImplementedError

    def _published(self, version: int) -> None:
        """A resources version is being written, inside the write (SQLite caches the latest)."""

    # ---------------------------------------------------------------- rows
    def _row(self, c: Any, rollout_id: str, lock: bool = False) -> Sequence[Any]:
        row = None
        if isinstance(rollout_id, str):
            sql = self.d.q(_ROW_SQL) + self.d.for_update if lock else self.d.q(_ROW_SQL)
            row = c.execute(sql, (rollout_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"rollout {rollout_id!r} not found")
        return row

    def _rows_by_ids(
        self, c: Any, ids: Sequence[str], extra_where: str = "", args: Sequence[Any] = ()
    ) -> list[Any]:
        cond, cargs = self.d.in_list("id", ids)
        sql = f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE {cond}{extra_where} ORDER BY n"
        return list(c.execute(sql, [*cargs, *args]).fetchall())

    def _terminal_rows(self, c: Any, id_list: list[str]) -> list[Any]:
        cond, args = self.d.in_list("status", _TERMINAL)
        return self._rows_by_ids(c, id_list, f" AND {cond}", args)

    def _end_attempt(
        self,
        c: Any,
        row: Sequence[Any],
        status: str,
        now: float,
        err: AttemptError | None,
        rollout_status: str | None = None,
    ) -> Rollout:
        """End the running attempt of ``row`` and move the rollout on; returns the rollout."""
        e = End(row, status, now, err, rollout_status)
        self._set_ended(c, e, now, row[_N])
        if e.stale:
            c.execute(
                self.d.q(
                    f"UPDATE span_chunks SET stale = {self.d.true} WHERE rollout_id = ? AND attempt = ?"
                ),
                (row[_ID], e.number),
            )
        return e.rollout

    # ---------------------------------------------------------------- tasks
    def add_tasks(self, tasks: Sequence[Task]) -> list[Task]:
        items = coerce_many(Task, tasks, "task")
        rows = [(t.id, t.mode, t.model_dump_json()) for t in items]
        with self._writing(reap=False) as c:
            sql = "INSERT INTO tasks (id, mode, body) VALUES (?, ?, ?) "
            sql += "ON CONFLICT (id) DO UPDATE SET mode = excluded.mode, body = excluded.body"
            self._many(c, self.d.q(sql), rows)
        return items

    def get_task(self, task_id: str) -> Task:
        with self._reading(reap=False) as c:
            row = c.execute(self.d.q("SELECT body FROM tasks WHERE id = ?"), (str(task_id),)).fetchone()
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
        q += " ORDER BY n" + self.d.limit(limit, 0)
        with self._reading(reap=False) as c:
            rows = c.execute(self.d.q(q), args).fetchall()
        return [Task.model_validate_json(r[0]) for r in rows]

    # ------------------------------------------------------------- rollouts
    def enqueue(self, rollouts: Sequence[NewRollout], *, idempotency_key: str | None = None) -> list[Rollout]:
        items = coerce_many(NewRollout, rollouts, "rollout")
        now = time.time()
        ids = [nr.id or new_id("ro") for nr in items]
        rows = insert_rows(ids, items, now)
        key = None if idempotency_key is None else f"enqueue:{idempotency_key}"
        with self._writing(reap=False) as c:
            if key is not None:
                prev = self._key_result(c, key)
                if prev is not None:
                    return [_rollout(r) for r in self._rows_by_ids(c, prev)]
            if items:
                self._check_new(c, ids, items)
                self._insert_rollouts(c, rows)
            if key is not None:
                self._save_key(c, key, ids)
            if items:
                self._announce(c, "queue")
        return queued(ids, items, now)

    def _check_new(self, c: Any, ids: list[str], items: list[NewRollout]) -> None:
        """Refuse the batch (writing nothing) when an id exists or a pinned version does not."""
        hit = self._first_existing(c, ids)
        if hit is not None:
            raise ConflictError(f"rollout {hit[0]!r} already exists; nothing was enqueued")
        for v in sorted({nr.resources_version for nr in items if nr.resources_version is not None}):
            if c.execute(self.d.q("SELECT 1 FROM resources WHERE version = ?"), (v,)).fetchone() is None:
                raise NotFoundError(f"resources version {v} not found; nothing was enqueued")

    def _first_existing(self, c: Any, ids: list[str]) -> Any:
        cond, args = self.d.in_list("id", ids)
        return c.execute(f"SELECT id FROM rollouts WHERE {cond} LIMIT 1", args).fetchone()

    def _insert_rollouts(self, c: Any, rows: list[tuple[Any, ...]]) -> None:
        self._many(c, self.d.q(_INSERT_ROLLOUTS), rows)

    def heartbeat(self, rollout_id: str, attempt: int) -> Attempt:
        check_attempt_number(attempt)
        now = time.time()
        with self._writing() as c:
            row = self._row(c, rollout_id, lock=True)
            attempts = running_attempt(row, attempt, "heartbeat")
            renewed, deadline = renew(row, attempts, attempt, now)
            c.execute(
                self.d.q("UPDATE rollouts SET attempts = ?, deadline = ? WHERE n = ?"),
                (_dumps(attempts), deadline, row[_N]),
            )
        return renewed

    def claim(
        self, worker_id: str, *, timeout_s: float = 0.0, modes: Sequence[Mode] | None = None
    ) -> Claim | None:
        timeout, mode_filter = check_claim_args(worker_id, timeout_s, modes)
        return self._claim(worker_id, timeout, mode_filter)

    def _claim(self, worker_id: str | None, timeout_s: float, modes: tuple[str, ...] | None) -> Claim | None:
        """Claim the oldest queued rollout, waiting up to ``timeout_s`` for one (the store's wake-up)."""
        raise NotImplementedError

    def finish_attempt(
        self, rollout_id: str, attempt: int, status: str, *, error: AttemptError | None = None
    ) -> Rollout:
        err = check_finish_args(attempt, status, error)
        now = time.time()
        with self._writing() as c:
            row = self._row(c, rollout_id, lock=True)
            running_attempt(row, attempt, "finish")
            return self._end_attempt(c, row, status, now, err)

    def cancel(self, rollout_id: str) -> Rollout:
        now = time.time()
        with self._writing() as c:
            row = self._row(c, rollout_id, lock=True)
            if row[_STATUS] == "running":
                err = AttemptError(type="cancelled", message="the rollout was cancelled")
                return self._end_attempt(c, row, "failed", now, err, rollout_status="cancelled")
            if row[_STATUS] == "queued":
                c.execute(
                    self.d.q(
                        "UPDATE rollouts SET status = 'cancelled', updated_at = ?, ended_at = ? WHERE n = ?"
                    ),
                    (now, now, row[_N]),
                )
                self._announce(c, "done")
                return cancelled_queued(row, now)
            raise ConflictError(f"cannot cancel rollout {rollout_id!r}: it is already {row[_STATUS]}")

    def get_rollout(self, rollout_id: str) -> Rollout:
        with self._reading() as c:
            row = self._row(c, rollout_id)
        return _rollout(row)

    def get_attempts(self, rollout_id: str) -> list[Attempt]:
        return list(self.get_rollout(rollout_id).attempts)

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
        statuses, limit, skip, id_list = check_rollout_query(status, mode, limit, offset, ids)
        where: list[str] = []
        args: list[Any] = []
        if statuses is not None:
            cond, cargs = self.d.in_list("status", statuses)
            where.append(cond)
            args.extend(cargs)
        for column, value in (("mode", mode), ("group_id", group_id)):
            if value is not None:
                where.append(self.d.q(f"{column} = ?"))
                args.append(value)
        with self._reading() as c:
            rows = self._query_rows(c, where, args, id_list, limit, skip)
        return [_rollout(r) for r in rows]

    def _query_rows(
        self,
        c: Any,
        where: list[str],
        args: list[Any],
        id_list: list[str] | None,
        limit: int | None,
        skip: int,
    ) -> list[Any]:
        """The rollout rows matching ``where`` (and ``id_list``), in order, one page of them."""
        if id_list is not None:
            cond, cargs = self.d.in_list("id", id_list)
            where, args = [*where, cond], [*args, *cargs]
        sql = f"SELECT {_ROLLOUT_COLS} FROM rollouts"
        sql += (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY n" + self.d.limit(limit, skip)
        return list(c.execute(sql, args).fetchall())

    # ---------------------------------------------------------------- spans
    def _add_spans(self, c: Any, batch: SpanBatch, now: float) -> tuple[list[int], list[tuple[int, bool]]]:
        """Store ``batch`` inside the caller's write: (chunk row ids, (first seq, stale) per group)."""
        targets = {}
        serial = self.d.serial_writes
        # check every (rollout, attempt) before writing anything; lock the rollouts in id order
        for rid, number in sorted(batch.groups):
            target = c.execute(
                self.d.q(_TARGET_WITH_SEQ if serial else _TARGET) + self.d.for_update,
                (rid, number, rid) if serial else (rid,),
            ).fetchone()
            error = batch.missing(rid, number, target)
            if error is not None:
                raise error
            targets[(rid, number)] = target
        chunk_ns: list[int] = []
        placed: list[tuple[int, bool]] = []
        last_seq = self.d.q(_LAST_SEQ)
        for ((rid, number), idx), body, traces in zip(
            batch.groups.items(), batch.bodies, batch.traces, strict=True
        ):
            target = targets[(rid, number)]
            last = target[5] if serial else c.execute(last_seq, (rid, number)).fetchone()[0]
            first = (last or 0) + 1
            stale, extend = batch.placement(target[:5], number, now)
            chunk_ns.append(
                self._insert_chunk(c, (rid, number, first, first + len(idx) - 1, stale, body), traces)
            )
            if extend is not None:  # a span arrival is a sign of life: extend the lease
                c.execute(
                    self.d.q("UPDATE rollouts SET attempts = ?, deadline = ? WHERE n = ?"),
                    (*extend, target[0]),
                )
            placed.append((first, stale))
        return chunk_ns, placed

    def add_spans(self, spans: Sequence[Span], *, idempotency_key: str | None = None) -> list[Span]:
        """Concurrent calls are group-committed (``agl.store._group``): one transaction for all the
        calls that queued while the previous one was writing; each returns once its rows committed."""
        items = coerce_many(Span, spans, "span")
        if not items:
            with self._reading(reap=False):  # a closed store still refuses
                return []
        key = None if idempotency_key is None else f"spans:{idempotency_key}"
        ticket = Ticket(SpanBatch(items), key)
        lock_all = None if self.d.serial_writes else self._lock_rollouts
        return self._group.run(ticket, self._spans_txn, self._store_ticket, self._savepoint, lock_all)

    def _lock_rollouts(self, c: Any, tickets: list[Ticket]) -> None:
        """Row-lock every rollout a group of calls writes to, in id order, before any of them writes:
        each call locks its own in id order, but calls after one another in a group would not."""
        for rid in sorted({rid for t in tickets for rid, _ in t.batch.groups}):
            c.execute(self.d.q("SELECT n FROM rollouts WHERE id = ?") + self.d.for_update, (rid,)).fetchone()

    def _spans_txn(self) -> AbstractContextManager[Any]:
        """The write transaction of one group of ``add_spans`` calls, expired attempts ended first."""
        return _Reaped(self, self._writing(reap=False))

    def _store_ticket(self, c: Any, t: Ticket) -> None:
        """One ``add_spans`` call's batch, inside the group's transaction; its answer is built later,
        outside the store's lock."""
        if t.key is not None:
            prev = self._key_result(c, t.key)
            if prev is not None:
                spans = self._spans_of_chunks(c, prev)
                t.answer = lambda: spans
                return
        chunk_ns, placed = self._add_spans(c, t.batch, time.time())
        if t.key is not None:
            self._save_key(c, t.key, chunk_ns)
        t.answer = functools.partial(t.batch.stored, placed)

    def _savepoint(self, c: Any) -> AbstractContextManager[Any]:
        """A savepoint for one call of a group (released, or rolled back on an exception)."""
        raise NotImplementedError

    def _reap_in(self, c: Any, now: float) -> None:
        """End expired attempts inside the caller's write transaction."""
        raise NotImplementedError

    def _spans_of_chunks(self, c: Any, chunk_ns: list[int]) -> list[Span]:
        cond, args = self.d.in_list("n", chunk_ns)
        rows = c.execute(f"SELECT {_SPAN_CHUNK_COLS} FROM span_chunks WHERE {cond}", args).fetchall()
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
        limit = check_span_query(attempt, limit)
        where: list[str] = []
        args: list[Any] = []
        for cond, value in (
            ("rollout_id = ?", rollout_id),
            ("attempt = ?", attempt),
            ("n IN (SELECT chunk FROM span_traces WHERE trace_id = ?)", trace_id),
        ):
            if value is not None:
                where.append(self.d.q(cond))
                args.append(value)
        if not include_stale:
            where.append(f"stale = {self.d.false}")
        sql = f"SELECT {_SPAN_CHUNK_COLS} FROM span_chunks"
        sql += (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY n"
        with self._reading() as c:
            rows = c.execute(sql, args).fetchall()
        return spans_of(rows, name, trace_id, limit)

    # ------------------------------------------------------------ resources
    def add_resources(
        self, items: dict[str, Resource | dict[str, Any]], *, idempotency_key: str | None = None
    ) -> Resources:
        make_resources(1, items)  # validate before touching the database
        key = None if idempotency_key is None else f"resources:{idempotency_key}"
        with self._writing(reap=False) as c:
            if key is not None:
                prev = self._key_result(c, key)
                if prev is not None:
                    body = c.execute(
                        self.d.q("SELECT body FROM resources WHERE version = ?"), (prev,)
                    ).fetchone()
                    return Resources.model_validate_json(body[0])
            self._serialise_versions(c)
            latest = c.execute("SELECT MAX(version) FROM resources").fetchone()[0]
            res = make_resources((latest or 0) + 1, items)
            c.execute(
                self.d.q("INSERT INTO resources (version, body) VALUES (?, ?)"),
                (res.version, res.model_dump_json()),
            )
            if key is not None:
                self._save_key(c, key, res.version)
            self._published(res.version)
        return res

    def _serialise_versions(self, c: Any) -> None:
        """Make concurrent ``add_resources`` take versions one at a time (SQLite's write lock does)."""

    def get_resources(self, version: int | None = None) -> Resources | None:
        check_resources_version(version)
        if version is not None and not -_MAX_INT <= version < _MAX_INT:
            raise NotFoundError(f"resources version {version} not found")
        with self._reading(reap=False) as c:
            if version is None:
                row = c.execute("SELECT body FROM resources ORDER BY version DESC LIMIT 1").fetchone()
                return None if row is None else Resources.model_validate_json(row[0])
            row = c.execute(self.d.q("SELECT body FROM resources WHERE version = ?"), (version,)).fetchone()
        if row is None:
            raise NotFoundError(f"resources version {version} not found")
        return Resources.model_validate_json(row[0])


class _Reaped:
    """A write transaction that first ends the attempts whose lease or timeout passed."""

    __slots__ = ("inner", "store")

    def __init__(self, store: SqlStore, inner: AbstractContextManager[Any]) -> None:
        self.store, self.inner = store, inner

    def __enter__(self) -> Any:
        c = self.inner.__enter__()
        try:
            self.store._reap_in(c, time.time())
        except BaseException as exc:
            if not self.inner.__exit__(type(exc), exc, exc.__traceback__):
                raise
        return c

    def __exit__(self, *exc: Any) -> Any:
        return self.inner.__exit__(*exc)


def chunks(ids: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    """``ids`` in slices of at most ``size`` (SQLite caps the variables of one statement)."""
    for i in range(0, len(ids), size):
        yield ids[i : i + size]
