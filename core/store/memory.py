"""In-process store: tests, single-process experiments, and the reference for the other stores.

One lock guards everything; a ``threading.Condition`` on that lock wakes blocked ``claim`` and
``wait_for_rollouts`` callers on every state change. Lease expiry and timeouts are handled lazily: a
heap of attempt deadlines is drained at the start of every call (and by blocked callers when the
nearest deadline passes), so no background thread is needed and nothing is observed stale.

Returned models share nested dicts (input, metadata, attributes) with the stored ones: treat them as
read-only.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agl.store._common import (
    ChangeFeed,
    check_attempt_number,
    check_claim_args,
    check_finish_args,
    check_limit,
    check_mode,
    check_resources_version,
    check_rollout_query,
    check_span_query,
    check_wait_args,
    coerce_many,
    make_resources,
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

__all__ = ["MemoryStore"]

_STALE_ENDINGS = frozenset({"lost", "timed_out"})


@dataclass
class _Rec:
    rollout: Rollout  # without attempts
    order: int
    pinned_version: int | None
    attempts: list[Attempt] = field(default_factory=list)
    timeout_at: dict[int, float] = field(default_factory=dict)

    def public(self) -> Rollout:
        return self.rollout.model_copy(update={"attempts": tuple(self.attempts)})


class MemoryStore:
    """The whole Store protocol in memory, thread-safe."""

    #: lives in this process and answers in microseconds: the gateway may call it on its event loop
    in_process = True

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self.changes = ChangeFeed()
        self._tasks: dict[str, Task] = {}
        self._recs: dict[str, _Rec] = {}
        self._order = 0
        self._queues: dict[str, list[tuple[int, str]]] = {"train": [], "val": [], "test": []}
        self._deadlines: list[tuple[float, str, int]] = []
        self._spans: list[Span] = []
        self._span_idx: dict[tuple[str, int], list[int]] = {}
        self._next_seq: dict[tuple[str, int], int] = {}
        self._trace_idx: dict[str, list[int]] = {}
        self._resources: list[Resources] = []
        self._idem: dict[tuple[str, str], Any] = {}
        self._closed = False

    # ------------------------------------------------------------ internals
    def _notify(self, topic: str = "change") -> None:
        """Wake local waiters: threads in ``claim``/``wait_for_rollouts`` and the server's async polls."""
        self._cond.notify_all()
        self.changes.notify(topic)

    def poke(self) -> float:
        """For the store server's pump task: end expired attempts; seconds until the next deadline."""
        with self._lock:
            if self._closed:
                return float("inf")
            now = time.time()
            self._reap(now)
            nd = self._next_deadline()
            return float("inf") if nd is None else max(0.0, nd - now)

    def _check_open(self) -> None:
        if self._closed:
            raise ConflictError("the store is closed")

    def _rec(self, rollout_id: str) -> _Rec:
        rec = self._recs.get(rollout_id) if isinstance(rollout_id, str) else None
        if rec is None:
            raise NotFoundError(f"rollout {rollout_id!r} not found")
        return rec

    def _reap(self, now: float) -> None:
        """End every attempt whose lease or timeout has passed (lazily, on each call)."""
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, rid, n = heapq.heappop(heap)
            rec = self._recs[rid]
            att = rec.attempts[n - 1]
            if att.status != "running":
                continue
            timeout_at = rec.timeout_at.get(n)
            if timeout_at is not None and timeout_at <= now:
                self._end_attempt(
                    rec,
                    n,
                    "timed_out",
                    now,
                    AttemptError(type="timeout", message="the rollout ran past timeout_s"),
                )
            elif att.lease_expires_at is not None and att.lease_expires_at <= now:
                self._end_attempt(
                    rec,
                    n,
                    "lost",
                    now,
                    AttemptError(type="lease_expired", message="no heartbeat before the lease expired"),
                )
            else:
                heapq.heappush(heap, (self._deadline(rec, att), rid, n))

    def _deadline(self, rec: _Rec, att: Attempt) -> float:
        lease = att.lease_expires_at if att.lease_expires_at is not None else float("inf")
        return min(lease, rec.timeout_at.get(att.number, float("inf")))

    def _next_deadline(self) -> float | None:
        return self._deadlines[0][0] if self._deadlines else None

    def _end_attempt(self, rec: _Rec, n: int, status: str, now: float, error: AttemptError | None) -> None:
        att = rec.attempts[n - 1]
        rec.attempts[n - 1] = att.model_copy(
            update={"status": status, "ended_at": now, "error": error, "lease_expires_at": None}
        )
        rec.timeout_at.pop(n, None)
        r = rec.rollout
        if status in _STALE_ENDINGS:
            self._mark_stale(r.id, n)
        if status == "succeeded":
            rec.rollout = r.model_copy(update={"status": "succeeded", "updated_at": now, "ended_at": now})
        elif len(rec.attempts) < r.config.max_attempts:
            rec.rollout = r.model_copy(update={"status": "queued", "updated_at": now})
            heapq.heappush(self._queues[r.mode], (rec.order, r.id))
        else:
            rec.rollout = r.model_copy(update={"status": "failed", "updated_at": now, "ended_at": now})
        self._notify()

    def _mark_stale(self, rid: str, n: int) -> None:
        spans = self._spans
        for i in self._span_idx.get((rid, n), ()):
            if not spans[i].stale:
                spans[i] = spans[i].model_copy(update={"stale": True})

    def _pop_queued(self, modes: tuple[str, ...] | None) -> _Rec | None:
        best: list[tuple[int, str]] | None = None
        for mode in modes if modes is not None else self._queues:
            q = self._queues[mode]
            while q and self._recs[q[0][1]].rollout.status != "queued":
                heapq.heappop(q)  # cancelled while queued
            if q and (best is None or q[0] < best[0]):
                best = q
        if best is None:
            return None
        _, rid = heapq.heappop(best)
        return self._recs[rid]

    def _start_attempt(self, rec: _Rec, worker_id: str | None, now: float) -> Claim:
        r = rec.rollout
        version = rec.pinned_version
        if version is None and self._resources:
            version = self._resources[-1].version
        n = len(rec.attempts) + 1
        att = Attempt.model_construct(
            rollout_id=r.id,
            number=n,
            worker_id=worker_id,
            status="running",
            resources_version=version,
            started_at=now,
            last_heartbeat=now,
            lease_expires_at=now + r.config.lease_s,
            ended_at=None,
            error=None,
        )
        rec.attempts.append(att)
        if r.config.timeout_s is not None:
            rec.timeout_at[n] = now + r.config.timeout_s
        rec.rollout = r.model_copy(
            update={"status": "running", "updated_at": now, "resources_version": version}
        )
        heapq.heappush(self._deadlines, (self._deadline(rec, att), r.id, n))
        self.changes.notify("lease")
        return Claim.model_construct(rollout=rec.public(), attempt=att)

    def _wait(self, until: float) -> None:
        """Sleep on the condition until notified, ``until`` or the next lease deadline."""
        now = time.time()
        wake = until
        nd = self._next_deadline()
        if nd is not None and nd < wake:
            wake = nd
        self._cond.wait(max(0.0, wake - now) + 0.0005)

    # ---------------------------------------------------------------- tasks
    def add_tasks(self, tasks: Sequence[Task]) -> list[Task]:
        items = coerce_many(Task, tasks, "task")
        with self._lock:
            self._check_open()
            for t in items:
                self._tasks[t.id] = t
        return items

    def get_task(self, task_id: str) -> Task:
        with self._lock:
            task = self._tasks.get(task_id) if isinstance(task_id, str) else None
            if task is None:
                raise NotFoundError(f"task {task_id!r} not found")
            return task

    def query_tasks(self, *, mode: Mode | None = None, limit: int | None = None) -> list[Task]:
        check_mode(mode)
        limit = check_limit(limit)
        with self._lock:
            out = [t for t in self._tasks.values() if mode is None or t.mode == mode]
        return out if limit is None else out[:limit]

    # ------------------------------------------------------------- rollouts
    def enqueue(self, rollouts: Sequence[NewRollout], *, idempotency_key: str | None = None) -> list[Rollout]:
        items = coerce_many(NewRollout, rollouts, "rollout")
        with self._lock:
            self._check_open()
            if idempotency_key is not None:
                prev = self._idem.get(("enqueue", idempotency_key))
                if prev is not None:
                    return [self._recs[rid].public() for rid in prev]
            now = time.time()
            seen: set[str] = set()
            ids: list[str] = []
            for nr in items:
                rid = nr.id or new_id("ro")
                if rid in self._recs or rid in seen:
                    raise ConflictError(f"rollout {rid!r} already exists; nothing was enqueued")
                if nr.resources_version is not None and not any(
                    r.version == nr.resources_version for r in self._resources
                ):
                    raise NotFoundError(
                        f"resources version {nr.resources_version} not found (rollout {rid!r}); nothing was enqueued"
                    )
                seen.add(rid)
                ids.append(rid)
            out = []
            for rid, nr in zip(ids, items, strict=True):
                r = Rollout(
                    id=rid,
                    task_id=nr.task_id,
                    input=nr.input,
                    mode=nr.mode,
                    group_id=nr.group_id,
                    resources_version=nr.resources_version,
                    status="queued",
                    config=nr.config,
                    metadata=nr.metadata,
                    created_at=now,
                    updated_at=now,
                )
                self._order += 1
                self._recs[rid] = _Rec(rollout=r, order=self._order, pinned_version=nr.resources_version)
                heapq.heappush(self._queues[r.mode], (self._order, rid))
                out.append(r)
            if idempotency_key is not None:
                self._idem[("enqueue", idempotency_key)] = ids
            self._notify()
            return out

    def claim(
        self, worker_id: str, *, timeout_s: float = 0.0, modes: Sequence[Mode] | None = None
    ) -> Claim | None:
        timeout_s, mode_filter = check_claim_args(worker_id, timeout_s, modes)
        with self._lock:
            deadline = time.time() + timeout_s
            while True:
                self._check_open()
                now = time.time()
                self._reap(now)
                rec = self._pop_queued(mode_filter)
                if rec is not None:
                    return self._start_attempt(rec, worker_id, now)
                if now >= deadline:
                    return None
                self._wait(deadline)

    def heartbeat(self, rollout_id: str, attempt: int) -> Attempt:
        check_attempt_number(attempt)
        with self._lock:
            now = time.time()
            self._reap(now)
            rec = self._rec(rollout_id)
            att = self._attempt(rec, attempt)
            if att.status != "running":
                raise ConflictError(f"attempt {attempt} of rollout {rollout_id!r} already ended {att.status}")
            att = att.model_copy(
                update={"last_heartbeat": now, "lease_expires_at": now + rec.rollout.config.lease_s}
            )
            rec.attempts[attempt - 1] = att
            return att

    def _attempt(self, rec: _Rec, attempt: int) -> Attempt:
        if not 1 <= attempt <= len(rec.attempts):
            raise NotFoundError(f"attempt {attempt} of rollout {rec.rollout.id!r} not found")
        return rec.attempts[attempt - 1]

    def finish_attempt(
        self, rollout_id: str, attempt: int, status: str, *, error: AttemptError | None = None
    ) -> Rollout:
        err = check_finish_args(attempt, status, error)
        with self._lock:
            self._check_open()
            now = time.time()
            self._reap(now)
            rec = self._rec(rollout_id)
            att = self._attempt(rec, attempt)
            if att.status != "running":
                raise ConflictError(
                    f"cannot finish attempt {attempt} of rollout {rollout_id!r}: it already ended {att.status} "
                    f"(rollout is {rec.rollout.status})"
                )
            self._end_attempt(rec, attempt, status, now, err)
            return rec.public()

    def cancel(self, rollout_id: str) -> Rollout:
        with self._lock:
            self._check_open()
            now = time.time()
            self._reap(now)
            rec = self._rec(rollout_id)
            r = rec.rollout
            if r.status not in ("queued", "running"):
                raise ConflictError(f"cannot cancel rollout {rollout_id!r}: it is already {r.status}")
            if r.status == "running":
                n = len(rec.attempts)
                rec.attempts[n - 1] = rec.attempts[n - 1].model_copy(
                    update={
                        "status": "failed",
                        "ended_at": now,
                        "lease_expires_at": None,
                        "error": AttemptError(type="cancelled", message="the rollout was cancelled"),
                    }
                )
                rec.timeout_at.pop(n, None)
            rec.rollout = r.model_copy(update={"status": "cancelled", "updated_at": now, "ended_at": now})
            self._notify()
            return rec.public()

    def get_rollout(self, rollout_id: str) -> Rollout:
        with self._lock:
            self._reap(time.time())
            return self._rec(rollout_id).public()

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
        with self._lock:
            self._reap(time.time())
            if id_list is not None:
                recs = sorted({r.order: r for i in id_list if (r := self._recs.get(i)) is not None}.items())
                candidates = [r for _, r in recs]
            else:
                candidates = list(self._recs.values())
            out: list[Rollout] = []
            if limit == 0:
                return out
            for rec in candidates:
                r = rec.rollout
                if statuses is not None and r.status not in statuses:
                    continue
                if mode is not None and r.mode != mode:
                    continue
                if group_id is not None and r.group_id != group_id:
                    continue
                if skip:
                    skip -= 1
                    continue
                out.append(rec.public())
                if limit is not None and len(out) >= limit:
                    break
            return out

    def get_attempts(self, rollout_id: str) -> list[Attempt]:
        with self._lock:
            self._reap(time.time())
            return list(self._rec(rollout_id).attempts)

    def wait_for_rollouts(self, ids: Sequence[str], *, timeout_s: float) -> list[Rollout]:
        timeout_s, id_list = check_wait_args(ids, timeout_s)
        with self._lock:
            for rid in id_list:
                self._rec(rid)
            deadline = time.time() + timeout_s
            while True:
                self._check_open()  # closing the store wakes and ends every waiter
                now = time.time()
                self._reap(now)
                done = [rec.public() for rid in id_list if (rec := self._recs[rid]).rollout.done]
                if len(done) == len(id_list) or now >= deadline:
                    return done
                self._wait(deadline)

    # ---------------------------------------------------------------- spans
    def add_spans(self, spans: Sequence[Span], *, idempotency_key: str | None = None) -> list[Span]:
        items = coerce_many(Span, spans, "span")
        with self._lock:
            self._check_open()
            if idempotency_key is not None:
                prev = self._idem.get(("spans", idempotency_key))
                if prev is not None:
                    return [self._spans[i] for i in prev]
            now = time.time()
            self._reap(now)
            # validate every span's rollout/attempt before storing any of them
            stale_of: dict[tuple[str, int], bool] = {}
            for s in items:
                key = (s.rollout_id, s.attempt)
                if key not in stale_of:
                    rec = self._recs.get(s.rollout_id)
                    if rec is None:
                        raise NotFoundError(
                            f"span {s.span_id}: rollout {s.rollout_id!r} not found; no span was stored"
                        )
                    if not 1 <= s.attempt <= len(rec.attempts):
                        raise NotFoundError(
                            f"span {s.span_id}: attempt {s.attempt} of rollout {s.rollout_id!r} not found; "
                            "no span was stored"
                        )
                    stale_of[key] = rec.attempts[s.attempt - 1].status in _STALE_ENDINGS
            for rid, n in stale_of:
                rec = self._recs[rid]
                att = rec.attempts[n - 1]
                if att.status == "running":  # a span arrival is a sign of life
                    rec.attempts[n - 1] = att.model_copy(
                        update={"lease_expires_at": now + rec.rollout.config.lease_s}
                    )
            out: list[Span] = []
            positions: list[int] = []
            base = len(self._spans)
            for s in items:
                key = (s.rollout_id, s.attempt)
                seq = self._next_seq.get(key, 0) + 1
                self._next_seq[key] = seq
                stored = s.model_copy(update={"seq": seq, "stale": stale_of[key]})
                pos = base + len(out)
                self._spans.append(stored)
                self._span_idx.setdefault(key, []).append(pos)
                self._trace_idx.setdefault(s.trace_id, []).append(pos)
                out.append(stored)
                positions.append(pos)
            if idempotency_key is not None:
                self._idem[("spans", idempotency_key)] = positions
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
        with self._lock:
            self._reap(time.time())
            spans = self._spans
            if rollout_id is not None and attempt is not None:
                candidates = [spans[i] for i in self._span_idx.get((rollout_id, attempt), ())]
            elif trace_id is not None:
                candidates = [spans[i] for i in self._trace_idx.get(trace_id, ())]
            elif rollout_id is not None:
                rec = self._recs.get(rollout_id)
                idx = (
                    sorted(
                        i
                        for n in range(1, len(rec.attempts) + 1)
                        for i in self._span_idx.get((rollout_id, n), ())
                    )
                    if rec is not None
                    else []
                )
                candidates = [spans[i] for i in idx]
            else:
                candidates = spans
            out: list[Span] = []
            if limit == 0:
                return out
            for s in candidates:
                if rollout_id is not None and s.rollout_id != rollout_id:
                    continue
                if attempt is not None and s.attempt != attempt:
                    continue
                if name is not None and s.name != name:
                    continue
                if trace_id is not None and s.trace_id != trace_id:
                    continue
                if not include_stale and s.stale:
                    continue
                out.append(s)
                if limit is not None and len(out) >= limit:
                    break
            return out

    # ------------------------------------------------------------ resources
    def add_resources(
        self, items: dict[str, Resource | dict[str, Any]], *, idempotency_key: str | None = None
    ) -> Resources:
        with self._lock:
            self._check_open()
            if idempotency_key is not None:
                prev = self._idem.get(("resources", idempotency_key))
                if prev is not None:
                    return self._resources[prev - 1]
            version = self._resources[-1].version + 1 if self._resources else 1
            res = make_resources(version, items)
            self._resources.append(res)
            if idempotency_key is not None:
                self._idem[("resources", idempotency_key)] = version
            return res

    def get_resources(self, version: int | None = None) -> Resources | None:
        with self._lock:
            if version is None:
                return self._resources[-1] if self._resources else None
            check_resources_version(version)
            if 1 <= version <= len(self._resources):
                return self._resources[version - 1]
            raise NotFoundError(f"resources version {version} not found")

    # ----------------------------------------------------------- lifecycle
    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._notify()

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
