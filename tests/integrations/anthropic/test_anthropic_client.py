"""The anthropic integration with the real SDK against agl's gateway (scripted backend).

A client ``chat`` span per Messages call (sync, async, ``create(stream=True)``, ``messages.stream``),
``traceparent`` and ``baggage`` on every request so the gateway's span is its child in the rollout,
and ``uninstrument()`` restores the SDK.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

anthropic = pytest.importorskip("anthropic")

import agl  # noqa: E402
from agl import semconv  # noqa: E402
from agl.adapter import Adapter  # noqa: E402
from agl.gateway.testing import ScriptedBackend, reply, serve_gateway, tool_call  # noqa: E402
from agl.tracing import provider as tracing  # noqa: E402

ADD = {"name": "add", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
MSGS = [{"role": "user", "content": "add 1 and 2"}]


def _pair(traced: Any, rid: str, attempt: int) -> tuple[Any, Any]:
    assert tracing.flush(10)
    spans = traced.store.query_spans(rollout_id=rid, attempt=attempt)
    chats = {s.attributes[semconv.AGL_SIDE]: s for s in spans if s.name == semconv.SPAN_CHAT}
    assert set(chats) == {semconv.SIDE_CLIENT, semconv.SIDE_SERVER}
    return chats[semconv.SIDE_CLIENT], chats[semconv.SIDE_SERVER]


def _call(client: Any, how: str) -> None:
    kw = {"model": "scripted", "max_tokens": 128, "tools": [ADD], "messages": MSGS}
    if how == "create":
        client.messages.create(**kw)
    elif how == "create_stream":
        list(client.messages.create(stream=True, **kw))
    elif how == "stream":
        with client.messages.stream(**kw) as s:
            s.get_final_message()


@pytest.mark.parametrize("how", ["create", "create_stream", "stream", "async", "async_stream"])
def test_client_span_is_the_gateway_spans_parent(traced: Any, how: str) -> None:
    rid = f"ro-an-{how}"
    attempt = traced.rollout(rid)
    backend = ScriptedBackend([reply("Adding.", tool_call("add", a=1, b=2))])
    with serve_gateway(backend, traced.store) as url:
        base = url.root
        with agl.rollout_context(rid, attempt):
            if how.startswith("async"):

                async def run() -> None:
                    client = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0)
                    kw = {"model": "scripted", "max_tokens": 128, "tools": [ADD], "messages": MSGS}
                    if how == "async":
                        await client.messages.create(**kw)
                    else:
                        async with client.messages.stream(**kw) as s:
                            await s.get_final_message()

                asyncio.run(run())
            else:
                _call(anthropic.Anthropic(base_url=base, api_key="x", max_retries=0), how)
    client_span, server_span = _pair(traced, rid, attempt)
    assert server_span.trace_id == client_span.trace_id
    # the gateway's span is the client span's child, or (when an SDK with its own OTel tracing put its
    # call span, exported elsewhere, between them) the adapter joins them by response id: one call
    adapter = Adapter()
    (t,) = adapter.transitions(traced.store.query_spans(rollout_id=rid, attempt=attempt))
    assert t.exact and list(t.response_ids) == list(
        server_span.attributes[semconv.AGL_LLM_RESPONSE_TOKEN_IDS]
    )
    assert server_span.parent_id == client_span.span_id or adapter.last_stats.relinked == 1
    a = client_span.attributes
    assert a[semconv.AGL_INTEGRATION] == "anthropic" and a[semconv.GEN_AI_REQUEST_MAX_TOKENS] == 128
    out = json.loads(a[semconv.GEN_AI_OUTPUT_MESSAGES])[0]
    assert out["content"] == "Adding."
    assert json.loads(out["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert a[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ["tool_calls"]
    assert a[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == len(
        server_span.attributes[semconv.AGL_LLM_RESPONSE_TOKEN_IDS]
    )
    assert json.loads(a[semconv.GEN_AI_INPUT_MESSAGES]) == MSGS


def test_uninstrument_restores_the_sdk(traced: Any) -> None:
    from anthropic._base_client import SyncAPIClient

    patched = SyncAPIClient.request
    agl.uninstrument()
    assert SyncAPIClient.request is not patched
    assert not hasattr(SyncAPIClient.request, "__wrapped__")
    with serve_gateway(ScriptedBackend(["hi"]), traced.store) as url:
        anthropic.Anthropic(base_url=url.root, api_key="x", max_retries=0).messages.create(
            model="scripted", max_tokens=8, messages=MSGS
        )
    assert not [s for s in traced.exporter.get_finished_spans() if s.name == semconv.SPAN_CHAT]
