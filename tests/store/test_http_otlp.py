"""OTLP/HTTP ingestion at /v1/traces: the real OpenTelemetry exporter feeds the store.

Spans carry their rollout/attempt as resource or span attributes; spans without them are rejected by
name in an OTLP partial-success answer (protobuf or JSON, as the request was).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from agl.semconv import AGL_ATTEMPT, AGL_ROLLOUT_ID, GEN_AI_TOOL_NAME, SPAN_EXECUTE_TOOL, SPAN_INVOKE_AGENT
from agl.store.memory import MemoryStore
from agl.store.server import serve_in_thread
from agl.types import NewRollout

PROTOBUF = {"content-type": "application/x-protobuf"}


@pytest.fixture
def served() -> Iterator[tuple[MemoryStore, str, str]]:
    store = MemoryStore()
    rid = store.enqueue([NewRollout()])[0].id
    store.claim("w")
    with serve_in_thread(store, token="tok", max_body_bytes=256 * 1024) as url:
        yield store, url, rid


def provider(url: str, resource: dict[str, object]) -> TracerProvider:
    tp = TracerProvider(resource=Resource.create(resource))  # type: ignore[arg-type]
    exporter = OTLPSpanExporter(endpoint=f"{url}/v1/traces", headers={"authorization": "Bearer tok"})
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    return tp


def recorded(resource: dict[str, object], build: object) -> list[ReadableSpan]:
    """Readable spans made by the real SDK (for hand-posted OTLP bodies)."""
    mem = InMemorySpanExporter()
    tp = TracerProvider(resource=Resource.create(resource))  # type: ignore[arg-type]
    tp.add_span_processor(SimpleSpanProcessor(mem))
    build(tp.get_tracer("t"))  # type: ignore[operator]
    tp.shutdown()
    return list(mem.get_finished_spans())


def test_sdk_exporter_spans_land_with_rollout_from_resource(served: tuple[MemoryStore, str, str]) -> None:
    store, url, rid = served
    tp = provider(url, {"service.name": "agent-svc", AGL_ROLLOUT_ID: rid, AGL_ATTEMPT: 1})
    tracer = tp.get_tracer("test")
    with tracer.start_as_current_span(SPAN_INVOKE_AGENT, kind=SpanKind.INTERNAL) as agent:
        agent.set_attribute("gen_ai.agent.name", "writer\n")  # a YAML-folded name: stored trimmed
        with tracer.start_as_current_span(SPAN_EXECUTE_TOOL, kind=SpanKind.CLIENT) as tool:
            tool.set_attribute(GEN_AI_TOOL_NAME, "search")
            tool.set_attribute("ids", [1, 2, 3])
            tool.add_event("retry", {"n": 2})
            tool.set_status(Status(StatusCode.ERROR, "tool failed"))
    assert tp.force_flush(10_000)
    tp.shutdown()

    spans = store.query_spans(rollout_id=rid)
    assert [s.name for s in spans] == [SPAN_EXECUTE_TOOL, SPAN_INVOKE_AGENT]  # export order: child ends first
    tool_span, agent_span = spans
    assert tool_span.parent_id == agent_span.span_id and tool_span.trace_id == agent_span.trace_id
    assert agent_span.parent_id is None
    assert (
        tool_span.kind == "CLIENT"
        and tool_span.status.code == "ERROR"
        and tool_span.status.message == "tool failed"
    )
    assert tool_span.attributes[GEN_AI_TOOL_NAME] == "search" and tool_span.attributes["ids"] == [1, 2, 3]
    assert tool_span.events[0].name == "retry" and tool_span.events[0].attributes == {"n": 2}
    assert tool_span.resource["service.name"] == "agent-svc" and tool_span.resource[AGL_ROLLOUT_ID] == rid
    assert agent_span.attributes["gen_ai.agent.name"] == "writer"
    assert agent_span.attributes["agl.agent.name.raw"] == "writer\n"  # agl.names keeps the raw value
    assert [s.seq for s in spans] == [1, 2] and tool_span.attempt == 1
    assert tool_span.end_ns >= tool_span.start_ns > 0


def test_span_attributes_name_the_rollout_when_the_resource_does_not(
    served: tuple[MemoryStore, str, str],
) -> None:
    store, url, rid = served
    other = store.enqueue([NewRollout()])[0].id
    store.claim("w")
    tp = provider(url, {"service.name": "shared-worker"})
    tracer = tp.get_tracer("test")
    for target in (rid, other):
        with tracer.start_as_current_span("step") as sp:
            sp.set_attribute(AGL_ROLLOUT_ID, target)
            sp.set_attribute(AGL_ATTEMPT, "1")  # a string attempt number is accepted
    assert tp.force_flush(10_000)
    tp.shutdown()
    assert [s.name for s in store.query_spans(rollout_id=rid)] == ["step"]
    assert [s.name for s in store.query_spans(rollout_id=other)] == ["step"]


def test_spans_without_rollout_are_rejected_by_name(served: tuple[MemoryStore, str, str]) -> None:
    store, url, rid = served

    def build(tracer: object) -> None:
        with tracer.start_as_current_span("orphan"):  # type: ignore[attr-defined]
            pass
        with tracer.start_as_current_span("kept") as sp:  # type: ignore[attr-defined]
            sp.set_attribute(AGL_ROLLOUT_ID, rid)
            sp.set_attribute(AGL_ATTEMPT, 1)
        with tracer.start_as_current_span("unknown-rollout") as sp:  # type: ignore[attr-defined]
            sp.set_attribute(AGL_ROLLOUT_ID, "ro-nowhere")
            sp.set_attribute(AGL_ATTEMPT, 1)

    spans = recorded({"service.name": "x"}, build)
    orphan_id = format(spans[0].context.span_id, "016x")
    body = encode_spans(spans).SerializeToString()
    r = httpx.post(f"{url}/v1/traces", content=body, headers={**PROTOBUF, "authorization": "Bearer tok"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-protobuf"
    answer = ExportTraceServiceResponse.FromString(r.content)
    assert answer.partial_success.rejected_spans == 2
    msg = answer.partial_success.error_message
    assert orphan_id in msg and "'orphan'" in msg and AGL_ROLLOUT_ID in msg
    assert "ro-nowhere" in msg and "not found" in msg
    assert [s.name for s in store.query_spans()] == ["kept"]

    # the exporter retrying the same request stores nothing twice
    again = httpx.post(f"{url}/v1/traces", content=body, headers={**PROTOBUF, "authorization": "Bearer tok"})
    assert again.status_code == 200 and [s.name for s in store.query_spans()] == ["kept"]


def test_otlp_json_with_hex_ids(served: tuple[MemoryStore, str, str]) -> None:
    store, url, rid = served
    body = {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [
                        {"key": AGL_ROLLOUT_ID, "value": {"stringValue": rid}},
                        {"key": AGL_ATTEMPT, "value": {"intValue": "1"}},
                    ]
                },
                "scopeSpans": [
                    {
                        "scope": {"name": "js-agent"},
                        "spans": [
                            {
                                "traceId": "5b8efff798038103d269b633813fc60c",
                                "spanId": "eee19b7ec3c1b174",
                                "parentSpanId": "",
                                "name": "chat",
                                "kind": 3,
                                "startTimeUnixNano": "1544712660000000000",
                                "endTimeUnixNano": "1544712661000000000",
                                "attributes": [
                                    {"key": "gen_ai.request.model", "value": {"stringValue": "m"}},
                                    {
                                        "key": "meta",
                                        "value": {
                                            "kvlistValue": {
                                                "values": [{"key": "a", "value": {"intValue": 1}}]
                                            }
                                        },
                                    },
                                ],
                                "status": {"code": "STATUS_CODE_OK"},
                            },
                            {
                                "traceId": "5b8efff798038103d269b633813fc60c",
                                "spanId": "eee19b7ec3c1b175",
                                "name": "bad-times",
                                "startTimeUnixNano": "20",
                                "endTimeUnixNano": "10",
                            },
                        ],
                    }
                ],
            }
        ]
    }
    r = httpx.post(f"{url}/v1/traces", json=body, headers={"authorization": "Bearer tok"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    partial = r.json()["partialSuccess"]
    assert int(partial["rejectedSpans"]) == 1 and "eee19b7ec3c1b175" in partial["errorMessage"]
    assert "ends" in partial["errorMessage"]
    (span,) = store.query_spans(rollout_id=rid)
    assert span.trace_id == "5b8efff798038103d269b633813fc60c" and span.span_id == "eee19b7ec3c1b174"
    assert span.kind == "CLIENT" and span.status.code == "OK" and span.parent_id is None
    assert span.start_ns == 1544712660000000000 and span.attributes["gen_ai.request.model"] == "m"
    assert json.loads(span.attributes["meta"]) == {"a": 1}


def test_gzip_bodies_and_bad_bodies(served: tuple[MemoryStore, str, str]) -> None:
    store, url, rid = served
    auth = {"authorization": "Bearer tok"}

    def build(tracer: object) -> None:
        with tracer.start_as_current_span("zipped"):  # type: ignore[attr-defined]
            pass

    raw = encode_spans(recorded({AGL_ROLLOUT_ID: rid, AGL_ATTEMPT: 1}, build)).SerializeToString()
    r = httpx.post(
        f"{url}/v1/traces",
        content=gzip.compress(raw),
        headers={**PROTOBUF, **auth, "content-encoding": "gzip"},
    )
    assert r.status_code == 200 and not ExportTraceServiceResponse.FromString(r.content).HasField(
        "partial_success"
    )
    assert [s.name for s in store.query_spans()] == ["zipped"]
    before = [s.model_dump() for s in store.query_spans()]

    def err(resp: httpx.Response, status: int, needle: str) -> None:
        assert resp.status_code == status, resp.text
        assert needle in resp.json()["error"]["message"]

    err(
        httpx.post(f"{url}/v1/traces", content=b"\xff\xff\xff", headers={**PROTOBUF, **auth}), 400, "protobuf"
    )
    err(
        httpx.post(f"{url}/v1/traces", content=b"{", headers={"content-type": "application/json", **auth}),
        400,
        "JSON",
    )
    err(
        httpx.post(
            f"{url}/v1/traces",
            json={"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]},
            headers=auth,
        ),
        400,
        "hex",
    )
    err(
        httpx.post(f"{url}/v1/traces", content=b"x", headers={"content-type": "text/plain", **auth}),
        415,
        "Content-Type",
    )
    err(
        httpx.post(f"{url}/v1/traces", content=raw, headers={**PROTOBUF, **auth, "content-encoding": "br"}),
        415,
        "br",
    )
    err(
        httpx.post(
            f"{url}/v1/traces", content=b"not gzip", headers={**PROTOBUF, **auth, "content-encoding": "gzip"}
        ),
        400,
        "gzip",
    )
    bomb = gzip.compress(b"\0" * (2 * 1024 * 1024))  # small on the wire, 2 MiB unpacked > 256 KiB limit
    err(
        httpx.post(
            f"{url}/v1/traces", content=bomb, headers={**PROTOBUF, **auth, "content-encoding": "gzip"}
        ),
        413,
        "limit",
    )
    assert [s.model_dump() for s in store.query_spans()] == before
