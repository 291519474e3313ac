"""Client span (this integration) + gateway server span: joined through traceparent and baggage."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

import agl  # noqa: E402
from agl import semconv  # noqa: E402
from agl.gateway.testing import ScriptedBackend, reply, serve_gateway, tool_call  # noqa: E402
from agl.tracing import provider as tracing  # noqa: E402

MESSAGES = [{"role": "user", "content": "add 1 and 2"}]


@pytest.mark.parametrize("stream", [False, True])
def test_gateway_span_is_the_child_of_the_client_span(traced, stream: bool) -> None:
    attempt = traced.rollout("ro-gw")
    backend = ScriptedBackend([reply(None, tool_call("add", a=1, b=2))])
    with serve_gateway(backend, traced.store) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="sk-test", max_retries=0)
        with agl.rollout_context("ro-gw", attempt):
            result = client.chat.completions.create(model="scripted", messages=MESSAGES, stream=stream)
            if stream:
                list(result)
    assert tracing.flush(10)
    spans = traced.store.query_spans(rollout_id="ro-gw", attempt=attempt)
    chats = {s.attributes[semconv.AGL_SIDE]: s for s in spans if s.name == semconv.SPAN_CHAT}
    assert set(chats) == {semconv.SIDE_CLIENT, semconv.SIDE_SERVER}
    client_span, server_span = chats[semconv.SIDE_CLIENT], chats[semconv.SIDE_SERVER]
    assert server_span.parent_id == client_span.span_id
    assert server_span.trace_id == client_span.trace_id
    root = next(s for s in spans if s.name == semconv.SPAN_ROLLOUT)
    assert client_span.parent_id == root.span_id
    # both sides saw the same tool call
    client_out = json.loads(client_span.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])
    assert client_out[0]["tool_calls"][0]["function"]["name"] == "add"
    assert json.loads(client_out[0]["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert server_span.attributes[semconv.AGL_LLM_RESPONSE_TOKEN_IDS]
