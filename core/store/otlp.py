"""OTLP/HTTP trace ingestion (``POST /v1/traces``): any OpenTelemetry exporter, in any language, feeds the store.

Protobuf bodies are decoded with ``opentelemetry-proto``; OTLP/JSON is turned into the same message
(after the JSON encoding's hex trace/span ids are mapped to protobuf's bytes), so one conversion path
serves both. The rollout and attempt of a span come from its attributes ``agl.rollout.id`` /
``agl.attempt``, else from its resource's. A span without them, or one the store refuses (unknown
rollout, malformed data), is rejected by name in an OTLP partial-success answer — never dropped
silently. Spans are stored per (rollout, attempt) group, each group atomically, with an idempotency key
derived from the request body, so an exporter's retry of the same request is stored once.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

from pydantic import ValidationError

from agl.names import normalise_attributes
from agl.semconv import AGL_ATTEMPT, AGL_ROLLOUT_ID
from agl.store._common import describe_validation_error
from agl.store.base import InvalidInputError, Store, StoreError
from agl.types import Span

__all__ = ["OtlpAnswer", "decode_request", "ingest", "spans_from_request"]

_KINDS = {0: "INTERNAL", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}
_PROTOBUF_TYPES = ("application/x-protobuf", "application/protobuf")
_ID_FIELDS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")
_MAX_LISTED = 5


class OtlpAnswer(NamedTuple):
    status: int
    body: bytes
    media_type: str


def _json_error(status: int, code: str, message: str) -> OtlpAnswer:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    return OtlpAnswer(status, body, "application/json")


# ------------------------------------------------------------------------------------------ decoding


def _decompress(body: bytes, encoding: str, max_bytes: int) -> bytes:
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise _Unsupported(f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none")
    try:
        d = zlib.decompressobj(wbits=47)  # gzip or zlib header, detected
        out = d.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise InvalidInputError(f"body is not valid {encoding} data: {exc}") from None
    if len(out) > max_bytes or d.unconsumed_tail:
        raise _TooLarge(f"decompressed body is over the limit of {max_bytes} bytes")
    return out


class _Unsupported(Exception):
    pass


class _TooLarge(Exception):
    pass


def _hex_to_b64(data: Any, path: str) -> Any:
    """OTLP/JSON writes ids as hex; protobuf's JSON mapping expects base64. Convert in place."""
    if isinstance(data, dict):
        for key, value in data.items():
            if key in _ID_FIELDS and isinstance(value, str):
                try:
                    raw = bytes.fromhex(value)
                except ValueError:
                    raise InvalidInputError(f"{path}.{key}: {value!r} is not a hex id") from None
                data[key] = base64.b64encode(raw).decode()
            elif isinstance(value, (dict, list)):
                _hex_to_b64(value, f"{path}.{key}")
    elif isinstance(data, list):
        for i, item in enumerate(data):
            _hex_to_b64(item, f"{path}[{i}]")
    return data


def decode_request(body: bytes, content_type: str) -> tuple[Any, bool]:
    """Parse an ExportTraceServiceRequest; returns (message, is_json)."""
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    ctype = content_type.split(";", 1)[0].strip().lower()
    if ctype in _PROTOBUF_TYPES:
        try:
            return ExportTraceServiceRequest.FromString(body), False
        except (DecodeError, ValueError) as exc:
            raise InvalidInputError(
                f"body is not a valid OTLP ExportTraceServiceRequest protobuf: {exc}"
            ) from None
    if ctype == "application/json":
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise InvalidInputError(f"body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise InvalidInputError(f"OTLP/JSON body must be an object, got {type(data).__name__}")
        try:
            msg = json_format.ParseDict(
                _hex_to_b64(data, "$"), ExportTraceServiceRequest(), ignore_unknown_fields=True
            )
        except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
            raise InvalidInputError(
                f"body is not a valid OTLP/JSON ExportTraceServiceRequest: {exc}"
            ) from None
        return msg, True
    raise _Unsupported(
        f"unsupported Content-Type {content_type!r} for /v1/traces; use application/x-protobuf or application/json"
    )


# ---------------------------------------------------------------------------------------- conversion


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        items = [_value(x) for x in v.array_value.values]
        if all(isinstance(x, (str, bool, int, float)) for x in items):
            return items
        return json.dumps(items)
    if kind == "kvlist_value":
        return json.dumps({kv.key: _value(kv.value) for kv in v.kvlist_value.values})
    if kind == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    return getattr(v, kind)


def _attrs(key_values: Sequence[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in key_values:
        value = _value(kv.value)
        if value is not None:
            out[kv.key] = value
    return out


def _attempt_number(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _describe(span: Any) -> str:
    return f"span {span.span_id.hex() or '?'} {span.name!r}"


def spans_from_request(msg: Any) -> tuple[list[Span], list[str]]:
    """Convert every span of an ExportTraceServiceRequest; returns (spans, reasons for rejected ones)."""
    spans: list[Span] = []
    rejected: list[str] = []
    for rs in msg.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for ps in ss.spans:
                attrs = normalise_attributes(_attrs(ps.attributes))
                rollout_id = attrs.get(AGL_ROLLOUT_ID, resource.get(AGL_ROLLOUT_ID))
                raw_attempt = attrs.get(AGL_ATTEMPT, resource.get(AGL_ATTEMPT))
                if rollout_id is None or raw_attempt is None:
                    missing = " and ".join(
                        n for n, v in ((AGL_ROLLOUT_ID, rollout_id), (AGL_ATTEMPT, raw_attempt)) if v is None
                    )
                    rejected.append(f"{_describe(ps)}: no {missing} (set it as a span or resource attribute)")
                    continue
                attempt = _attempt_number(raw_attempt)
                if attempt is None or not isinstance(rollout_id, str):
                    rejected.append(
                        f"{_describe(ps)}: {AGL_ROLLOUT_ID}={rollout_id!r} / {AGL_ATTEMPT}={raw_attempt!r} "
                        "are not a rollout id string and an attempt number"
                    )
                    continue
                try:
                    span = Span(
                        trace_id=ps.trace_id.hex(),
                        span_id=ps.span_id.hex(),
                        parent_id=ps.parent_span_id.hex() or None,
                        name=ps.name,
                        kind=_KINDS.get(ps.kind, "INTERNAL"),
                        start_ns=ps.start_time_unix_nano,
                        end_ns=ps.end_time_unix_nano,
                        status={
                            "code": _STATUS.get(ps.status.code, "UNSET"),
                            "message": ps.status.message or None,
                        },
                        attributes=attrs,
                        events=[
                            {"name": e.name, "time_ns": e.time_unix_nano, "attributes": _attrs(e.attributes)}
                            for e in ps.events
                        ],
                        resource=resource,
                        rollout_id=rollout_id,
                        attempt=attempt,
                    )
                except ValidationError as exc:
                    rejected.append(f"{_describe(ps)}: {describe_validation_error(exc)}")
                    continue
                spans.append(span)
    return spans, rejected


# ------------------------------------------------------------------------------------------- ingest


def _answer(rejected: list[str], is_json: bool) -> OtlpAnswer:
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTracePartialSuccess,
        ExportTraceServiceResponse,
    )

    resp = ExportTraceServiceResponse()
    if rejected:
        shown = "; ".join(rejected[:_MAX_LISTED])
        more = len(rejected) - _MAX_LISTED
        message = f"{len(rejected)} span(s) rejected: {shown}" + (f" (and {more} more)" if more > 0 else "")
        resp.partial_success.CopyFrom(
            ExportTracePartialSuccess(rejected_spans=len(rejected), error_message=message)
        )
    if is_json:
        return OtlpAnswer(200, json_format.MessageToJson(resp, indent=None).encode(), "application/json")
    return OtlpAnswer(200, resp.SerializeToString(), "application/x-protobuf")


def ingest(
    store: Store, body: bytes, *, content_type: str, content_encoding: str = "", max_bytes: int
) -> OtlpAnswer:
    """Decode an OTLP/HTTP trace export, store its spans, and build the OTLP answer."""
    try:
        raw = _decompress(body, content_encoding, max_bytes)
        msg, is_json = decode_request(raw, content_type)
    except _Unsupported as exc:
        return _json_error(415, "unsupported_media_type", str(exc))
    except _TooLarge as exc:
        return _json_error(413, "body_too_large", str(exc))
    except StoreError as exc:
        return _json_error(exc.status, exc.code, str(exc))
    spans, rejected = spans_from_request(msg)
    groups: dict[tuple[str, int], list[Span]] = {}
    for span in spans:
        groups.setdefault((span.rollout_id, span.attempt), []).append(span)
    digest = hashlib.sha256(body).hexdigest()[:40]
    for (rollout_id, attempt), group in groups.items():
        try:
            store.add_spans(group, idempotency_key=f"otlp-{digest}-{rollout_id}-{attempt}")
        except StoreError as exc:
            rejected.extend(f"span {s.span_id} {s.name!r}: {exc}" for s in group)
    return _answer(rejected, is_json)
