"""The openai-client integration against a real local OpenAI-protocol server (fake_openai_server)."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import json
import threading

import pytest

openai = pytest.importorskip("openai")

from fake_openai_server import REPLY, TOOL_ARGS, TOOL_NAME, USAGE, serve  # noqa: E402

import agl  # noqa: E402
from agl import semconv  # noqa: E402
from agl.instrumentation import failure_counts  # noqa: E402
from agl.tracing import provider as tracing  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _client(traced, **kw):
    return openai.OpenAI(base_url=traced.base_url, api_key="sk-test", max_retries=0, **kw)


def _aclient(traced):
    return openai.AsyncOpenAI(base_url=traced.base_url, api_key="sk-test", max_retries=0)


def _hex(span, what: str = "span") -> str:
    ctx = span.get_span_context()
    return format(ctx.span_id, "016x") if what == "span" else format(ctx.trace_id, "032x")


def _only_chat_span(traced):
    spans = traced.chat_spans()
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


def _assert_headers_point_at(
    traced, span, request_index: int = -1, rollout: tuple[str, int] | None = None
) -> None:
    headers = traced.fake.requests[request_index].headers
    version, trace_id, parent_id, _flags = headers[semconv.HEADER_TRACEPARENT].split("-")
    assert version == "00"
    assert trace_id == _hex(span, "trace") and parent_id == _hex(span)
    if rollout is not None:
        entries = dict(item.split("=", 1) for item in headers[semconv.HEADER_BAGGAGE].split(","))
        assert entries[semconv.BAGGAGE_ROLLOUT_ID] == rollout[0]
        assert entries[semconv.BAGGAGE_ATTEMPT] == str(rollout[1])


# ------------------------------------------------------------------------------- chat completions


def test_chat_span_contents_headers_and_store(traced) -> None:
    attempt = traced.rollout("ro-chat")
    with agl.rollout_context("ro-chat", attempt):
        reply = _client(traced).chat.completions.create(
            model="m", messages=MESSAGES, temperature=0.5, top_p=0.9, max_tokens=64
        )
    assert reply.choices[0].message.content == REPLY  # the caller's result is untouched
    span = _only_chat_span(traced)
    attrs = span.attributes
    assert span.kind.name == "CLIENT"
    assert attrs[semconv.AGL_SIDE] == semconv.SIDE_CLIENT
    assert attrs[semconv.GEN_AI_OPERATION_NAME] == semconv.OP_CHAT
    assert attrs[semconv.GEN_AI_SYSTEM] == "openai"
    assert attrs[semconv.GEN_AI_REQUEST_MODEL] == "m"
    assert attrs[semconv.GEN_AI_REQUEST_TEMPERATURE] == 0.5
    assert attrs[semconv.GEN_AI_REQUEST_TOP_P] == 0.9
    assert attrs[semconv.GEN_AI_REQUEST_MAX_TOKENS] == 64
    assert json.loads(attrs[semconv.GEN_AI_INPUT_MESSAGES]) == MESSAGES
    assert json.loads(attrs[semconv.GEN_AI_OUTPUT_MESSAGES]) == [{"role": "assistant", "content": REPLY}]
    assert attrs[semconv.GEN_AI_RESPONSE_ID] == reply.id
    assert attrs[semconv.GEN_AI_RESPONSE_MODEL] == "m"
    assert list(attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS]) == ["stop"]
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == USAGE["prompt_tokens"]
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == USAGE["completion_tokens"]
    assert attrs[semconv.AGL_ROLLOUT_ID] == "ro-chat" and attrs[semconv.AGL_ATTEMPT] == attempt
    _assert_headers_point_at(traced, span, rollout=("ro-chat", attempt))
    # the span tree in the store: agl.rollout -> chat
    assert tracing.flush(10)
    stored = {s.name: s for s in traced.store.query_spans(rollout_id="ro-chat")}
    assert set(stored) == {semconv.SPAN_ROLLOUT, semconv.SPAN_CHAT}
    assert stored[semconv.SPAN_CHAT].parent_id == stored[semconv.SPAN_ROLLOUT].span_id
    assert (
        stored[semconv.SPAN_CHAT].attributes[semconv.GEN_AI_OUTPUT_MESSAGES]
        == attrs[semconv.GEN_AI_OUTPUT_MESSAGES]
    )


def test_chat_tool_call(traced) -> None:
    reply = _client(traced).chat.completions.create(model="tool-m", messages=MESSAGES, tools=TOOLS)
    assert reply.choices[0].message.tool_calls[0].function.name == TOOL_NAME
    attrs = _only_chat_span(traced).attributes
    assert json.loads(attrs[semconv.GEN_AI_OUTPUT_MESSAGES]) == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": TOOL_NAME, "arguments": TOOL_ARGS}}
            ],
        }
    ]
    assert json.loads(attrs[semconv.GEN_AI_TOOL_DEFINITIONS]) == TOOLS
    assert list(attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS]) == ["tool_calls"]


def test_stream_makes_one_complete_span_when_exhausted(traced) -> None:
    with agl.rollout_context("ro-stream", 1):
        stream = _client(traced).chat.completions.create(
            model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
        assert traced.chat_spans() == []  # still open while the caller has not read the stream
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == REPLY
    span = _only_chat_span(traced)
    attrs = span.attributes
    assert json.loads(attrs[semconv.GEN_AI_OUTPUT_MESSAGES]) == [{"role": "assistant", "content": REPLY}]
    assert list(attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS]) == ["stop"]
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == USAGE["completion_tokens"]
    assert attrs[semconv.GEN_AI_RESPONSE_ID].startswith("chatcmpl-")
    _assert_headers_point_at(traced, span, rollout=("ro-stream", 1))


def test_stream_tool_call_arguments_are_assembled(traced) -> None:
    stream = _client(traced).chat.completions.create(
        model="tool-m", messages=MESSAGES, tools=TOOLS, stream=True
    )
    chunks = list(stream)
    assert len(chunks) > 3
    (message,) = json.loads(_only_chat_span(traced).attributes[semconv.GEN_AI_OUTPUT_MESSAGES])
    assert message["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": TOOL_NAME, "arguments": TOOL_ARGS}}
    ]


def test_stream_closed_early_ends_the_span(traced) -> None:
    with _client(traced).chat.completions.create(model="m", messages=MESSAGES, stream=True) as stream:
        next(iter(stream))
        next(iter(stream))
    span = _only_chat_span(traced)
    assert span.end_time is not None
    assert json.loads(span.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == REPLY.split(" ")[0]


def test_stream_never_read_ends_the_span_when_collected(traced) -> None:
    stream = _client(traced).chat.completions.create(model="m", messages=MESSAGES, stream=True)
    assert traced.chat_spans() == []
    stream.response.close()
    del stream
    gc.collect()
    assert len(traced.chat_spans()) == 1


def test_stream_helper(traced) -> None:
    with _client(traced).chat.completions.stream(model="m", messages=MESSAGES) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == REPLY
    assert (
        json.loads(_only_chat_span(traced).attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == REPLY
    )


def test_raw_response_as_langchain_uses_it(traced) -> None:
    client = _client(traced)
    raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
    assert raw.parse().choices[0].message.content == REPLY
    raw_stream = client.chat.completions.with_raw_response.create(
        model="tool-m", messages=MESSAGES, stream=True
    )
    assert len(list(raw_stream.parse())) > 3
    first, second = traced.chat_spans()
    assert json.loads(first.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == REPLY
    tool_calls = json.loads(second.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["tool_calls"]
    assert tool_calls[0]["function"]["arguments"] == TOOL_ARGS


# ---------------------------------------------------------------------------------------- responses


def test_responses_create(traced) -> None:
    client = _client(traced)
    reply = client.responses.create(model="m", input="hello", instructions="be brief", max_output_tokens=32)
    assert reply.output_text == REPLY
    client.responses.create(model="tool-m", input=[{"role": "user", "content": "weather?"}], tools=[])
    text_span, tool_span = traced.chat_spans()
    attrs = text_span.attributes
    assert json.loads(attrs[semconv.GEN_AI_INPUT_MESSAGES]) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    assert json.loads(attrs[semconv.GEN_AI_OUTPUT_MESSAGES]) == [{"role": "assistant", "content": REPLY}]
    assert attrs[semconv.GEN_AI_REQUEST_MAX_TOKENS] == 32
    assert attrs[semconv.GEN_AI_RESPONSE_ID] == reply.id
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 11 and attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 7
    tool_attrs = tool_span.attributes
    assert json.loads(tool_attrs[semconv.GEN_AI_INPUT_MESSAGES]) == [{"role": "user", "content": "weather?"}]
    (message,) = json.loads(tool_attrs[semconv.GEN_AI_OUTPUT_MESSAGES])
    assert message["tool_calls"][0]["id"] == "call_1"
    assert message["tool_calls"][0]["function"] == {"name": TOOL_NAME, "arguments": TOOL_ARGS}
    assert list(tool_attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS]) == ["tool_calls"]
    _assert_headers_point_at(traced, tool_span)


def test_responses_stream(traced) -> None:
    stream = _client(traced).responses.create(model="m", input="hello", stream=True)
    assert traced.chat_spans() == []
    events = [e.type for e in stream]
    assert events[0] == "response.created" and events[-1] == "response.completed"
    attrs = _only_chat_span(traced).attributes
    assert json.loads(attrs[semconv.GEN_AI_OUTPUT_MESSAGES]) == [{"role": "assistant", "content": REPLY}]
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 7


# -------------------------------------------------------------------------------------------- async


async def test_async_chat_stream_and_responses(traced) -> None:
    client = _aclient(traced)
    async with agl.rollout_context("ro-async", 1):
        reply = await client.chat.completions.create(model="m", messages=MESSAGES)
        stream = await client.chat.completions.create(model="tool-m", messages=MESSAGES, stream=True)
        chunks = [c async for c in stream]
        rstream = await client.responses.create(model="m", input="hi", stream=True)
        events = [e async for e in rstream]
    assert reply.choices[0].message.content == REPLY and chunks and events
    plain, streamed, responses = traced.chat_spans()
    assert json.loads(plain.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == REPLY
    tool_calls = json.loads(streamed.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["tool_calls"]
    assert tool_calls[0]["function"]["arguments"] == TOOL_ARGS
    assert json.loads(responses.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == REPLY
    for i, span in enumerate((plain, streamed, responses)):
        assert span.attributes[semconv.AGL_ROLLOUT_ID] == "ro-async"
        _assert_headers_point_at(traced, span, request_index=i, rollout=("ro-async", 1))
    await client.close()


async def test_async_stream_closed_early(traced) -> None:
    client = _aclient(traced)
    stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    async for _ in stream:
        break
    await stream.close()
    assert traced.chat_spans()[0].end_time is not None
    await client.close()


# -------------------------------------------------------------------------------------------- errors


def test_http_error_gives_error_span_and_the_same_exception(traced) -> None:
    client = _client(traced)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fail-400", messages=MESSAGES)
    assert info.value.status_code == 400 and "bad model" in str(info.value)
    span = _only_chat_span(traced)
    assert span.status.status_code.name == "ERROR"
    assert span.attributes[semconv.ERROR_TYPE] == "BadRequestError"
    (event,) = span.events
    assert event.name == "exception" and event.attributes["exception.type"].endswith("BadRequestError")
    agl.uninstrument()
    with pytest.raises(openai.BadRequestError) as plain:
        client.chat.completions.create(model="fail-400", messages=MESSAGES)
    assert str(plain.value) == str(info.value)


def test_error_mid_stream_gives_error_span(traced) -> None:
    stream = _client(traced).chat.completions.create(model="fail-stream", messages=MESSAGES, stream=True)
    with pytest.raises(openai.APIError, match="fell over"):
        list(stream)
    span = _only_chat_span(traced)
    assert span.status.status_code.name == "ERROR"
    assert "fell over" in span.status.description


async def test_async_error_gives_error_span(traced) -> None:
    client = _aclient(traced)
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="fail-400", input="x")
    assert _only_chat_span(traced).status.status_code.name == "ERROR"
    await client.close()


def test_connection_error_gives_error_span(traced) -> None:
    with serve() as (_, url):
        pass  # the server is gone: nothing listens on that port any more
    client = openai.OpenAI(base_url=url, api_key="sk-test", max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert _only_chat_span(traced).status.status_code.name == "ERROR"


# ------------------------------------------------------------------------------ instrument lifecycle


def test_instrument_twice_gives_one_span_and_one_header(traced) -> None:
    assert agl.instrument("openai", tracer_provider=traced.provider) == ["openai"]
    assert "openai" in agl.instrument(tracer_provider=traced.provider)
    _client(traced).chat.completions.create(model="m", messages=MESSAGES)
    assert len(traced.chat_spans()) == 1
    raw = traced.fake.requests[-1].headers[semconv.HEADER_TRACEPARENT]
    assert "," not in raw and raw.count("-") == 3


def test_uninstrument_leaves_no_spans_and_no_headers(traced) -> None:
    assert agl.uninstrument("openai") == ["openai"]
    client = _client(traced)
    with agl.rollout_context("ro-off", 1, span=False):
        client.chat.completions.create(model="m", messages=MESSAGES)
        list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert traced.chat_spans() == []
    for request in traced.fake.requests:
        assert semconv.HEADER_TRACEPARENT not in request.headers
        assert semconv.HEADER_BAGGAGE not in request.headers
    # and back on again
    agl.instrument("openai", tracer_provider=traced.provider)
    client.chat.completions.create(model="m", messages=MESSAGES)
    assert len(traced.chat_spans()) == 1
    assert semconv.HEADER_TRACEPARENT in traced.fake.requests[-1].headers


def test_caller_headers_win_and_other_requests_get_headers_but_no_span(traced) -> None:
    mine = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    client = _client(traced, default_headers={"traceparent": mine})
    client.chat.completions.create(model="m", messages=MESSAGES)
    assert traced.fake.requests[-1].headers[semconv.HEADER_TRACEPARENT] == mine
    with agl.rollout_context("ro-models", 1, span=False):
        _client(traced).models.list()
    assert len(traced.chat_spans()) == 1  # listing models is no LLM call
    assert "agl.rollout.id=ro-models" in traced.fake.requests[-1].headers[semconv.HEADER_BAGGAGE]


def test_outside_a_rollout_the_span_is_made_without_baggage(traced) -> None:
    _client(traced).chat.completions.create(model="m", messages=MESSAGES)
    span = _only_chat_span(traced)
    assert semconv.AGL_ROLLOUT_ID not in span.attributes
    assert semconv.HEADER_BAGGAGE not in traced.fake.requests[-1].headers
    _assert_headers_point_at(traced, span)


# ----------------------------------------------------------------------------- context propagation


def test_rollout_travels_with_threads_started_with_copied_context(traced) -> None:
    client = _client(traced)
    threads = []
    for rid in ("ro-th1", "ro-th2", "ro-th3"):
        with agl.rollout_context(rid, 2, span=False):
            threads.append(
                threading.Thread(
                    target=contextvars.copy_context().run,
                    args=(client.chat.completions.create,),
                    kwargs={"model": rid, "messages": MESSAGES},
                )
            )
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_model = {r.body["model"]: r.headers[semconv.HEADER_BAGGAGE] for r in traced.fake.requests}
    for rid in ("ro-th1", "ro-th2", "ro-th3"):
        assert f"agl.rollout.id={rid}" in by_model[rid] and "agl.attempt=2" in by_model[rid]
    spans = {s.attributes[semconv.GEN_AI_REQUEST_MODEL]: s for s in traced.chat_spans()}
    assert {m: s.attributes[semconv.AGL_ROLLOUT_ID] for m, s in spans.items()} == {m: m for m in by_model}


async def test_rollout_travels_with_asyncio_tasks(traced) -> None:
    client = _aclient(traced)

    async def agent(rid: str) -> None:
        async with agl.rollout_context(rid, 1):
            await asyncio.gather(
                asyncio.create_task(client.chat.completions.create(model=rid, messages=MESSAGES)),
                asyncio.create_task(client.responses.create(model=rid, input="x")),
            )

    await asyncio.gather(agent("ro-task1"), agent("ro-task2"))
    assert len(traced.fake.requests) == 4
    for request in traced.fake.requests:
        assert f"agl.rollout.id={request.body['model']}" in request.headers[semconv.HEADER_BAGGAGE]
    roots = {
        s.attributes[semconv.AGL_ROLLOUT_ID]: s
        for s in traced.exporter.get_finished_spans()
        if s.name == semconv.SPAN_ROLLOUT
    }
    for span in traced.chat_spans():
        root = roots[span.attributes[semconv.AGL_ROLLOUT_ID]]
        assert span.parent.span_id == root.get_span_context().span_id
    await client.close()


def test_a_failure_inside_agl_never_breaks_the_call(traced, monkeypatch, caplog) -> None:
    from agl.integrations.openai import instrumentor

    def broken(*args, **kwargs):
        raise RuntimeError("agl bug")

    monkeypatch.setattr(instrumentor, "request_attributes", broken)
    before = failure_counts("openai.request").get("openai.request", 0)
    with caplog.at_level("WARNING", logger="agl.instrumentation"):
        reply = _client(traced).chat.completions.create(model="m", messages=MESSAGES)
    assert reply.choices[0].message.content == REPLY
    assert traced.chat_spans() == []
    assert failure_counts("openai.request")["openai.request"] == before + 1  # counted, logged once per site
    assert before > 0 or any("agl bug" in r.getMessage() for r in caplog.records)
