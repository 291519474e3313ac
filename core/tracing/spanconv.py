"""OpenTelemetry SDK spans as the store's ``agl.types.Span`` (DESIGN §4).

Runs for every span agl exports, so it builds spans without pydantic's per-field validation: each
value is formatted here or is an attribute the OTel SDK already restricted; what is left (rollout
id, attempt, name, times) is checked by hand. ``agl.tracing.provider`` re-exports ``span_from_otel`` and
``MissingRolloutError``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from agl import semconv
from agl.errors import MissingRolloutError
from agl.names import normalise_attributes
from agl.types import _ID_RE, Span, SpanEvent, SpanStatus, _construct

__all__ = ["MissingRolloutError", "span_from_otel"]

_ROLLOUT_KEY = semconv.AGL_ROLLOUT_ID
_ATTEMPT_KEY = semconv.AGL_ATTEMPT


def _attr_value(value: Any) -> Any:
    """An OTel attribute value as one the store accepts (``agl.types.Span``'s attribute rule).

    Tuples become lists, NaN/inf and integers beyond 64 bits become strings, and what newer OTel
    SDKs also allow but the store does not — bytes, mappings, sequences holding them — becomes text
    (bytes decoded as UTF-8, mappings as JSON), so a span is never refused for one attribute.
    """
    kind = type(value)
    if kind is str or kind is bool:
        return value
    if kind is int:
        return value if -(2**63) <= value < 2**63 else str(value)  # the store keeps 64-bit ints
    if kind is float:
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, (tuple, list)):
        items = list(value)
        if all(_is_plain(v) for v in items):
            return items
        return [v if type(v) is str else _as_text(v) for v in items]  # one type per list: all text
    return _as_text(value)


def _is_plain(v: Any) -> bool:
    kind = type(v)
    if kind is str or kind is bool:
        return True
    if kind is int:
        return -(2**63) <= v < 2**63
    return kind is float and math.isfinite(v)


def _as_text(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    if type(value) is float:
        return repr(value)
    try:
        return json.dumps(value, default=str, separators=(",", ":"))
    except (TypeError, ValueError):
        return str(value)


def _attrs(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    if not attributes:
        return {}
    # strings (most GenAI attributes) pass as they are; everything else through _attr_value
    return {k: v if type(v) is str else _attr_value(v) for k, v in attributes.items() if v is not None}


def _raw_attributes(span: Any) -> Mapping[str, Any] | None:
    """A finished SDK span's attributes without the per-access read-only proxy and its lock-guarded
    iteration: the plain dict inside the SDK's ``BoundedAttributes``, else the public property."""
    inner = getattr(getattr(span, "_attributes", None), "_dict", None)
    return inner if type(inner) is dict else span.attributes


def _rollout_of(attributes: Mapping[str, Any]) -> tuple[str, int] | None:
    rollout_id = attributes.get(_ROLLOUT_KEY)
    attempt = attributes.get(_ATTEMPT_KEY)
    if not rollout_id or attempt is None or isinstance(attempt, bool):
        return None
    try:
        return str(rollout_id), int(attempt)
    except (TypeError, ValueError):
        return None


_UNSET = SpanStatus()
# keyed by id(): the enum members are singletons, and Enum.__hash__ runs in Python
_KINDS = {id(k): k.name for k in SpanKind}
_CODES = {id(c): c.name for c in StatusCode}
_MAX_NS = 2**63 - 1


def span_from_otel(span: ReadableSpan, *, rollout_id: str | None = None, attempt: int | None = None) -> Span:
    """Convert a finished OTel SDK span to the store's ``agl.types.Span``.

    Rollout and attempt come from the span's ``agl.rollout.id``/``agl.attempt`` attributes unless
    given; a span with neither raises ``MissingRolloutError`` (a ``ValueError``). Status (ERROR with
    its description), events (exceptions included) and the resource are kept; ids are lowercase hex.

    The span is built without pydantic's per-field validation (this runs for every span agl
    exports): every value is either formatted here (hex ids from the SDK's integers, kind and status
    from its enums) or an attribute the OTel SDK already restricted to str/bool/int/float and
    homogeneous sequences of them (non-finite floats become strings, out-of-range ints strings). What
    is left to check — the rollout id, the attempt, the name, the times — is checked here; a store
    server still validates every span it receives over HTTP.
    """
    attributes = normalise_attributes(_attrs(_raw_attributes(span)))  # names as people see them
    if rollout_id is None or attempt is None:
        found = _rollout_of(attributes)
        if found is None:
            raise MissingRolloutError(
                f"span {span.name!r} has no {_ROLLOUT_KEY}/{_ATTEMPT_KEY}: it was not made inside a rollout"
            )
        rollout_id = rollout_id if rollout_id is not None else found[0]
        attempt = attempt if attempt is not None else found[1]
    ctx = span.get_span_context()
    if ctx is None:
        raise ValueError(f"span {span.name!r} has no span context")
    if not _ID_RE.match(rollout_id):
        raise ValueError(f"span {span.name!r}: invalid rollout id {rollout_id!r}")
    if not 1 <= attempt <= 2**31:
        raise ValueError(f"span {span.name!r}: invalid attempt {attempt!r}")
    name = span.name
    if type(name) is not str or not 1 <= len(name) <= 1024:
        raise ValueError(f"invalid span name {name!r}: 1-1024 characters")
    trace_id, span_id = ctx.trace_id, ctx.span_id
    if not trace_id or not span_id:
        raise ValueError(f"span {name!r} has an invalid (all-zero) trace or span id")
    parent = span.parent
    start = span.start_time or 0
    end = span.end_time if span.end_time is not None else start
    if not 0 <= start <= end <= _MAX_NS:
        raise ValueError(f"span {name!r}: invalid times start={start} end={end}")
    kind = _KINDS.get(id(span.kind))
    if kind is None:  # pragma: no cover - OTel's enum has exactly these
        raise ValueError(f"span {name!r}: unknown kind {span.kind!r}")
    return _construct(
        Span,
        {
            "trace_id": f"{trace_id:032x}",
            "span_id": f"{span_id:016x}",
            "parent_id": f"{parent.span_id:016x}" if parent is not None and parent.span_id else None,
            "name": name,
            "kind": kind,
            "start_ns": start,
            "end_ns": end,
            "status": _status(span),
            "attributes": attributes,
            "events": _events(span),
            "resource": _resource(span.resource),
            "rollout_id": rollout_id,
            "attempt": attempt,
            "seq": None,
            "stale": False,
        },
    )


def _status(span: ReadableSpan) -> SpanStatus:
    status = span.status
    code = _CODES[id(status.status_code)]
    if code == "UNSET" and not status.description:
        return _UNSET
    return _construct(SpanStatus, {"code": code, "message": status.description or None})


def _events(span: ReadableSpan) -> tuple[SpanEvent, ...]:
    raw = getattr(span, "_events", None)  # the SDK's list: the property copies it under a lock
    if raw is not None and not len(raw):
        return ()
    return tuple(
        _construct(
            SpanEvent, {"name": e.name, "time_ns": e.timestamp or 0, "attributes": _attrs(e.attributes)}
        )
        for e in span.events
    )


_RESOURCES: dict[int, tuple[Any, dict[str, Any]]] = {}


def _resource(resource: Any) -> dict[str, Any]:
    """A resource's attributes as a dict: converted once per resource object (all spans share one)."""
    if resource is None:
        return {}
    hit = _RESOURCES.get(id(resource))
    if hit is not None and hit[0] is resource:
        return dict(hit[1])
    attrs = _attrs(resource.attributes)
    if len(_RESOURCES) > 64:
        _RESOURCES.clear()
    _RESOURCES[id(resource)] = (resource, attrs)
    return dict(attrs)
