"""True streaming through the vllm/openai backends (fake vLLM upstream), and the span writer.

The gateway forwards each upstream chunk as it arrives, collects token ids and logprobs from the
stream for the span, cancels the upstream when the client goes away, and stores spans from a writer
thread without losing any at a clean shutdown.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM
from gw_helpers import ADD_TOOL, server_spans, start_rollout

import agl.store
from agl import semconv as sc
from agl.chat.format import render_tool_call
from agl.chat.tokenizer import load_default_tokenizer
from agl.gateway.backends.openai import OpenAIBackend
from agl.gateway.backends.vllm import VLLMBackend
from agl.gateway.testing import ScriptedBackend, serve_asgi, serve_gateway

openai = pytest.importorskip("openai")

TOK = load_default_tokenizer()
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
LONG = "One two three four five six seven eight nine ten eleven twelve."
MSG = [{"role": "user", "content": "count"}]


@pytest.fixture
def slow_upstream() -> Iterator[tuple[FakeVLLM, str]]:
    fake = FakeVLLM([LONG], token_delay_s=0.05)
    with serve_asgi(fake.app) as root:
        yield fake, root


def test_chunks_arrive_while_the_upstream_generates(
    store: Any, rollout: tuple[str, int], slow_upstream: tuple[FakeVLLM, str]
) -> None:
    fake, root = slow_upstream
    with serve_gateway(VLLMBackend(root), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
        plain = client.chat.completions.create(model=MODEL, messages=MSG)
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=MODEL,
            messages=MSG,
            stream=True,
            logprobs=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
        arrivals, chunks = [], []
        for chunk in stream:
            arrivals.append(time.perf_counter() - t0)
            chunks.append(chunk)
    n_tokens = len(TOK.encode(LONG)) + 1
    first_content = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content)
    # the upstream paces tokens 50 ms apart: the first text comes long before the last token
    assert arrivals[first_content] < arrivals[-1] - 0.4, (arrivals[first_content], arrivals[-1])
    assert len([c for c in chunks if c.choices]) >= n_tokens  # chunk by chunk, not replayed
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content == LONG
    # the client asked for ids and logprobs: they come per chunk, as vLLM sends them
    streamed_ids = [
        i for c in chunks if c.choices for i in (c.choices[0].model_extra or {}).get("token_ids") or []
    ]
    assert streamed_ids == TOK.encode(LONG) + [TOK.eos_token_id]
    assert chunks[0].model_extra and chunks[0].model_extra["prompt_token_ids"] == TOK.encode(TOK.render(MSG))
    lps = [
        e.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert lps == pytest.approx([-0.05 * (k + 1) for k in range(n_tokens)])
    assert next(c.usage for c in chunks if c.usage).completion_tokens == n_tokens
    # the streamed call's span has the same ids and logprobs as the plain call's
    s_plain, s_stream = server_spans(store, rollout[0])
    for key in (sc.AGL_LLM_PROMPT_TOKEN_IDS, sc.AGL_LLM_RESPONSE_TOKEN_IDS, sc.AGL_LLM_RESPONSE_LOGPROBS):
        assert s_stream.attributes[key] == s_plain.attributes[key], key
    assert s_stream.attributes[sc.AGL_LLM_EXACT] is True
    assert json.loads(s_stream.attributes[sc.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == LONG
    assert fake.requests[1][1]["stream"] is True


def test_streamed_tool_call_deltas(store: Any, rollout: tuple[str, int]) -> None:
    fake = FakeVLLM([render_tool_call("add", {"a": 2, "b": 3})])
    with serve_asgi(fake.app) as root, serve_gateway(VLLMBackend(root), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
        chunks = list(
            client.chat.completions.create(model=MODEL, messages=MSG, tools=[ADD_TOOL], stream=True)  # type: ignore[list-item]
        )
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert len(deltas) >= 3  # the header, then the arguments in pieces
    assert deltas[0].function.name == "add" and deltas[0].id
    args = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(args) == {"a": 2, "b": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    (span,) = server_spans(store, rollout[0])
    (out,) = json.loads(span.attributes[sc.GEN_AI_OUTPUT_MESSAGES])
    (call,) = out["tool_calls"]
    assert call["id"] == deltas[0].id and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    ids = TOK.encode(render_tool_call("add", {"a": 2, "b": 3})) + [TOK.eos_token_id]
    assert span.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS] == ids
    assert span.attributes[sc.GEN_AI_RESPONSE_FINISH_REASONS] == ["tool_calls"]


def test_disconnect_mid_stream_cancels_the_upstream_and_records_an_error(
    store: Any, rollout: tuple[str, int]
) -> None:
    fake = FakeVLLM([" ".join(["word"] * 200)], token_delay_s=0.05)
    with serve_asgi(fake.app) as root, serve_gateway(VLLMBackend(root), store) as url:
        with httpx.Client(timeout=10) as http:
            with http.stream(
                "POST",
                url.for_rollout(*rollout) + "/chat/completions",
                json={"model": MODEL, "messages": MSG, "stream": True},
            ) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                got = [next(lines) for _ in range(6)]  # a few chunks, then hang up
        assert any(line.startswith("data: {") for line in got)
        assert fake.stream_cancelled.wait(10), "the upstream stream was not cancelled"
        stats = url.gateway.stats
        for _ in range(500):
            if stats["cancelled_calls"]:
                break
            time.sleep(0.01)
        assert stats["cancelled_calls"] == 1
    assert fake.streamed_tokens < 100  # generation stopped well before the 200-word reply's end
    (span,) = server_spans(store, rollout[0])
    assert span.status.code == "ERROR" and "disconnected" in (span.status.message or "")


def test_stream_refusals_are_plain_http_errors(store: Any, rollout: tuple[str, int]) -> None:
    fake = FakeVLLM(["x"])
    with serve_asgi(fake.app) as root, serve_gateway(VLLMBackend(root), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x " * 3000}], stream=True
            )
        assert "maximum context length" in str(info.value)
        fake.fail_next = 1
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(model=MODEL, messages=MSG, stream=True)
        assert err.value.status_code == 502
    (span,) = server_spans(store, rollout[0])  # bad input: nothing; the upstream's 500: an ERROR span
    assert span.status.code == "ERROR" and "EngineCore" in (span.status.message or "")


def test_openai_backend_streams_text_only(store: Any, rollout: tuple[str, int]) -> None:
    fake = FakeVLLM(["Hi there."])
    with serve_asgi(fake.app) as root, serve_gateway(OpenAIBackend(root + "/v1", api_key="k"), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
        chunks = list(client.chat.completions.create(model=MODEL, messages=MSG, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hi there."
    assert fake.requests[0][1]["stream"] is True
    (span,) = server_spans(store, rollout[0])
    assert span.attributes[sc.AGL_LLM_EXACT] is False
    assert sc.AGL_LLM_RESPONSE_TOKEN_IDS not in span.attributes
    assert span.attributes[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == len(TOK.encode("Hi there.")) + 1


# ------------------------------------------------------------------------------- span writer


@pytest.mark.parametrize("in_loop", [True, False], ids=["in-loop", "writer-thread"])
def test_no_span_lost_at_clean_shutdown(tmp_path: Path, in_loop: bool) -> None:
    """Spans written after the reply, batched (on the event loop for SQLite, or by the writer thread
    that network stores use), are all stored once the gateway stops."""
    store = agl.store.open(f"sqlite:///{tmp_path / 'spans.db'}")
    ros = [start_rollout(store, f"ro-{i}") for i in range(4)]
    calls = 0
    with serve_gateway(
        ScriptedBackend(["ok"], on_exhausted="repeat"), store, span_writes="after_reply"
    ) as url:
        assert url.gateway.span_writes == "after_reply"
        assert url.gateway.writer.in_loop  # SQLite is written on the loop by default
        url.gateway.writer.in_loop = in_loop  # before the first request: the other path
        writes = 0
        add_spans = store.add_spans

        def counting(spans: Any, **kw: Any) -> Any:
            nonlocal writes
            writes += 1
            return add_spans(spans, **kw)

        store.add_spans = counting  # type: ignore[method-assign]

        def agent(r: tuple[str, int]) -> None:
            nonlocal calls
            client = openai.OpenAI(base_url=url.for_rollout(*r), api_key="x", max_retries=0)
            for _ in range(25):
                client.chat.completions.create(model="scripted", messages=MSG)
                calls += 1

        threads = [threading.Thread(target=agent, args=(r,)) for r in ros]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert calls == 100
    stored = sum(len(server_spans(store, r[0])) for r in ros)
    assert stored == 100 and url.gateway.stats["spans_stored"] == 100
    assert 1 <= writes <= 100
    store.close()


def test_busy_store_does_not_block_the_event_loop(tmp_path: Path) -> None:
    """SQLite spans are written on the loop, but not while another thread holds the store: then the
    writer thread takes the batch, the loop keeps serving, and the span is still stored before the reply."""
    store = agl.store.open(f"sqlite:///{tmp_path / 'spans.db'}")
    rollout = start_rollout(store, "ro-busy")
    with serve_gateway(ScriptedBackend(["ok"], on_exhausted="repeat"), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
        client.chat.completions.create(model="scripted", messages=MSG)  # written on the loop
        assert url.gateway.writer._thread is None
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with store._lock:  # type: ignore[attr-defined]  # e.g. a long query from a trainer thread
                held.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(5)
        answered: list[float] = []

        def call() -> None:
            client.chat.completions.create(model="scripted", messages=MSG)
            answered.append(time.monotonic())

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.5)  # the call's span waits for the store; the loop must not
        t0 = time.monotonic()
        r = httpx.get(url.root + "/v1/models", timeout=5)
        assert r.status_code == 200 and time.monotonic() - t0 < 2.0
        assert not answered  # before_reply: no answer while its span cannot be stored
        release.set()
        holder.join(5)
        caller.join(10)
        assert answered and url.gateway.writer._thread is not None
        assert len(server_spans(store, rollout[0])) == 2
    store.close()


def test_overlapping_calls_share_commits_and_each_span_is_stored_before_its_reply(tmp_path: Path) -> None:
    """SQLite spans of calls that overlap go to the writer thread, which writes everything that queued
    meanwhile in one add_spans (one commit); each reply still leaves only once its span is stored, and
    the thread is stopped at shutdown with nothing left queued."""
    store = agl.store.open(f"sqlite:///{tmp_path / 'spans.db'}")
    ros = [start_rollout(store, f"ro-{i}") for i in range(8)]
    add_spans = store.add_spans

    def slow(spans: Any, **kw: Any) -> Any:
        time.sleep(0.02)  # a commit that takes a while: calls finishing meanwhile queue behind it
        return add_spans(spans, **kw)

    store.add_spans = slow  # type: ignore[method-assign]
    missing: list[str] = []
    with serve_gateway(ScriptedBackend(["ok"], on_exhausted="repeat"), store) as url:
        gw = url.gateway

        def agent(r: tuple[str, int]) -> None:
            client = openai.OpenAI(base_url=url.for_rollout(*r), api_key="x", max_retries=0)
            for k in range(1, 6):
                client.chat.completions.create(model="scripted", messages=MSG)
                if len(server_spans(store, r[0])) != k:  # read right after the reply
                    missing.append(f"{r[0]} call {k}")

        threads = [threading.Thread(target=agent, args=(r,)) for r in ros]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert gw.stats["spans_stored"] == 40
        assert gw.stats["span_writes"] < 40  # batched: fewer transactions than spans
        # whether a call saw another in flight depends on how the requests interleaved: the writer
        # thread may or may not have been needed (tests/gateway/test_span_writer.py makes it certain)
        thread = gw.writer._thread
    assert not missing
    assert thread is None or not thread.is_alive()  # close() stopped the writer thread
    store.close()


def test_flush_endpoint_waits_for_queued_spans(tmp_path: Path) -> None:
    store = agl.store.open(f"sqlite:///{tmp_path / 'spans.db'}")
    rollout = start_rollout(store, "ro-flush")
    slow_add = store.add_spans

    def add_spans(spans: Any, **kw: Any) -> Any:
        time.sleep(0.3)  # a slow store: the reply leaves long before the span is stored
        return slow_add(spans, **kw)

    store.add_spans = add_spans  # type: ignore[method-assign]
    with serve_gateway(ScriptedBackend(["ok"]), store, span_writes="after_reply") as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
        client.chat.completions.create(model="scripted", messages=MSG)
        assert server_spans(store, rollout[0]) == []  # replied before the span was stored
        r = httpx.post(url.root + "/agl/v1/flush", timeout=10)
        assert r.status_code == 200 and r.json()["flushed"] is True
        assert len(server_spans(store, rollout[0])) == 1
    store.close()


def test_before_reply_mode_stores_the_span_before_answering(tmp_path: Path) -> None:
    store = agl.store.open(f"sqlite:///{tmp_path / 'spans.db'}")
    rollout = start_rollout(store, "ro-sync")
    with serve_gateway(ScriptedBackend(["ok"]), store, span_writes="before_reply") as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
        client.chat.completions.create(model="scripted", messages=MSG)
        assert len(server_spans(store, rollout[0])) == 1
    with pytest.raises(ValueError, match="span_writes"):
        serve_gateway(ScriptedBackend(["ok"]), store, span_writes="later").__enter__()
    store.close()


def test_vllm_that_lists_no_models_says_so(store: Any, rollout: tuple[str, int]) -> None:
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def models(request: Any) -> JSONResponse:
        return JSONResponse({"object": "list", "data": []})

    app = Starlette(routes=[Route("/v1/models", models)])
    with serve_asgi(app) as root, serve_gateway(VLLMBackend(root), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model=MODEL, messages=MSG)
    assert "answers but lists no models" in str(info.value)


def test_responses_api_streams_text_and_calls_as_generated(store: Any, rollout: tuple[str, int]) -> None:
    """The Responses route (the Agents SDK's) streams from the upstream too, text then call deltas."""
    fake = FakeVLLM([LONG, render_tool_call("add", {"a": 2, "b": 3})], token_delay_s=0.02)
    tool = {"type": "function", "name": "add", "parameters": ADD_TOOL["function"]["parameters"]}
    with serve_asgi(fake.app) as root, serve_gateway(VLLMBackend(root), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
        t0 = time.perf_counter()
        text_events, times = [], []
        for ev in client.responses.create(model=MODEL, input="count", stream=True):
            times.append(time.perf_counter() - t0)
            text_events.append(ev)
        call_events = list(client.responses.create(model=MODEL, input="2+3?", tools=[tool], stream=True))  # type: ignore[list-item]
    deltas = [i for i, e in enumerate(text_events) if e.type == "response.output_text.delta"]
    assert len(deltas) >= 10 and times[deltas[0]] < times[-1] - 0.15  # streamed, not replayed
    done = text_events[-1]
    assert done.type == "response.completed"
    assert done.response.output[0].content[0].text == LONG == "".join(text_events[i].delta for i in deltas)
    assert [e.sequence_number for e in text_events] == list(range(len(text_events)))
    arg_deltas = [e for e in call_events if e.type == "response.function_call_arguments.delta"]
    assert len(arg_deltas) >= 2
    final = call_events[-1].response.output
    assert final[0].type == "function_call" and final[0].name == "add"
    assert json.loads(final[0].arguments) == {"a": 2, "b": 3}
    s_text, s_call = server_spans(store, rollout[0])
    assert s_text.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS] == TOK.encode(LONG) + [TOK.eos_token_id]
    (out,) = json.loads(s_call.attributes[sc.GEN_AI_OUTPUT_MESSAGES])
    assert out["tool_calls"][0]["id"] == final[0].call_id
