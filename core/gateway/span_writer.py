"""``SpanWriter``: how the gateway stores its spans, in batches, without the event loop waiting on I/O.

Three ways to write, chosen per call by the store and the load:

- **in the event loop** (memory store always; SQLite while a call is alone): the spans of every call that
  finished in one loop iteration are written by one callback at the end of that iteration. No thread
  hop, no GIL hand-off, no cross-thread wake-up: for one call at a time that is the least CPU. When
  another thread is inside the store just then, the batch goes to the writer thread instead: the loop
  never waits on the store's lock;
- **from the writer thread, batched by the load** (SQLite while calls overlap; network stores always):
  calls in the loop do not finish in the same iteration (each upstream reply is its own socket event),
  so written in the loop every span paid a transaction and a commit of its own. The writer thread
  instead takes everything that queued while it was writing: one ``add_spans`` (one transaction, one
  commit) per batch, the batch as large as the load makes it, no timer; the loop keeps serving while
  SQLite commits (it releases the GIL), and one wake-up of the loop answers the whole batch;
- either way ``await write(spans)`` (``span_writes="before_reply"``, the default) returns only once
  the spans are committed, so the reply leaves after its span is stored: a runner that finishes its
  attempt as soon as the agent returns never loses the last call's span. ``submit(spans)``
  (``after_reply``) queues and returns at once.

``flush()`` waits until everything queued so far is stored; ``close()`` flushes and stops the thread —
the gateway calls it at shutdown, after the last request, so a clean shutdown loses no span. Failures
are logged and counted, never turned into an error for the client (the agent's run must not break
because a span could not be stored, e.g. for an unknown rollout); a batch that fails is retried call by
call, so one call's bad span does not cost the others theirs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from agl.types import Span

__all__ = ["SpanWriter"]

log = logging.getLogger("agl.gateway")

#: one queued call: its spans, and the loop and future to resolve once they are stored (None: nobody waits)
_Entry = tuple[list[Span], "asyncio.AbstractEventLoop | None", "asyncio.Future[None] | None"]


class SpanWriter:
    """Stores the gateway's spans in batches (see the module docstring)."""

    def __init__(self, store: Any, stats: dict[str, int], *, in_loop: bool | None = None) -> None:
        self.store = store
        self.stats = stats
        # stores in this process (``in_process``) may be written on the event loop itself; of those,
        # one whose every write commits (``commit_per_write``) is batched by the writer thread
        self.in_loop = bool(getattr(store, "in_process", False)) if in_loop is None else in_loop
        #: calls that overlap go to the writer thread, whose batches share one commit
        self.batch_overlapping = self.in_loop and bool(getattr(store, "commit_per_write", False))
        self._cond = threading.Condition()
        self._queue: list[_Entry] = []  # for the writer thread
        self._pending: list[_Entry] = []  # for the in-loop callback
        self._scheduled = False
        self._queued = 0  # calls' span groups accepted so far
        self._done = 0  # groups handled (stored or failed) so far
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, spans: list[Span]) -> None:
        """Queue spans; returns immediately."""
        if self.in_loop:
            self._pend(spans, wait=False)
            return
        self._put([(spans, None, None)])

    async def write(self, spans: list[Span], *, alone: bool = True) -> None:
        """Queue spans and wait until they are stored (or their write failed). ``alone``: no other
        call is in flight (then a commit store is written in the loop: no thread hop for one call)."""
        if self.in_loop and (alone or not self.batch_overlapping):
            fut = self._pend(spans, wait=True)
            if fut is not None:
                await asyncio.shield(fut)
            return
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._put([(spans, loop, fut)])
        await asyncio.shield(fut)

    # ----------------------------------------------------------------------------- in the loop
    def _pend(self, spans: list[Span], *, wait: bool) -> asyncio.Future[None] | None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside the server's loop: write now
            self._add([(spans, None, None)])
            return None
        with self._cond:
            self._queued += 1
        fut = loop.create_future() if wait else None
        self._pending.append((spans, loop, fut))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._write_pending)  # runs after this iteration's other callbacks
        return fut

    def _write_pending(self) -> None:
        self._scheduled = False
        batch, self._pending = self._pending, []
        lock = getattr(self.store, "_lock", None)  # the in-process stores' own lock
        if lock is not None:
            if not lock.acquire(blocking=False):
                # another thread is inside the store (e.g. a trainer reading spans in this process):
                # the loop must not wait for it, so the writer thread takes this batch
                with self._cond:  # re-queued atomically: flush() never sees them as done or missing
                    self._queued -= len(batch)
                    self._put(batch)
                return
            lock.release()  # a probe only: add_spans takes the lock itself
        try:
            self._add(batch)
        finally:
            for _, _, fut in batch:
                _resolve(fut)
            with self._cond:
                self._done += len(batch)
                self._cond.notify_all()

    # ------------------------------------------------------------------------ writer thread
    def _put(self, entries: list[_Entry]) -> None:
        with self._cond:
            if self._closed:  # after close (should not happen): write in line rather than lose them
                self._add(entries)
                _answer(entries)
                return
            self._queue.extend(entries)
            self._queued += len(entries)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="agl-gateway-spans", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue and self._closed:
                    return
                batch, self._queue = self._queue, []
            try:
                self._add(batch)
            finally:
                _answer(batch)
                with self._cond:
                    self._done += len(batch)
                    self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Block until every span queued before the call is handled; False on timeout.

        Called from a thread other than the event loop's (``asyncio.to_thread``): in-loop batches are
        written by the loop meanwhile.
        """
        with self._cond:
            target = self._queued
            return self._cond.wait_for(lambda: self._done >= target, timeout=timeout_s)

    def close(self, timeout_s: float | None = 60.0) -> None:
        """Store what is queued, then stop the writer thread (called off the loop, at shutdown)."""
        if not self.flush(timeout_s):
            log.warning("agl gateway: spans still queued after %s s at shutdown", timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("agl gateway: span writer still busy after %s s at shutdown", timeout_s)

    def _add(self, batch: list[_Entry]) -> None:
        spans = batch[0][0] if len(batch) == 1 else [s for group, _, _ in batch for s in group]
        try:
            self.store.add_spans(spans)
            self.stats["spans_stored"] += len(spans)
            self.stats["span_writes"] += 1  # add_spans calls: spans_stored / span_writes = batch size
            return
        except Exception as exc:  # noqa: BLE001 - fall back to per-call writes, then give up loudly
            if len(batch) == 1:
                self._failed(spans, exc)
                return
        for group, _, _ in batch:
            try:
                self.store.add_spans(group)
                self.stats["spans_stored"] += len(group)
            except Exception as exc:  # noqa: BLE001
                self._failed(group, exc)

    def _failed(self, spans: list[Span], exc: BaseException) -> None:
        self.stats["span_write_errors"] += len(spans)
        log.warning(
            "agl gateway: could not store %d span(s) of rollout %s: %s", len(spans), spans[0].rollout_id, exc
        )


def _answer(batch: list[_Entry]) -> None:
    """Resolve the waiting calls of a batch written off the loop: one wake-up per loop, not per call."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
    for _, loop, fut in batch:
        if loop is not None and fut is not None:
            by_loop.setdefault(loop, []).append(fut)
    for loop, futs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve_all, futs)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


def _resolve_all(futs: list[asyncio.Future[None]]) -> None:
    for fut in futs:
        _resolve(fut)


def _resolve(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)
