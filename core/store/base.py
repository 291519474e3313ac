"""The Store protocol (DESIGN §5): the one contract every store implementation keeps.

Implementations: ``memory.MemoryStore``, ``sqlite.SQLiteStore`` (the embedded default) and
``http.HttpStore`` (client of ``agl store serve``). All of them pass ``tests/store/conformance.py``.

Semantics, shared by every implementation:
- ``enqueue`` takes many rollouts at once; ``claim`` is atomic and creates an attempt with a lease.
- Heartbeats and span arrivals extend the lease. An expired lease ends the attempt ``lost``; a run past
  ``config.timeout_s`` ends it ``timed_out``; an attempt finished ``failed`` counts the same. The rollout
  is requeued while attempts remain, else it fails. Spans of an attempt that ended ``lost`` or
  ``timed_out`` are kept but marked ``stale`` (they are never trained on).
- ``claim`` and ``wait_for_rollouts`` block up to ``timeout_s`` and wake on events (no busy polling).
- ``add_spans`` assigns ``seq``, strictly increasing within an attempt, and returns the stored spans.
- Writes that carry an ``idempotency_key`` are applied once: a retry with the same key returns the
  first result without writing again.
- Bad input never changes state: unknown ids raise ``NotFoundError``, illegal status changes raise
  ``ConflictError``, malformed data raises ``InvalidInputError``; all name the problem.

Details every implementation keeps (``tests/store/conformance.py`` checks them):
- Models or dicts are accepted wherever a model is expected; dicts are validated by the model and a
  failure is an ``InvalidInputError`` naming the field.
- ``enqueue``: an id already stored or repeated in the batch is a ``ConflictError``; a
  ``resources_version`` that was never published is a ``NotFoundError``; either way nothing is stored.
- ``claim`` takes queued rollouts oldest (first enqueued) first; a requeued rollout keeps its place.
  Each claim records ``resources_version`` on the rollout and the attempt: the rollout's own if it was
  enqueued with one, else the latest published at claim time (None when none was published).
- ``finish_attempt``/``heartbeat`` on an attempt that is not running (ended, lost, timed out, or its
  rollout cancelled) is a ``ConflictError``; an unknown rollout or attempt number a ``NotFoundError``.
- ``cancel`` works on queued and running rollouts (the running attempt ends ``failed`` with error type
  ``cancelled``); on a terminal rollout it is a ``ConflictError``.
- ``add_spans``: spans for an unknown rollout or attempt are a ``NotFoundError`` and no span of the batch
  is stored. Spans may arrive after their attempt ended: after ``succeeded``/``failed`` they are stored
  as usual, after ``lost``/``timed_out`` they are stored ``stale``.
- Every returned ``Rollout`` carries its ``attempts``. Queries return oldest first and honour ``limit``
  (and ``query_rollouts`` its ``offset``: that many matches skipped first);
  ``wait_for_rollouts`` returns the terminal ones in the order the ids were given.
- Resources versions start at 1 and increase by one per ``add_resources``; an unknown version passed to
  ``get_resources`` is a ``NotFoundError``.
- An idempotent retry returns the rollouts (in their current state), the spans or the resources
  snapshot of the first call; a call that was refused does not consume its key. Keys are kept as
  durably as the data (SQLite, PostgreSQL: in the same transaction as the write).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from agl.errors import ConflictError, InvalidInputError, NotFoundError, StoreError
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
)

#: the environment variable a command's ``--store`` falls back to, then :data:`DEFAULT_STORE`
STORE_ENV = "AGL_STORE"
#: the documented default store of the ``agl`` commands
DEFAULT_STORE = "sqlite:///agl.db"
#: the environment variable holding an HTTP store server's bearer token (clients and the server)
STORE_TOKEN_ENV = "AGL_STORE_TOKEN"

__all__ = [
    "ConflictError",
    "InvalidInputError",
    "NotFoundError",
    "Store",
    "StoreError",
    "FINISH_STATUSES",
]

#: Statuses a worker may finish its own attempt with. ``lost``/``timed_out`` are the store's to set.
FINISH_STATUSES = ("succeeded", "failed")


@runtime_checkable
class Store(Protocol):
    """What runners, the gateway, the tracer and the trainer need from a store."""

    # ---------------------------------------------------------------- tasks
    def add_tasks(self, tasks: Sequence[Task]) -> list[Task]:
        """Insert or replace tasks by id."""
        ...

    def get_task(self, task_id: str) -> Task: ...

    def query_tasks(self, *, mode: Mode | None = None, limit: int | None = None) -> list[Task]: ...

    # ------------------------------------------------------------- rollouts
    def enqueue(self, rollouts: Sequence[NewRollout], *, idempotency_key: str | None = None) -> list[Rollout]:
        """Queue rollouts atomically (all or none); ids are generated where not given, must be new."""
        ...

    def claim(
        self, worker_id: str, *, timeout_s: float = 0.0, modes: Sequence[Mode] | None = None
    ) -> Claim | None:
        """Atomically take the oldest queued rollout and start a new attempt on it, with a lease.

        Blocks up to ``timeout_s`` for work to arrive; returns None when there is none. The rollout
        records the resources version it runs with: its own if it was enqueued with one, else the latest.
        """
        ...

    def heartbeat(self, rollout_id: str, attempt: int) -> Attempt:
        """Extend the lease. Raises ConflictError if the attempt already ended (the worker lost it)."""
        ...

    def finish_attempt(
        self, rollout_id: str, attempt: int, status: str, *, error: AttemptError | None = None
    ) -> Rollout:
        """End a running attempt as ``succeeded`` or ``failed`` and move the rollout on."""
        ...

    def cancel(self, rollout_id: str) -> Rollout:
        """Cancel a queued or running rollout (its running attempt ends ``failed``)."""
        ...

    def get_rollout(self, rollout_id: str) -> Rollout: ...

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
        """Rollouts matching every given filter, oldest first, each with its attempts.

        ``offset`` skips that many matching rollouts first (then ``limit`` applies): rollouts are only
        ever added, in store order, so ``offset=n`` after seeing ``n`` rollouts returns the new ones.
        """
        ...

    def get_attempts(self, rollout_id: str) -> list[Attempt]: ...

    def wait_for_rollouts(self, ids: Sequence[str], *, timeout_s: float) -> list[Rollout]:
        """Block until every listed rollout is terminal or the timeout passes; return the terminal ones."""
        ...

    # ---------------------------------------------------------------- spans
    def add_spans(self, spans: Sequence[Span], *, idempotency_key: str | None = None) -> list[Span]:
        """Append spans (atomically, all or none); returns them with ``seq`` (and ``stale``) set."""
        ...

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
        """Spans matching every given filter, in store order (seq within an attempt)."""
        ...

    # ------------------------------------------------------------ resources
    def add_resources(
        self, items: dict[str, Resource | dict[str, Any]], *, idempotency_key: str | None = None
    ) -> Resources:
        """Publish a new snapshot; its version is one more than the latest. A retry with the same
        ``idempotency_key`` returns the first snapshot instead of publishing another version."""
        ...

    def get_resources(self, version: int | None = None) -> Resources | None:
        """The given version, or the latest (None when nothing was published yet)."""
        ...

    # ----------------------------------------------------------- lifecycle
    def close(self) -> None: ...
