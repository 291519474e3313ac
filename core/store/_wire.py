"""The wire format shared by the store server and its client: span lists out, answers back in.

Spans are most of what crosses the wire (batches in, 300-span queries out). pydantic's serializer
infers the type of every attribute value at run time (they are ``Any``); orjson over the models'
``__dict__`` writes the same JSON about 3x faster. Without orjson (it is optional), or for values
orjson refuses (integers beyond 64 bits), pydantic's serializer is used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pydantic_core
from pydantic import BaseModel, create_model

from agl.types import (
    Attempt,
    AttemptError,
    Claim,
    Resources,
    Rollout,
    RolloutConfig,
    Span,
    SpanEvent,
    SpanStatus,
    Task,
)

try:
    import orjson
except ImportError:  # pragma: no cover - exercised where orjson is not installed
    orjson = None  # type: ignore[assignment]

__all__ = ["dump_spans"]


def _plain(span: Span) -> dict[str, Any]:
    d = span.__dict__.copy()
    d["status"] = span.status.__dict__
    if span.events:
        d["events"] = [e.__dict__ for e in span.events]
    return d


def dump_spans(spans: Sequence[Span]) -> bytes:
    """A JSON array of spans, exactly as ``pydantic_core.to_json(spans)`` writes it."""
    if orjson is not None:
        try:
            return orjson.dumps([_plain(s) for s in spans])
        except TypeError:
            pass
    return pydantic_core.to_json(list(spans))


# ------------------------------------------------------------------ answers, read by the client


def _field(name: str, tp: Any) -> Callable[[bytes], Any]:
    """Parser of ``{"<name>": <tp>}`` bodies, validated in one pydantic-core pass."""
    model: type[BaseModel] = create_model(f"_{name.title()}Body", **{name: (tp, ...)})  # type: ignore[call-overload]

    def parse(body: bytes) -> Any:
        return getattr(model.model_validate_json(body), name)

    return parse


# Answers of our own server hold data it validated before storing: rebuild the hot ones (spans,
# rollouts, claims) without validating again, which costs several times the JSON parse. Rare, small
# answers (tasks, resources) are validated as usual.
_new = object.__new__
_setattr = object.__setattr__


def _trusted(cls: type[BaseModel], fields: frozenset[str], values: dict[str, Any]) -> Any:
    if values.keys() != fields:  # an older or newer server: let pydantic fill in or drop fields
        return cls.model_construct(**values)
    obj = _new(cls)
    _setattr(obj, "__dict__", values)
    _setattr(obj, "__pydantic_fields_set__", set(fields))
    _setattr(obj, "__pydantic_extra__", None)
    _setattr(obj, "__pydantic_private__", None)
    return obj


_F_SPAN, _F_STATUS, _F_EVENT = (
    frozenset(Span.model_fields),
    frozenset(SpanStatus.model_fields),
    frozenset(SpanEvent.model_fields),
)
_F_ROLLOUT, _F_CONFIG = frozenset(Rollout.model_fields), frozenset(RolloutConfig.model_fields)
_F_ATTEMPT, _F_ERROR, _F_CLAIM = (
    frozenset(Attempt.model_fields),
    frozenset(AttemptError.model_fields),
    frozenset(Claim.model_fields),
)


def _span(d: dict[str, Any]) -> Span:
    d["status"] = _trusted(SpanStatus, _F_STATUS, d["status"])
    d["events"] = tuple(_trusted(SpanEvent, _F_EVENT, e) for e in d["events"])
    return _trusted(Span, _F_SPAN, d)  # type: ignore[no-any-return]


def _attempt(d: dict[str, Any]) -> Attempt:
    if d.get("error") is not None:
        d["error"] = _trusted(AttemptError, _F_ERROR, d["error"])
    return _trusted(Attempt, _F_ATTEMPT, d)  # type: ignore[no-any-return]


def _rollout(d: dict[str, Any]) -> Rollout:
    d["config"] = _trusted(RolloutConfig, _F_CONFIG, d["config"])
    d["attempts"] = tuple(_attempt(a) for a in d["attempts"])
    return _trusted(Rollout, _F_ROLLOUT, d)  # type: ignore[no-any-return]


def _claim(d: dict[str, Any] | None) -> Claim | None:
    if d is None:
        return None
    return _trusted(Claim, _F_CLAIM, {"rollout": _rollout(d["rollout"]), "attempt": _attempt(d["attempt"])})  # type: ignore[no-any-return]


_from_json = pydantic_core.from_json
_P_SPANS: Callable[[bytes], Any] = lambda b: [_span(x) for x in _from_json(b)["spans"]]  # noqa: E731
_P_ROLLOUTS: Callable[[bytes], Any] = lambda b: [_rollout(x) for x in _from_json(b)["rollouts"]]  # noqa: E731
_P_ATTEMPTS: Callable[[bytes], Any] = lambda b: [_attempt(x) for x in _from_json(b)["attempts"]]  # noqa: E731
_P_CLAIM: Callable[[bytes], Any] = lambda b: _claim(_from_json(b)["claim"])  # noqa: E731
_P_ROLLOUT: Callable[[bytes], Any] = lambda b: _rollout(_from_json(b))  # noqa: E731
_P_ATTEMPT: Callable[[bytes], Any] = lambda b: _attempt(_from_json(b))  # noqa: E731
_P_TASKS = _field("tasks", list[Task])
_P_RESOURCES = _field("resources", Resources | None)
_P_TASK = Task.model_validate_json
_P_RESOURCE_SNAPSHOT = Resources.model_validate_json
