"""What the SQL stores (SQLite, PostgreSQL) share: the row layout and its codecs, and every state
transition of a rollout as a pure function of its row.

Both stores keep the same tables (``rollouts`` with the attempts as a JSON array, ``span_chunks``,
``span_traces``, ``resources``, ``idempotency``); they differ in SQL dialect, locking and how they
wake waiters. So the decisions (what a claim writes, when an attempt's end requeues or fails its
rollout, which spans are stale, how a batch of spans is grouped into chunks) are made here once, and
each store only runs its own statements with the values these functions return.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agl.store.base import ConflictError, InvalidInputError, NotFoundError
from agl.types import (
    Attempt,
    AttemptError,
    Claim,
    NewRollout,
    Rollout,
    RolloutConfig,
    Span,
    SpanEvent,
    SpanStatus,
    _construct,
)

try:  # orjson is optional: several times faster on span attributes
    import orjson

    def _dumps(value: Any) -> str:
        try:
            return orjson.dumps(value).decode()
        except TypeError:  # e.g. ints beyond 64 bits: the stdlib handles them
            return _std_dumps(value)

    _loads = orjson.loads
except ImportError:  # pragma: no cover - exercised in envs without orjson

    def _dumps(value: Any) -> str:
        return _std_dumps(value)

    _loads = json.loads

# column positions in _ROLLOUT_COLS
_N, _ID, _TASK, _INPUT, _MODE, _GROUP, _VERSION, _STATUS, _TIMEOUT_S, _LEASE_S, _MAX = range(11)
_META, _CREATED, _UPDATED, _ENDED, _N_ATT, _PINNED, _ATTEMPTS, _TIMEOUT_AT = range(11, 19)
_ROLLOUT_COLS = (
    "n, id, task_id, input, mode, group_id, resources_version, status, timeout_s, lease_s, max_attempts, "
    "metadata, created_at, updated_at, ended_at, n_attempts, pinned_version, attempts, timeout_at"
)
_SPAN_CHUNK_COLS = "n, rollout_id, attempt, first_seq, stale, body"
_STALE_ENDINGS = ("lost", "timed_out")
_INF = float("inf")
_DEFAULT_STATUS = SpanStatus()
#: a span arrival rewrites the lease only when it would move by more than this fraction of lease_s
_LEASE_COALESCE = 0.1


def _std_dumps(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"value is not JSON-serialisable: {exc}") from None


def _attempt(rollout_id: str, d: dict[str, Any]) -> Attempt:
    err = d["error"]
    return _construct(
        Attempt,
        {
            "rollout_id": rollout_id,
            "number": d["number"],
            "worker_id": d["worker_id"],
            "status": d["status"],
            "resources_version": d["resources_version"],
            "started_at": d["started_at"],
            "last_heartbeat": d["last_heartbeat"],
            "lease_expires_at": d["lease_expires_at"],
            "ended_at": d["ended_at"],
            "error": None if err is None else _construct(AttemptError, dict(err)),
        },
    )


def _error_dict(err: AttemptError | None) -> dict[str, Any] | None:
    return None if err is None else {"type": err.type, "message": err.message, "traceback": err.traceback}


def _rollout(row: Sequence[Any], attempts: list[dict[str, Any]] | None = None) -> Rollout:
    rid = row[_ID]
    atts = _loads(row[_ATTEMPTS]) if attempts is None else attempts
    return _construct(
        Rollout,
        {
            "id": rid,
            "task_id": row[_TASK],
            "input": None if row[_INPUT] is None else _loads(row[_INPUT]),
            "mode": row[_MODE],
            "group_id": row[_GROUP],
            "resources_version": row[_VERSION],
            "status": row[_STATUS],
            "config": _construct(
                RolloutConfig,
                {"timeout_s": row[_TIMEOUT_S], "lease_s": row[_LEASE_S], "max_attempts": row[_MAX]},
            ),
            "metadata": {} if row[_META] is None else _loads(row[_META]),
            "created_at": row[_CREATED],
            "updated_at": row[_UPDATED],
            "ended_at": row[_ENDED],
            "attempts": tuple(_attempt(rid, d) for d in atts),
        },
    )


def _span_record(s: Span) -> list[Any]:
    """A span as a compact JSON array (the chunk body); rollout/attempt/seq/stale live in the row."""
    d = s.__dict__
    st = d["status"]
    events = d["events"]
    return [
        d["trace_id"],
        d["span_id"],
        d["parent_id"],
        d["name"],
        d["kind"],
        d["start_ns"],
        d["end_ns"],
        st.code,
        st.message,
        d["attributes"],
        [e.__dict__ for e in events] if events else None,
        d["resource"],
    ]


def _spans_from_chunk(row: Sequence[Any], name: str | None, trace_id: str | None) -> list[Span]:
    _, rid, attempt, first_seq, stale, body = row
    stale = bool(stale)
    out = []
    for i, rec in enumerate(_loads(body)):
        if (name is not None and rec[3] != name) or (trace_id is not None and rec[0] != trace_id):
            continue
        code, message, events = rec[7], rec[8], rec[10]
        out.append(
            _construct(
                Span,
                {
                    "trace_id": rec[0],
                    "span_id": rec[1],
                    "parent_id": rec[2],
                    "name": rec[3],
                    "kind": rec[4],
                    "start_ns": rec[5],
                    "end_ns": rec[6],
                    "status": _DEFAULT_STATUS
                    if code == "UNSET" and message is None
                    else _construct(SpanStatus, {"code": code, "message": message}),
                    "attributes": rec[9],
                    "events": ()
                    if not events
                    else tuple(
                        _construct(
                            SpanEvent,
                            {"name": e["name"], "time_ns": e["time_ns"], "attributes": e["attributes"]},
                        )
                        for e in events
                    ),
                    "resource": rec[11],
                    "rollout_id": rid,
                    "attempt": attempt,
                    "seq": first_seq + i,
                    "stale": stale,
                },
            )
        )
    return out


# ------------------------------------------------------------------------------- state transitions


def insert_rows(ids: Sequence[str], items: Sequence[NewRollout], now: float) -> list[tuple[Any, ...]]:
    """The ``rollouts`` rows of an enqueue (columns: id, task_id, input, mode, group_id, pinned_version,
    resources_version, timeout_s, lease_s, max_attempts, metadata, created_at, updated_at); refuses a
    batch that names one id twice."""
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = next(i for i in ids if i in seen or seen.add(i))  # type: ignore[func-returns-value]
        raise ConflictError(f"rollout {dup!r} appears twice in the batch; nothing was enqueued")
    rows = []
    for rid, nr in zip(ids, items, strict=True):
        cfg = nr.config
        rows.append(
            (
                rid,
                nr.task_id,
                None if nr.input is None else _dumps(nr.input),
                nr.mode,
                nr.group_id,
                nr.resources_version,
                nr.resources_version,
                cfg.timeout_s,
                cfg.lease_s,
                cfg.max_attempts,
                _dumps(nr.metadata) if nr.metadata else None,
                now,
                now,
            )
        )
    return rows


def queued(ids: Sequence[str], items: Sequence[NewRollout], now: float) -> list[Rollout]:
    """The rollouts an enqueue just stored, without reading them back."""
    return [
        _construct(
            Rollout,
            {
                "id": rid,
                "task_id": nr.task_id,
                "input": nr.input,
                "mode": nr.mode,
                "group_id": nr.group_id,
                "resources_version": nr.resources_version,
                "status": "queued",
                "config": nr.config,
                "metadata": nr.metadata,
                "created_at": now,
                "updated_at": now,
                "ended_at": None,
                "attempts": (),
            },
        )
        for rid, nr in zip(ids, items, strict=True)
    ]


class Start:
    """A claim's new attempt of ``row``: the values its UPDATE writes (``version``, ``number``,
    ``attempts`` as JSON, ``timeout_at``, ``deadline``) and the ``claim`` to return."""

    __slots__ = ("attempts", "claim", "deadline", "number", "timeout_at", "version")

    def __init__(
        self, row: Sequence[Any], worker_id: str | None, now: float, latest_version: int | None
    ) -> None:
        version = row[_PINNED] if row[_PINNED] is not None else latest_version
        number = row[_N_ATT] + 1
        lease = now + row[_LEASE_S]
        timeout_at = None if row[_TIMEOUT_S] is None else now + row[_TIMEOUT_S]
        attempts = _loads(row[_ATTEMPTS])
        attempts.append(
            {
                "number": number,
                "worker_id": worker_id,
                "status": "running",
                "resources_version": version,
                "started_at": now,
                "last_heartbeat": now,
                "lease_expires_at": lease,
                "ended_at": None,
                "error": None,
            }
        )
        r = list(row)
        r[_VERSION], r[_STATUS], r[_UPDATED] = version, "running", now
        rollout = _rollout(r, attempts)
        self.version, self.number, self.timeout_at = version, number, timeout_at
        self.deadline = lease if timeout_at is None else min(lease, timeout_at)
        self.attempts = _dumps(attempts)
        self.claim: Claim = _construct(Claim, {"rollout": rollout, "attempt": rollout.attempts[-1]})


def running_attempt(row: Sequence[Any], attempt: int, verb: str) -> list[dict[str, Any]]:
    """The attempts of ``row``, after checking that attempt ``attempt`` exists and is still running."""
    attempts = _loads(row[_ATTEMPTS])
    if not 1 <= attempt <= len(attempts):
        raise NotFoundError(f"attempt {attempt} of rollout {row[_ID]!r} not found")
    status = attempts[attempt - 1]["status"]
    if status != "running":
        raise ConflictError(
            f"cannot {verb} attempt {attempt} of rollout {row[_ID]!r}: it already ended {status} "
            f"(rollout is {row[_STATUS]})"
        )
    return attempts


def renew(
    row: Sequence[Any], attempts: list[dict[str, Any]], attempt: int, now: float
) -> tuple[Attempt, float]:
    """A heartbeat: the renewed attempt (changed in ``attempts``) and the rollout's new deadline."""
    cur = attempts[attempt - 1]
    lease = now + row[_LEASE_S]
    cur["last_heartbeat"], cur["lease_expires_at"] = now, lease
    deadline = lease if row[_TIMEOUT_AT] is None else min(lease, row[_TIMEOUT_AT])
    return _attempt(row[_ID], cur), deadline


def expiry(row: Sequence[Any], now: float) -> tuple[str, AttemptError]:
    """How a running attempt whose deadline passed ends: its timeout, or else its lease ran out."""
    if row[_TIMEOUT_AT] is not None and row[_TIMEOUT_AT] <= now:
        return "timed_out", AttemptError(type="timeout", message="the rollout ran past timeout_s")
    return "lost", AttemptError(type="lease_expired", message="no heartbeat before the lease expired")


class End:
    """The end of ``row``'s running attempt: the rollout's new ``status``, ``ended_at``, ``attempts``
    (JSON), whether its spans turn ``stale``, and the resulting ``rollout``. ``rollout_status``
    forces the rollout's status (cancel); otherwise success ends it and a failure requeues it while
    attempts are left."""

    __slots__ = ("attempts", "ended", "number", "rollout", "stale", "status")

    def __init__(
        self,
        row: Sequence[Any],
        status: str,
        now: float,
        err: AttemptError | None,
        rollout_status: str | None = None,
    ) -> None:
        attempts = _loads(row[_ATTEMPTS])
        cur = attempts[-1]
        cur.update(status=status, ended_at=now, error=_error_dict(err), lease_expires_at=None)
        if rollout_status is None:
            if status == "succeeded":
                rollout_status = "succeeded"
            else:
                rollout_status = "queued" if row[_N_ATT] < row[_MAX] else "failed"
        self.status = rollout_status
        self.ended = None if rollout_status == "queued" else now
        self.number: int = cur["number"]
        self.stale = status in _STALE_ENDINGS
        self.attempts = _dumps(attempts)
        new = list(row)
        new[_STATUS], new[_UPDATED], new[_ENDED], new[_TIMEOUT_AT] = rollout_status, now, self.ended, None
        self.rollout = _rollout(new, attempts)


def cancelled_queued(row: Sequence[Any], now: float) -> Rollout:
    """A queued rollout after ``cancel``."""
    new = list(row)
    new[_STATUS], new[_UPDATED], new[_ENDED] = "cancelled", now, now
    return _rollout(new)


class SpanBatch:
    """A batch of spans grouped by (rollout, attempt), one chunk row each, in arrival order:
    ``groups`` (key -> positions in the batch), each group's chunk ``bodies`` and ``traces``."""

    __slots__ = ("bodies", "groups", "items", "traces")

    def __init__(self, items: list[Span]) -> None:
        self.items = items
        groups: dict[tuple[str, int], list[int]] = {}
        if items:
            d0 = items[0].__dict__
            key0 = (d0["rollout_id"], d0["attempt"])
            if all(s.__dict__["rollout_id"] == key0[0] and s.__dict__["attempt"] == key0[1] for s in items):
                groups[key0] = list(range(len(items)))
            else:
                for i, s in enumerate(items):
                    groups.setdefault((s.__dict__["rollout_id"], s.__dict__["attempt"]), []).append(i)
        self.groups = groups
        self.bodies = [_dumps([_span_record(items[i]) for i in idx]) for idx in groups.values()]
        self.traces = [sorted({items[i].__dict__["trace_id"] for i in idx}) for idx in groups.values()]

    def missing(self, rid: str, number: int, target: Sequence[Any] | None) -> NotFoundError | None:
        """The error when (rid, number) has no rollout or attempt; ``target`` is its
        ``(n, n_attempts, lease_s, timeout_at, attempts)`` row or None."""
        if target is not None and 1 <= number <= target[1]:
            return None
        what = f"rollout {rid!r}" if target is None else f"attempt {number} of rollout {rid!r}"
        sid = self.items[self.groups[(rid, number)][0]].span_id
        return NotFoundError(f"span {sid}: {what} not found; no span was stored")

    @staticmethod
    def placement(target: Sequence[Any], number: int, now: float) -> tuple[bool, tuple[str, float] | None]:
        """Whether spans of attempt ``number`` arrive stale (it ended lost or timed out), and the
        lease extension a span arrival is worth (``(attempts JSON, deadline)``, or None: coalesced to
        one write per tenth of ``lease_s``)."""
        _, _, lease_s, timeout_at, attempts_json = target
        attempts = _loads(attempts_json)
        cur = attempts[number - 1]
        if cur["status"] != "running":
            return cur["status"] in _STALE_ENDINGS, None
        if now - (cur["lease_expires_at"] - lease_s) <= lease_s * _LEASE_COALESCE:
            return False, None
        cur["lease_expires_at"] = lease = now + lease_s
        return False, (_dumps(attempts), lease if timeout_at is None else min(lease, timeout_at))

    def stored(self, placed: Sequence[tuple[int, bool]]) -> list[Span]:
        """The batch as stored, given each group's (first seq, stale)."""
        out: list[Any] = [None] * len(self.items)
        for idx, (first, stale) in zip(self.groups.values(), placed, strict=True):
            for k, i in enumerate(idx):
                d = dict(self.items[i].__dict__)
                d["seq"] = first + k
                d["stale"] = stale
                out[i] = _construct(Span, d)
        return out


def spans_of(
    rows: Sequence[Sequence[Any]], name: str | None, trace_id: str | None, limit: int | None
) -> list[Span]:
    """Spans of ``span_chunks`` rows (in order), filtered by name and trace, at most ``limit``."""
    out: list[Span] = []
    if limit == 0:
        return out
    for row in rows:
        out.extend(_spans_from_chunk(row, name, trace_id))
        if limit is not None and len(out) >= limit:
            return out[:limit]
    return out
