"""Group commit for ``add_spans``: concurrent callers' spans go into one write transaction.

Every ``add_spans`` call queues a ticket and then takes the *leader* lock; whoever holds it writes every
ticket queued so far in one transaction (one ``BEGIN``/``COMMIT``, so one WAL sync on SQLite and one
commit round trip on PostgreSQL for the whole group) and marks them done; a caller that finds its ticket
already done when it gets the lock returns at once. So:

- a caller returns only after a transaction holding its rows has committed (a span acknowledged to
  its caller is stored), or with the error that stopped them;
- one caller's bad input (an unknown rollout or attempt: a :class:`~agl.errors.StoreError` raised
  before its rows are written) fails that caller only: each caller of a group of several runs inside
  its own savepoint, rolled back on such an error, and the others' rows commit;
- any other failure (the database refusing a statement, the commit itself) rolls the whole transaction
  back and fails every caller of that group with it: nothing partial is left behind;
- one caller alone (the common case when calls do not overlap) pays no savepoint: a lock and a list
  append more than before.

This is the textbook group commit (the database's own ``commit_delay`` idea, done by the callers): no
timer, no thread; the group is whatever queued while the previous leader was writing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from agl.errors import StoreError
from agl.types import Span

__all__ = ["GroupCommit", "Ticket"]


class Ticket:
    """One ``add_spans`` call waiting in a group: its batch and idempotency key, then its answer or error."""

    __slots__ = ("answer", "batch", "done", "error", "key")

    def __init__(self, batch: Any, key: str | None) -> None:
        self.batch, self.key = batch, key
        self.answer: Callable[[], list[Span]] | None = None
        self.error: BaseException | None = None
        self.done = False

    def result(self) -> list[Span]:
        if self.error is not None:
            raise self.error
        assert self.answer is not None
        return self.answer()


class GroupCommit:
    """The queue of tickets and the leader lock (for SQLite the store's own lock: one writer anyway)."""

    def __init__(self, leader: Any = None) -> None:
        self.leader = leader if leader is not None else threading.Lock()
        self._queue_lock = threading.Lock()
        self._queue: list[Ticket] = []
        self.groups = 0  #: transactions written
        self.calls = 0  #: tickets those transactions held

    def run(
        self,
        ticket: Ticket,
        writing: Callable[[], AbstractContextManager[Any]],
        store_one: Callable[[Any, Ticket], None],
        savepoint: Callable[[Any], AbstractContextManager[Any]],
        lock_all: Callable[[Any, list[Ticket]], None] | None = None,
    ) -> list[Span]:
        """Queue ``ticket``; write its group (or find it written by another caller); its answer.

        ``writing()`` opens the write transaction; ``store_one(c, ticket)`` stores one ticket's batch
        inside it (setting ``ticket.answer``); ``savepoint(c)`` isolates one ticket of several;
        ``lock_all(c, tickets)``, when given, runs first for a group of several (PostgreSQL locks all
        their rollouts in one order there, so two groups never lock the same rows in opposite orders).
        """
        with self._queue_lock:
            self._queue.append(ticket)
        with self.leader:
            if not ticket.done:
                self._write_group(writing, store_one, savepoint, lock_all)
        return ticket.result()

    def _take(self) -> list[Ticket]:
        with self._queue_lock:
            group, self._queue = self._queue, []
        return group

    def _write_group(
        self,
        writing: Callable[[], AbstractContextManager[Any]],
        store_one: Callable[[Any, Ticket], None],
        savepoint: Callable[[Any], AbstractContextManager[Any]],
        lock_all: Callable[[Any, list[Ticket]], None] | None,
    ) -> None:
        group = self._take()
        try:
            with writing() as c:
                if len(group) == 1:
                    store_one(c, group[0])
                else:
                    if lock_all is not None:
                        lock_all(c, group)
                    for t in group:
                        try:
                            with savepoint(c):
                                store_one(c, t)
                        except StoreError as exc:  # this caller's input: its savepoint is rolled back
                            t.answer, t.error = None, exc
        except BaseException as exc:  # the whole transaction rolled back: every caller of it fails
            for t in group:
                if t.error is None:
                    t.answer, t.error = None, exc
        finally:
            self.groups += 1
            self.calls += len(group)
            for t in group:
                t.done = True
