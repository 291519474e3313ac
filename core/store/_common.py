"""Helpers every store implementation shares, so their checks and messages are identical.

The conformance suite compares implementations error for error; keeping input checks here means a
new backend gets the same refusals (and the same wording) for free.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from agl.store.base import FINISH_STATUSES, InvalidInputError
from agl.types import ROLLOUT_STATUSES, AttemptError, Resources

__all__ = [
    "Backoff",
    "ChangeFeed",
    "check_attempt_number",
    "check_claim_args",
    "check_error",
    "check_finish_status",
    "check_ids",
    "check_limit",
    "check_mode",
    "check_modes",
    "check_finish_args",
    "check_offset",
    "check_resources_version",
    "check_rollout_query",
    "check_span_query",
    "check_wait_args",
    "check_statuses",
    "check_timeout",
    "coerce_many",
    "coerce_one",
    "describe_validation_error",
    "make_resources",
]

M = TypeVar("M", bound=BaseModel)
MODES = ("train", "val", "test")

#: The backoff used to notice other processes' writes while blocked (claim / wait_for_rollouts).
BACKOFF_MIN_S = 0.005
BACKOFF_MAX_S = 0.1


def describe_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg', '')}" if loc else str(err.get("msg", "")))
    more = exc.error_count() - 5
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def coerce_one(model: type[M], item: Any, what: str) -> M:
    """Accept a model instance or a dict (validated by the model); refuse anything else by name."""
    if isinstance(item, model):
        return item
    if isinstance(item, dict):
        try:
            return model.model_validate(item)
        except ValidationError as exc:
            raise InvalidInputError(f"invalid {what}: {describe_validation_error(exc)}") from None
    raise InvalidInputError(
        f"invalid {what}: expected a {model.__name__} or a dict, got {type(item).__name__}"
    )


def coerce_many(model: type[M], items: Iterable[Any], what: str) -> list[M]:
    if isinstance(items, (str, bytes, dict)) or isinstance(items, BaseModel):
        raise InvalidInputError(f"expected a list of {what}s, got {type(items).__name__}")
    try:
        seq = list(items)
    except TypeError:
        raise InvalidInputError(f"expected a list of {what}s, got {type(items).__name__}") from None
    cls = model
    out: list[M] = []
    for i, item in enumerate(seq):
        if type(item) is cls:  # fast path: already validated at construction
            out.append(item)
        else:
            out.append(coerce_one(model, item, f"{what} #{i}"))
    return out


def check_timeout(timeout_s: Any) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise InvalidInputError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
    if not math.isfinite(timeout_s) or timeout_s < 0:
        raise InvalidInputError(f"timeout_s must be a finite number >= 0, got {timeout_s!r}")
    return float(timeout_s)


def check_limit(limit: Any) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0 or limit > 2**62:
        raise InvalidInputError(f"limit must be an integer between 0 and 2**62, got {limit!r}")
    return limit


def check_offset(offset: Any) -> int:
    if offset is None:
        return 0
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset > 2**62:
        raise InvalidInputError(f"offset must be an integer between 0 and 2**62, got {offset!r}")
    return offset


def check_mode(mode: Any) -> str | None:
    if mode is not None and mode not in MODES:
        raise InvalidInputError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode


def check_modes(modes: Sequence[str] | None) -> tuple[str, ...] | None:
    if modes is None:
        return None
    if isinstance(modes, str):
        modes = (modes,)
    for m in modes:
        check_mode(m)
    return tuple(modes)


def check_statuses(status: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if status is None:
        return None
    statuses = (status,) if isinstance(status, str) else tuple(status)
    for s in statuses:
        if s not in ROLLOUT_STATUSES:
            raise InvalidInputError(
                f"unknown rollout status {s!r}; expected one of {', '.join(ROLLOUT_STATUSES)}"
            )
    return statuses


def check_finish_status(status: Any) -> str:
    if status not in FINISH_STATUSES:
        raise InvalidInputError(
            f"cannot finish an attempt as {status!r}: a worker finishes with one of {', '.join(FINISH_STATUSES)} "
            "(lost/timed_out are set by the store)"
        )
    return status


def check_error(error: Any) -> AttemptError | None:
    if error is None:
        return None
    return coerce_one(AttemptError, error, "attempt error")


def check_ids(ids: Any, what: str = "rollout id") -> list[str]:
    if isinstance(ids, str) or ids is None:
        raise InvalidInputError(f"expected a list of {what}s, got {type(ids).__name__}")
    out = list(ids)
    for i in out:
        if not isinstance(i, str):
            raise InvalidInputError(f"{what}s must be strings, got {i!r}")
    return out


def check_attempt_number(attempt: Any) -> int:
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise InvalidInputError(f"attempt must be an integer >= 1, got {attempt!r}")
    return attempt


# ------------------------------------------------- the argument checks that open each store method
# Every store (memory, SQLite, PostgreSQL) opens its methods with these, so they refuse the same
# input, in the same order, with the same message.


def check_claim_args(worker_id: Any, timeout_s: Any, modes: Any) -> tuple[float, tuple[str, ...] | None]:
    """``claim``'s arguments: the timeout in seconds and the mode filter."""
    timeout = check_timeout(timeout_s)
    mode_filter = check_modes(modes)
    if worker_id is not None and not isinstance(worker_id, str):
        raise InvalidInputError(f"worker_id must be a string, got {worker_id!r}")
    return timeout, mode_filter


def check_finish_args(attempt: Any, status: Any, error: Any) -> AttemptError | None:
    """``finish_attempt``'s arguments; returns the error as a model."""
    check_finish_status(status)
    check_attempt_number(attempt)
    return check_error(error)


def check_rollout_query(
    status: Any, mode: Any, limit: Any, offset: Any, ids: Any
) -> tuple[tuple[str, ...] | None, int | None, int, list[str] | None]:
    """``query_rollouts``'s arguments: (statuses, limit, offset, ids without repeats)."""
    statuses = check_statuses(status)
    check_mode(mode)
    checked_limit = check_limit(limit)
    skip = check_offset(offset)
    id_list = None if ids is None else list(dict.fromkeys(check_ids(ids)))
    return statuses, checked_limit, skip, id_list


def check_span_query(attempt: Any, limit: Any) -> int | None:
    """``query_spans``'s arguments; returns the limit."""
    checked_limit = check_limit(limit)
    if attempt is not None:
        check_attempt_number(attempt)
    return checked_limit


def check_wait_args(ids: Any, timeout_s: Any) -> tuple[float, list[str]]:
    """``wait_for_rollouts``'s arguments: the timeout and the ids without repeats."""
    timeout = check_timeout(timeout_s)
    return timeout, list(dict.fromkeys(check_ids(ids)))


def check_resources_version(version: Any) -> None:
    """A resources version to look up: ``None`` (the latest) or an integer."""
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise InvalidInputError(f"resources version must be an integer, got {version!r}")


def make_resources(version: int, items: Any) -> Resources:
    if not isinstance(items, dict):
        raise InvalidInputError(f"resources must be a dict of name -> resource, got {type(items).__name__}")
    for k in items:
        if not isinstance(k, str) or not k:
            raise InvalidInputError(f"resource names must be non-empty strings, got {k!r}")
    try:
        return Resources(version=version, items=items, created_at=time.time())
    except ValidationError as exc:
        raise InvalidInputError(f"invalid resources: {describe_validation_error(exc)}") from None


class Backoff:
    """Capped exponential backoff (5 ms -> 100 ms) for noticing writes made by other processes."""

    __slots__ = ("delay",)

    def __init__(self) -> None:
        self.delay = BACKOFF_MIN_S

    def reset(self) -> None:
        self.delay = BACKOFF_MIN_S

    def next(self) -> float:
        d = self.delay
        self.delay = min(self.delay * 2, BACKOFF_MAX_S)
        return d


class ChangeFeed:
    """Who to tell when a store changed in a way a blocked call may be waiting for.

    A store calls ``notify(topic)`` after a write commits: ``queue`` when a rollout became claimable,
    ``done`` when one ended, ``lease`` when a running deadline appeared. The store server subscribes one
    callback per store and wakes its async long-polls from it, so a waiting request holds no thread.
    Callbacks run on the writer's thread and must not block (``loop.call_soon_threadsafe`` is the idea).
    """

    __slots__ = ("_listeners", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[Callable[[str], None]] = []

    def subscribe(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call ``listener(topic)`` on every change; returns the function that unsubscribes it."""
        with self._lock:
            self._listeners = [*self._listeners, listener]

        def unsubscribe() -> None:
            with self._lock:
                self._listeners = [fn for fn in self._listeners if fn is not listener]

        return unsubscribe

    def notify(self, topic: str) -> None:
        for fn in self._listeners:  # a copy-on-write list: no lock while calling out
            fn(topic)
