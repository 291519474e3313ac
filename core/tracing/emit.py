"""Emit API: rewards, messages, objects and exceptions as spans of the current rollout (DESIGN §4).

Each call makes one short span (child of whatever span is current, e.g. the agent's) that the
adapter reads: ``agl.reward`` spans become rewards (the last primary reward of an attempt is its
final reward, earlier ones are intermediate rewards of the LLM call before them). Outside a rollout
context the spans are still made (the user's own exporters see them) and a warning is issued once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import warnings
from collections.abc import Mapping
from numbers import Real
from typing import Any

from opentelemetry.trace import Status, StatusCode

from agl import semconv
from agl.tracing.provider import current_rollout, get_tracer

__all__ = ["emit_exception", "emit_message", "emit_object", "emit_reward"]


_warned = False
_warn_lock = threading.Lock()


def _warn_outside_rollout(what: str) -> None:
    global _warned
    if _warned or current_rollout() is not None:
        return
    with _warn_lock:
        if _warned:
            return
        _warned = True
    message = (
        f"agl.{what}() called outside a rollout context: the span is created but belongs to no rollout, "
        "so it never reaches the store (run the agent inside agl.rollout_context() or the Runner)"
    )
    # One channel only: a warning shows once (and logging users see it through logging.captureWarnings).
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _reward_value(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{what} must be a real number, got {type(value).__name__} ({value!r})")
    number = float(value)
    if not math.isfinite(number):
        here = current_rollout()
        where = f" (rollout {here[0]} attempt {here[1]})" if here is not None else ""
        raise ValueError(f"{what} must be finite, got {number!r}{where}: a NaN or inf reward is refused")
    return number


def _span(name: str, attributes: dict[str, Any]) -> Any:
    return get_tracer(__name__).start_span(name, attributes=attributes)


def emit_reward(value: float | Mapping[str, float], name: str | None = None, primary: bool = True) -> None:
    """Record a reward of the current rollout as an ``agl.reward`` span.

    ``value`` is a number, or a dict ``{name: number}`` for several named rewards at once (one span
    per entry, in dict order). With a dict, at most one entry is primary: the one called ``name``
    when ``name`` is given (it must be a key), else the first one; and only when ``primary`` is True.
    The adapter uses the last primary reward of an attempt as its final reward; every other reward
    (non-primary ones, earlier primaries) is an *intermediate* reward, added to the return of the LLM
    call before it (docs/architecture.md §8.2), so it is trained on: a breakdown of the final reward
    emitted beside it counts twice. Keep such a breakdown out of reward spans (e.g. recompute it from
    the stored transitions, as examples/solve_check does). A scalar reward is named ``name`` or
    ``"reward"``.

    Raises ``ValueError`` for NaN/inf and ``TypeError`` for non-numbers, before emitting anything.
    """
    if isinstance(value, Mapping):
        if not value:
            raise ValueError("emit_reward() got an empty dict of rewards")
        entries = []
        for key, v in value.items():
            if not isinstance(key, str) or not key:
                raise TypeError(f"reward names must be non-empty strings, got {key!r}")
            entries.append((key, _reward_value(v, f"reward {key!r}")))
        if name is not None and name not in value:
            raise ValueError(f"primary reward name {name!r} is not one of the given rewards {list(value)}")
        primary_name = (name if name is not None else entries[0][0]) if primary else None
        rewards = [(key, v, key == primary_name) for key, v in entries]
    else:
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"reward name must be a non-empty string, got {name!r}")
        rewards = [(name or "reward", _reward_value(value, "reward"), bool(primary))]
    _warn_outside_rollout("emit_reward")
    for key, v, is_primary in rewards:
        _span(
            semconv.SPAN_REWARD,
            {
                semconv.AGL_REWARD_VALUE: v,
                semconv.AGL_REWARD_NAME: key,
                semconv.AGL_REWARD_PRIMARY: is_primary,
                semconv.AGL_REWARD_SOURCE: "emit",
            },
        ).end()


def emit_message(text: str) -> None:
    """Record a free-text message (a log line that travels with the rollout's spans)."""
    if not isinstance(text, str):
        raise TypeError(f"emit_message() takes a string, got {type(text).__name__}")
    _warn_outside_rollout("emit_message")
    _span(semconv.SPAN_MESSAGE, {semconv.AGL_MESSAGE_BODY: text}).end()


def _json_default(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"object of type {type(value).__name__} is not JSON serialisable")


def emit_object(obj: Any) -> None:
    """Record any JSON-serialisable object (pydantic models and dataclasses too) as ``agl.object``."""
    try:
        body = json.dumps(obj, default=_json_default, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"emit_object() needs a JSON-serialisable object without NaN/inf: {exc}") from exc
    _warn_outside_rollout("emit_object")
    _span(semconv.SPAN_OBJECT, {semconv.AGL_OBJECT_JSON: body}).end()


def emit_exception(exc: BaseException, *, infra: bool | None = None) -> None:
    """Record an exception as an ``agl.exception`` span with status ERROR and an exception event.

    ``infra=True`` says the failure is the infrastructure's (an engine, tool server or network went
    down), not the agent's: the attempt is then classified ``infra``
    (:func:`agl.adapter.failures.failure_kind`), requeued by the trainer and never scored — also when
    the agent goes on to return a reward of its own. An :class:`agl.InfraError` is ``infra`` unless
    ``infra=False`` is given."""
    if not isinstance(exc, BaseException):
        raise TypeError(f"emit_exception() takes an exception, got {type(exc).__name__}")
    if infra is not None and not isinstance(infra, bool):
        raise TypeError(f"emit_exception(infra=...) takes True or False, got {infra!r}")
    _warn_outside_rollout("emit_exception")
    from agl.errors import InfraError

    attributes: dict[str, Any] = {
        semconv.AGL_EXCEPTION_TYPE: type(exc).__qualname__,
        semconv.AGL_EXCEPTION_MESSAGE: str(exc),
    }
    if infra or (infra is None and isinstance(exc, InfraError)):
        attributes[semconv.AGL_EXCEPTION_INFRA] = True
    span = _span(semconv.SPAN_EXCEPTION, attributes)
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
    span.end()
