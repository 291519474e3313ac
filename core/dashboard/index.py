"""The dashboard's view of a store's rollouts: a summary index, filtered and paged server-side.

The Store protocol lists rollouts (oldest first, with filters on status/mode/group) but has no
offset, count or "changed since" query, and rewards live in spans, not on the rollout. So the
dashboard keeps one summary row per rollout in memory (about 200 bytes each: 100k rollouts are
~20 MB) and answers every page, filter and count from it, never from the browser:

- The first load counts the rollouts (``query_rollouts(offset=k, limit=1)`` probes) and reads the
  newest ``chunk`` (5000); older ones are added a chunk at a time in the background, so the first page
  of a 100k-rollout store answers at once (it says how far indexing got).
- Then the index follows the store incrementally in a background thread: each round reads the
  rollouts added since (``offset`` = the end of what it knows; rollouts are only ever appended, in
  store order) and re-reads those that were still queued or running (terminal ones never change). It
  runs only while someone looks (a page request or a long-poll waiter in the last ``idle_s`` seconds),
  at most every ``max(min_interval_s, 2 x the last round's duration)``. A store without ``offset`` is
  read whole each round. Page requests never wait for a round (except the very first).
- ``version`` goes up whenever a round sees a change; browsers long-poll :meth:`wait_for_change`
  (held up to ~25 s, woken at once on a change), so the page updates live without timers.
- The failure kind of a terminal rollout (infra, agent, task, no_reward: what the trainer does with
  it, :mod:`agl.adapter.failures`) is read for the rows of the page shown, once each.
- The reward of a terminal rollout (the final primary ``agl.reward`` of its finishing attempt, the
  value the adapter uses) is read from that attempt's reward spans once and cached: the rows on the
  page shown and up to ``reward_fetch_budget`` per reward-filtered request at once, the rest newest
  first in the background. A reward filter leaves out rollouts whose reward is not read yet, and the
  answer says how many are pending.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agl import semconv as sc
from agl.adapter import final_reward, finishing_attempt
from agl.types import TERMINAL_ROLLOUT_STATUSES, Rollout

__all__ = ["Filters", "RolloutIndex", "final_reward", "summarize"]


def _differs(old: dict[str, Any] | None, row: dict[str, Any]) -> bool:
    return (
        old is None
        or old["updated_at"] != row["updated_at"]
        or old["status"] != row["status"]
        or len(old["attempts"]) != len(row["attempts"])
    )


def summarize(r: Rollout) -> dict[str, Any]:
    """One table row: what the rollouts page shows and filters on."""
    last = r.attempts[-1] if r.attempts else None
    err = next((a.error for a in reversed(r.attempts) if a.error is not None), None)
    return {
        "id": r.id,
        "status": r.status,
        "mode": r.mode,
        "group_id": r.group_id,
        "task_id": r.task_id,
        "resources_version": r.resources_version,
        "step": _step_of(r),
        "created_at": r.created_at,
        "updated_at": r.updated_at,
        "ended_at": r.ended_at,
        "attempts": [a.status for a in r.attempts],
        "worker_id": last.worker_id if last is not None else None,
        "error": None if err is None else f"{err.type}: {err.message}"[:300],
        "finishing_attempt": finishing_attempt(r),
    }


def _step_of(rollout: Any) -> int | None:
    """The trainer step a rollout was enqueued at (``metadata["step"]``), if any."""
    step = (rollout.metadata or {}).get("step") if isinstance(rollout.metadata, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


@dataclass
class Filters:
    status: frozenset[str] | None = None
    mode: str | None = None
    resources_version: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    group_id: str | None = None
    search: str | None = None  # a substring of the rollout id

    @property
    def by_reward(self) -> bool:
        return self.reward_min is not None or self.reward_max is not None


@dataclass
class _State:
    rows: list[dict[str, Any]] = field(default_factory=list)
    by_id: dict[str, dict[str, Any]] = field(default_factory=dict)
    loaded_at: float = 0.0
    #: store offset of ``rows[0]``: > 0 while older rollouts are still being loaded (newest first)
    start: int = 0
    #: store offset just past the last row: where the next round's new rollouts begin
    end: int = 0


class RolloutIndex:
    """Summary rows of every rollout of ``store``, refreshed in the background while watched."""

    def __init__(
        self,
        store: Any,
        *,
        min_interval_s: float = 1.0,
        idle_s: float = 30.0,
        reward_batch: int = 2000,
        chunk: int = 5000,
        background: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.chunk = chunk
        self.reward_fetch_budget = 200
        #: False: no refresh thread (callers drive refresh/backfill themselves; for tests)
        self.background = background
        self.min_interval_s = min_interval_s
        self.idle_s = idle_s
        self.reward_batch = reward_batch
        self._clock = clock
        self._state = _State()
        self._rewards: dict[str, float | None] = {}
        #: failure kinds of terminal rollouts (agl.adapter.failures), read for the rows shown only
        self._kinds: dict[str, str | None] = {}
        self._cond = threading.Condition()
        self._refresh_lock = threading.Lock()
        self.version = 0
        self.last_cost_s = 0.0
        self.error: str | None = None
        self._waiters = 0
        self._last_wanted = 0.0
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        #: per index version: facet counts, and the rows matching each recent filter (paging is O(page))
        self._facets: dict[str, Any] | None = None
        self._matches: dict[tuple[Any, ...], list[dict[str, Any]]] = {}

    # ------------------------------------------------------------------ refresh
    def refresh(self) -> bool:
        """Catch up with the store; True when anything changed (and ``version`` went up).

        Incremental: rollouts are only ever added, in store order, and a terminal rollout never
        changes again; so one round reads the new rollouts (``offset`` = the end of what is known) and
        re-reads the ones that were still queued or running. The first round counts the rollouts and
        reads only the newest ``chunk``; :meth:`backfill` adds older ones a chunk at a time, so the
        first page of a 100k-rollout store answers without reading them all. A store without
        ``offset`` is read whole every round.
        """
        with self._refresh_lock:
            t0 = time.perf_counter()
            state = self._state
            try:
                if not state.loaded_at:
                    changed = self._first_load()
                else:
                    changed = self._catch_up(state)
            except TypeError:  # a Store implementation without offset: read it whole
                changed = self._full_load()
            self.last_cost_s = time.perf_counter() - t0
            self.error = None
            if changed:
                self._announce()
            return changed

    def _announce(self) -> None:
        with self._cond:
            self.version += 1
            self._facets = None
            self._matches.clear()
            self._cond.notify_all()

    def _count(self) -> int:
        """How many rollouts the store holds, by probing ``offset`` (exponential, then binary search)."""
        q = self.store.query_rollouts
        if not q(limit=1):
            return 0
        lo, hi = 1, 2  # q(offset=lo-1) is non-empty; find the first offset with nothing
        while q(offset=hi - 1, limit=1):
            lo, hi = hi, hi * 2
        while lo < hi:  # invariant: offset lo-1 exists, offset hi-1 may not
            mid = (lo + hi + 1) // 2
            if q(offset=mid - 1, limit=1):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _first_load(self) -> bool:
        total = self._count()
        start = max(0, total - self.chunk)
        rows = [summarize(r) for r in self.store.query_rollouts(offset=start)]
        self._state = _State(rows, {r["id"]: r for r in rows}, self._clock(), start, start + len(rows))
        return True

    def _full_load(self) -> bool:
        old = self._state.by_id
        rows = [summarize(r) for r in self.store.query_rollouts()]
        changed = len(rows) != len(old) or any(_differs(old.get(r["id"]), r) for r in rows)
        self._state = _State(rows, {r["id"]: r for r in rows}, self._clock(), 0, len(rows))
        return changed

    def _catch_up(self, state: _State) -> bool:
        rows, by_id = list(state.rows), dict(state.by_id)
        changed = False
        new = self.store.query_rollouts(offset=state.end)
        active = [r["id"] for r in rows if r["status"] not in TERMINAL_ROLLOUT_STATUSES]
        for k in range(0, len(active), 500):
            for r in self.store.query_rollouts(ids=active[k : k + 500]):
                row = summarize(r)
                old = by_id.get(row["id"])
                if old is not None and _differs(old, row):
                    changed = True
                    old.clear()
                    old.update(row)
        for r in new:
            row = summarize(r)
            rows.append(row)
            by_id[row["id"]] = row
            changed = True
        self._state = _State(rows, by_id, self._clock(), state.start, state.end + len(new))
        return changed

    def backfill(self) -> bool:
        """Load the next older chunk while the first load left some out; False when complete."""
        with self._refresh_lock:
            state = self._state
            if not state.loaded_at or state.start <= 0:
                return False
            lo = max(0, state.start - self.chunk)
            older = [summarize(r) for r in self.store.query_rollouts(offset=lo, limit=state.start - lo)]
            by_id = dict(state.by_id)
            by_id.update((r["id"], r) for r in older)
            self._state = _State(older + state.rows, by_id, state.loaded_at, lo, state.end)
            self._announce()
            return lo > 0

    @property
    def complete(self) -> bool:
        """Every rollout of the store is in the index (the first load's backfill is done)."""
        return bool(self._state.loaded_at) and self._state.start == 0

    def _ensure_loaded(self) -> None:
        if not self._state.loaded_at:
            self.refresh()
        self.want()

    def want(self) -> None:
        """Someone is looking: keep the index fresh for the next ``idle_s`` seconds."""
        self._last_wanted = self._clock()
        self._start()
        self._wake.set()

    def _start(self) -> None:
        if self._thread is None and not self._closed and self.background:
            self._thread = threading.Thread(target=self._loop, name="agl-dashboard-index", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._closed:
            watched = self._waiters > 0 or self._clock() - self._last_wanted < self.idle_s
            if not watched:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                self.refresh()
                while not self._closed and self.backfill():
                    pass
                self._warm_rewards(self.reward_batch)
            except Exception as exc:  # noqa: BLE001 - shown on the page; the next round tries again
                self.error = f"{type(exc).__name__}: {exc}"
            pause = max(self.min_interval_s, 2 * self.last_cost_s)
            deadline = time.monotonic() + pause
            while not self._closed and time.monotonic() < deadline:
                time.sleep(min(0.1, pause))

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        with self._cond:
            self._cond.notify_all()

    def wait_for_change(self, since: int, timeout_s: float) -> int:
        """Block until ``version`` passes ``since`` or ``timeout_s`` passes; returns the version."""
        self._ensure_loaded()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._waiters += 1
            try:
                self._wake.set()
                while self.version <= since and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            finally:
                self._waiters -= 1
                self._last_wanted = self._clock()
            return self.version

    # ------------------------------------------------------------------ rewards
    def reward(self, row: dict[str, Any]) -> float | None:
        """The cached reward of a row (fetching it when the rollout is terminal and not cached yet)."""
        rid = row["id"]
        if rid in self._rewards:
            return self._rewards[rid]
        if row["status"] not in TERMINAL_ROLLOUT_STATUSES:
            return None
        att = row["finishing_attempt"]
        value = None
        if att is not None:
            spans = self.store.query_spans(
                rollout_id=rid, attempt=att, name=sc.SPAN_REWARD, include_stale=False
            )
            value = final_reward(spans)
        self._rewards[rid] = value
        return value

    def kind(self, row: dict[str, Any]) -> str | None:
        """The failure kind of a finished row (``infra``, ``agent``, ``task``, ``no_reward``: the trainer's
        :func:`agl.adapter.failures.failure_kind`), read once and cached; None while it runs and for a
        cancelled one. Read for the rows of the page shown only: it needs the rollout and its deciding
        attempt's spans, not just the reward spans."""
        rid = row["id"]
        if rid in self._kinds:
            return self._kinds[rid]
        if row["status"] not in TERMINAL_ROLLOUT_STATUSES or row["status"] == "cancelled":
            return None
        from agl.reports.inspect import failure_kind_of

        value = failure_kind_of(self.store, self.store.get_rollout(rid))
        self._kinds[rid] = value
        return value

    def _warm_rewards(self, budget: int) -> None:
        done = 0
        for row in reversed(self._state.rows):
            if done >= budget or self._closed:
                return
            if row["id"] not in self._rewards and row["status"] in TERMINAL_ROLLOUT_STATUSES:
                self.reward(row)
                done += 1

    # ------------------------------------------------------------------ queries
    def page(
        self, f: Filters, *, offset: int = 0, limit: int = 50, newest_first: bool = True
    ) -> dict[str, Any]:
        """One page of matching rows (with their rewards), the total that match, and facets."""
        self._ensure_loaded()
        rows = self._state.rows
        status, mode, version, gid, search = f.status, f.mode, f.resources_version, f.group_id, f.search
        key = (self.version, status, mode, version, gid, search)
        match = self._matches.get(key)
        if match is None:
            match = [
                r
                for r in rows
                if (status is None or r["status"] in status)
                and (mode is None or r["mode"] == mode)
                and (version is None or r["resources_version"] == version)
                and (gid is None or r["group_id"] == gid)
                and (search is None or search in r["id"])
            ]
            if len(self._matches) >= 16:
                self._matches.clear()
            self._matches[key] = match
        pending = 0
        if f.by_reward:
            lo = -math.inf if f.reward_min is None else f.reward_min
            hi = math.inf if f.reward_max is None else f.reward_max
            kept = []
            budget = self.reward_fetch_budget  # read this many missing rewards now; the rest are pending
            for r in match:
                if r["id"] not in self._rewards:
                    if r["status"] not in TERMINAL_ROLLOUT_STATUSES:
                        continue
                    if budget <= 0:
                        pending += 1
                        continue
                    budget -= 1
                    self.reward(r)
                v = self._rewards[r["id"]]
                if v is not None and lo <= v <= hi:
                    kept.append(r)
            match = kept
        total = len(match)
        if newest_first:
            start = max(0, total - offset - limit)
            window = match[start : max(0, total - offset)][::-1]
        else:
            window = match[offset : offset + limit]
        out = []
        for r in window:
            out.append({**r, "reward": self.reward(r), "failure_kind": self.kind(r)})
        return {
            "rollouts": out,
            "total": total,
            "store_total": len(rows),
            "offset": offset,
            "limit": limit,
            "rewards_pending": pending,
            "version": self.version,
            "refreshed_ago_s": max(0.0, self._clock() - self._state.loaded_at),
            "indexing": None if self.complete else {"loaded": len(rows), "total": self._state.end},
            "refresh_cost_s": self.last_cost_s,
            "error": self.error,
        }

    def facets(self) -> dict[str, Any]:
        """Counts by status and mode, and the resources versions seen (for the filter controls)."""
        self._ensure_loaded()
        if self._facets is not None:
            return self._facets
        status: dict[str, int] = {}
        mode: dict[str, int] = {}
        versions: set[int] = set()
        for r in self._state.rows:
            status[r["status"]] = status.get(r["status"], 0) + 1
            mode[r["mode"]] = mode.get(r["mode"], 0) + 1
            if r["resources_version"] is not None:
                versions.add(r["resources_version"])
        self._facets = {"status": status, "mode": mode, "resources_versions": sorted(versions)}
        return self._facets

    def reward_curve(self, fetch_budget: int = 2000) -> tuple[list[dict[str, Any]], int]:
        """Mean reward per resources version (a trainer publishes one per step, and records the step on
        its rollouts: a point's ``step`` is that step, as in ``metrics.jsonl``), train vs held-out,
        and how many terminal rollouts' rewards are not read yet (at most ``fetch_budget`` are read
        per call; the background warm-up reads the rest)."""
        self._ensure_loaded()
        acc: dict[int, dict[str, list[float]]] = {}
        steps: dict[int, set[Any]] = {}
        pending = 0
        for r in reversed(self._state.rows):
            v = r["resources_version"]
            if v is None or r["status"] not in TERMINAL_ROLLOUT_STATUSES:
                continue
            if r["id"] in self._rewards:
                reward = self._rewards[r["id"]]
            elif fetch_budget > 0:
                fetch_budget -= 1
                reward = self.reward(r)
            else:
                pending += 1
                continue
            if reward is None:
                continue
            key = "train" if r["mode"] == "train" else "val"
            acc.setdefault(v, {"train": [], "val": []})[key].append(reward)
            steps.setdefault(v, set()).add(r.get("step"))
        out = []
        for v in sorted(acc):
            d = acc[v]
            (step,) = steps[v] if len(steps[v]) == 1 else (None,)
            out.append(
                {
                    # the trainer's step (metrics.jsonl numbers steps the same way), else the version
                    "step": step if isinstance(step, int) else v,
                    "version": v,
                    "train_reward": sum(d["train"]) / len(d["train"]) if d["train"] else None,
                    "val_reward": sum(d["val"]) / len(d["val"]) if d["val"] else None,
                    "rollouts": len(d["train"]),
                    "val_rollouts": len(d["val"]),
                }
            )
        return out, pending

    def rows_of_version(self, version: int | None, mode: str = "train") -> list[dict[str, Any]]:
        self._ensure_loaded()
        return [r for r in self._state.rows if r["resources_version"] == version and r["mode"] == mode]
