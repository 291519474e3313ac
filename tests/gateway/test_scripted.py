"""The real openai client against the gateway with the scripted backend: routes, spans, exact ids."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from gw_helpers import ADD_TOOL, server_spans, start_rollout

from agl import semconv as sc
from agl.chat.tokenizer import load_default_tokenizer
from agl.gateway.testing import ScriptedBackend, reply, serve_gateway, tool_call

openai = pytest.importorskip("openai")

TOK = load_default_tokenizer()


def _attrs(span: Any) -> dict[str, Any]:
    return dict(span.attributes)


def test_chat_text_span_has_the_tokenizers_exact_ids(store: Any, rollout: tuple[str, int]) -> None:
    backend = ScriptedBackend(["Paris is the capital of France."])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    with serve_gateway(backend, store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        resp = client.chat.completions.create(
            model="scripted", messages=messages, temperature=0.5, max_tokens=64
        )
    assert resp.choices[0].message.content == "Paris is the capital of France."
    assert resp.choices[0].finish_reason == "stop"
    (span,) = server_spans(store, rollout[0])
    a = _attrs(span)
    expected_prompt = TOK.encode(TOK.render(messages))
    expected_response = TOK.encode("Paris is the capital of France.") + [TOK.eos_token_id]
    assert a[sc.AGL_LLM_PROMPT_TOKEN_IDS] == expected_prompt
    assert a[sc.AGL_LLM_RESPONSE_TOKEN_IDS] == expected_response
    assert a[sc.AGL_LLM_RESPONSE_LOGPROBS] == [0.0] * len(expected_response)
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(expected_prompt) == a[sc.GEN_AI_USAGE_INPUT_TOKENS]
    assert resp.usage.completion_tokens == len(expected_response) == a[sc.GEN_AI_USAGE_OUTPUT_TOKENS]
    assert span.name == sc.SPAN_CHAT and span.kind == "SERVER"
    assert (span.rollout_id, span.attempt) == rollout
    assert a[sc.AGL_SIDE] == sc.SIDE_SERVER
    assert a[sc.AGL_LLM_BACKEND] == "scripted"
    assert a[sc.AGL_LLM_EXACT] is True
    assert a[sc.AGL_LLM_WEIGHT_VERSION] == 0
    assert a[sc.GEN_AI_RESPONSE_FINISH_REASONS] == ["stop"]
    assert a[sc.GEN_AI_REQUEST_MODEL] == "scripted"
    assert a[sc.GEN_AI_REQUEST_TEMPERATURE] == 0.5
    assert a[sc.GEN_AI_REQUEST_MAX_TOKENS] == 64
    assert json.loads(a[sc.GEN_AI_INPUT_MESSAGES]) == messages
    assert json.loads(a[sc.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == "Paris is the capital of France."
    assert sc.AGL_LLM_PREFIX_MATCH not in a  # first turn: nothing to compare with


def test_parallel_tool_calls_then_results_prefix_match(store: Any, rollout: tuple[str, int]) -> None:
    backend = ScriptedBackend(
        [reply("Adding both.", tool_call("add", a=1, b=2), tool_call("add", a=3, b=4)), reply("3 and 7.")]
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "1+2 and 3+4?"}]
    with serve_gateway(backend, store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        first = client.chat.completions.create(model="scripted", messages=messages, tools=[ADD_TOOL])
        msg = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        assert msg.content == "Adding both."
        assert msg.tool_calls is not None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
            ("add", {"a": 1, "b": 2}),
            ("add", {"a": 3, "b": 4}),
        ]
        assert len({c.id for c in msg.tool_calls}) == 2
        messages.append(msg.model_dump(exclude_none=True))
        for call, result in zip(msg.tool_calls, ("3", "7"), strict=True):
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        second = client.chat.completions.create(model="scripted", messages=messages, tools=[ADD_TOOL])
    assert second.choices[0].message.content == "3 and 7."
    s1, s2 = server_spans(store, rollout[0])
    a1, a2 = _attrs(s1), _attrs(s2)
    # the second prompt re-renders the first prompt + the generated reply token for token
    assert a2[sc.AGL_LLM_PROMPT_TOKEN_IDS][
        : len(a1[sc.AGL_LLM_PROMPT_TOKEN_IDS]) + len(a1[sc.AGL_LLM_RESPONSE_TOKEN_IDS])
    ] == (a1[sc.AGL_LLM_PROMPT_TOKEN_IDS] + a1[sc.AGL_LLM_RESPONSE_TOKEN_IDS])
    assert a2[sc.AGL_LLM_PREFIX_MATCH] is True
    assert a2[sc.AGL_LLM_PROMPT_TOKEN_IDS] == TOK.encode(TOK.render(messages, [ADD_TOOL]))
    assert json.loads(a1[sc.GEN_AI_TOOL_DEFINITIONS]) == [ADD_TOOL]
    assert a1[sc.GEN_AI_RESPONSE_FINISH_REASONS] == ["tool_calls"]
    # the tool definitions are in the rendered prompt the model saw
    assert '"name": "add"' in TOK.decode(a1[sc.AGL_LLM_PROMPT_TOKEN_IDS])


def test_drift_is_detected_when_the_client_rewrites_history(store: Any, rollout: tuple[str, int]) -> None:
    backend = ScriptedBackend(["  Hello there!  ", "Bye."])
    with serve_gateway(backend, store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
        first = client.chat.completions.create(model="scripted", messages=messages)
        content = first.choices[0].message.content
        assert content == "  Hello there!  "
        # a framework that strips whitespace re-renders different ids for the same turn
        messages += [{"role": "assistant", "content": content.strip()}, {"role": "user", "content": "Bye"}]
        client.chat.completions.create(model="scripted", messages=messages)
    _, second = server_spans(store, rollout[0])
    assert second.attributes[sc.AGL_LLM_PREFIX_MATCH] is False


async def test_async_streaming_text_and_tool_call_deltas(store: Any, rollout: tuple[str, int]) -> None:
    backend = ScriptedBackend([reply("Let me add.", tool_call("add", a=20, b=22)), "The sum is 42."])
    with serve_gateway(backend, store) as url:
        client = openai.AsyncOpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "20+22?"}]
        stream = await client.chat.completions.create(
            model="scripted",
            messages=messages,
            tools=[ADD_TOOL],
            stream=True,
            stream_options={"include_usage": True},
        )
        content, calls, finish, usage = "", {}, None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for tc in choice.delta.tool_calls or ():
                    slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                    slot["id"] = tc.id or slot["id"]
                    if tc.function is not None:
                        slot["name"] += tc.function.name or ""
                        slot["arguments"] += tc.function.arguments or ""
                finish = choice.finish_reason or finish
        # the span is in the store by the time the client has the full response
        (span,) = server_spans(store, rollout[0])
        assert content == "Let me add."
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            ("add", {"a": 20, "b": 22})
        ]
        assert usage is not None and usage.completion_tokens == len(
            span.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]
        )
        # the async non-streaming call of the second turn
        call = calls[0]
        messages += [
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call["arguments"]},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": "42"},
        ]
        second = await client.chat.completions.create(model="scripted", messages=messages, tools=[ADD_TOOL])
        await client.close()
    assert second.choices[0].message.content == "The sum is 42."
    assert server_spans(store, rollout[0])[1].attributes[sc.AGL_LLM_PREFIX_MATCH] is True


def test_baggage_and_traceparent_on_plain_v1(store: Any, rollout: tuple[str, int]) -> None:
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {
        "traceparent": f"00-{trace_id}-{parent}-01",
        "baggage": f"{sc.BAGGAGE_ROLLOUT_ID}={rollout[0]},{sc.BAGGAGE_ATTEMPT}={rollout[1]},other=1",
    }
    with serve_gateway(ScriptedBackend(["ok"]), store) as url:
        client = openai.OpenAI(base_url=url, api_key="x", default_headers=headers)
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
        assert url.gateway.stats["unattributed_calls"] == 0
    (span,) = server_spans(store, rollout[0])
    assert span.trace_id == trace_id
    assert span.parent_id == parent
    assert (span.rollout_id, span.attempt) == rollout


def test_the_calling_agent_in_the_baggage_is_on_the_server_span(store: Any, rollout: tuple[str, int]) -> None:
    """``agl.llm.agent`` is exactly the name the baggage carried (percent-encoded by W3C rules, spaces,
    ``+`` and commas included), on a backend without named adapters; absent when no agent is named."""
    rollout_entries = f"{sc.BAGGAGE_ROLLOUT_ID}={rollout[0]},{sc.BAGGAGE_ATTEMPT}={rollout[1]}"
    named = f"{rollout_entries},{sc.BAGGAGE_AGENT}=C%2B%2B+Senior%2C+Researcher"
    with serve_gateway(ScriptedBackend(["ok"], on_exhausted="repeat"), store) as url:
        client = openai.OpenAI(base_url=url, api_key="x")
        for baggage in (named, rollout_entries):
            client.chat.completions.create(
                model="scripted",
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"baggage": baggage},
            )
    first, second = sorted(server_spans(store, rollout[0]), key=lambda s: s.start_ns)
    assert first.attributes[sc.AGL_LLM_AGENT] == "C++ Senior, Researcher"
    assert sc.AGL_LLM_AGENT not in second.attributes
    assert sc.AGL_LLM_ADAPTER not in first.attributes  # no named adapters here: nothing was routed


def test_calls_without_a_rollout_are_served_and_counted_not_stored(
    store: Any, rollout: tuple[str, int]
) -> None:
    with serve_gateway(ScriptedBackend(["ok"], on_exhausted="repeat"), store) as url:
        client = openai.OpenAI(base_url=url, api_key="x")
        for _ in range(3):
            assert (
                client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
                .choices[0]
                .message.content
                == "ok"
            )
        assert url.gateway.stats["unattributed_calls"] == 3
        assert url.gateway.stats["calls"] == 3
    assert store.query_spans() == []


def test_script_cursor_is_per_rollout(store: Any) -> None:
    r1 = start_rollout(store, "ro-a")
    r2 = start_rollout(store, "ro-b")
    backend = ScriptedBackend(["first", "second"])
    with serve_gateway(backend, store) as url:
        c1 = openai.OpenAI(base_url=url.for_rollout(*r1), api_key="x")
        c2 = openai.OpenAI(base_url=url.for_rollout(*r2), api_key="x")
        msgs = [{"role": "user", "content": "hi"}]
        assert (
            c1.chat.completions.create(model="scripted", messages=msgs).choices[0].message.content == "first"
        )
        assert (
            c2.chat.completions.create(model="scripted", messages=msgs).choices[0].message.content == "first"
        )
        assert (
            c1.chat.completions.create(model="scripted", messages=msgs).choices[0].message.content == "second"
        )


def test_callable_script_sees_the_request(store: Any, rollout: tuple[str, int]) -> None:
    def script(request: Any) -> Any:
        system = request.messages[0]["content"]
        return f"I am {system.split()[-1]}"

    with serve_gateway(ScriptedBackend(script), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        msgs = [{"role": "system", "content": "You are writer"}, {"role": "user", "content": "who?"}]
        assert (
            client.chat.completions.create(model="scripted", messages=msgs).choices[0].message.content
            == "I am writer"
        )


def test_n_choices_record_one_span_per_choice(store: Any, rollout: tuple[str, int]) -> None:
    with serve_gateway(ScriptedBackend(["same"]), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        resp = client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "x"}], n=3
        )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    spans = server_spans(store, rollout[0])
    assert sorted(s.attributes[sc.AGL_LLM_CHOICE_INDEX] for s in spans) == [0, 1, 2]
    assert len({s.span_id for s in spans}) == 3


def test_max_tokens_and_stop(store: Any, rollout: tuple[str, int]) -> None:
    with serve_gateway(
        ScriptedBackend(["one two three four five six seven"], on_exhausted="repeat"), store
    ) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        msgs = [{"role": "user", "content": "count"}]
        cut = client.chat.completions.create(model="scripted", messages=msgs, max_completion_tokens=3)
        stopped = client.chat.completions.create(model="scripted", messages=msgs, stop=[" four"])
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage is not None and cut.usage.completion_tokens == 3
    assert stopped.choices[0].message.content == "one two three"
    a_cut = server_spans(store, rollout[0])[0].attributes
    assert a_cut[sc.AGL_LLM_RESPONSE_TOKEN_IDS] == TOK.encode("one two three four five six seven")[:3]
    # the adapter marks the call cut at max_tokens (for mask_truncated), and only that one
    from agl.adapter import Adapter

    ts = Adapter().transitions(server_spans(store, rollout[0]))
    assert [t.truncated for t in ts] == [True, False]
    assert ts[0].response_ids == tuple(TOK.encode("one two three four five six seven")[:3])


def test_logprobs_and_token_ids_on_request(store: Any, rollout: tuple[str, int]) -> None:
    with serve_gateway(ScriptedBackend(["Hi you"]), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        resp = client.chat.completions.create(
            model="scripted",
            messages=[{"role": "user", "content": "x"}],
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert "".join(t.token for t in content) == "Hi you<|im_end|>"
    assert all(t.logprob == 0.0 for t in content)
    extra = resp.model_dump()
    span = server_spans(store, rollout[0])[0]
    assert extra["prompt_token_ids"] == span.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS]
    assert extra["choices"][0]["token_ids"] == span.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]


def test_completions_and_models(store: Any, rollout: tuple[str, int]) -> None:
    with serve_gateway(ScriptedBackend([" world"], models=["scripted", "alias"]), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        resp = client.completions.create(model="alias", prompt="Hello", max_tokens=8)
        assert [m.id for m in client.models.list()] == ["scripted", "alias"]
    assert resp.choices[0].text == " world"
    (span,) = server_spans(store, rollout[0])
    assert span.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS] == TOK.encode("Hello")
    assert span.attributes[sc.AGL_LLM_PROMPT_TEXT] == "Hello"


def test_completions_stream(store: Any, rollout: tuple[str, int]) -> None:
    with serve_gateway(ScriptedBackend([" big world"]), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        chunks = list(client.completions.create(model="scripted", prompt="Hello", max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " big world"
    assert chunks[-1].choices[0].finish_reason == "stop"


# ------------------------------------------------------------------------------------ responses API


def _responses_input(first: Any, result: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [{"role": "user", "content": "1+2?"}]
    for out in first.output:
        items.append(out.model_dump(exclude_none=True))
    call = next(o for o in first.output if o.type == "function_call")
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
    return items


RESP_TOOL = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": ADD_TOOL["function"]["parameters"],
    "strict": False,
}


def test_responses_api_function_calls_and_prefix_match(store: Any, rollout: tuple[str, int]) -> None:
    backend = ScriptedBackend([reply("Adding.", tool_call("add", a=1, b=2)), reply("It is 3.")])
    with serve_gateway(backend, store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        first = client.responses.create(
            model="scripted", instructions="You add.", input="1+2?", tools=[RESP_TOOL]
        )
        assert [o.type for o in first.output] == ["message", "function_call"]
        assert first.output_text == "Adding."
        call = first.output[1]
        assert call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 2}
        assert first.usage is not None and first.usage.output_tokens > 0
        second = client.responses.create(
            model="scripted", instructions="You add.", input=_responses_input(first, "3"), tools=[RESP_TOOL]
        )
    assert second.output_text == "It is 3."
    assert second.status == "completed"
    s1, s2 = server_spans(store, rollout[0])
    msgs = json.loads(s2.attributes[sc.GEN_AI_INPUT_MESSAGES])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[2]["content"] == "Adding." and msgs[2]["tool_calls"][0]["function"]["name"] == "add"
    assert msgs[3] == {"role": "tool", "tool_call_id": call.call_id, "content": "3"}
    assert s2.attributes[sc.AGL_LLM_PREFIX_MATCH] is True
    tools_as_chat = [{"type": "function", "function": {k: v for k, v in RESP_TOOL.items() if k != "type"}}]
    assert s1.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS] == TOK.encode(
        TOK.render(
            [{"role": "system", "content": "You add."}, {"role": "user", "content": "1+2?"}], tools_as_chat
        )
    )


async def test_responses_api_streaming_events(store: Any, rollout: tuple[str, int]) -> None:
    backend = ScriptedBackend([reply("Adding now.", tool_call("add", a=5, b=6))])
    with serve_gateway(backend, store) as url:
        client = openai.AsyncOpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        stream = await client.responses.create(model="scripted", input="5+6?", tools=[RESP_TOOL], stream=True)
        events = [ev async for ev in stream]
        await client.close()
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Adding now."
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"a": 5, "b": 6}
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.usage is not None and final.usage.output_tokens == len(
        server_spans(store, rollout[0])[0].attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]
    )


def test_responses_max_output_tokens_is_incomplete(store: Any, rollout: tuple[str, int]) -> None:
    with serve_gateway(ScriptedBackend(["a long answer with many words"]), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        resp = client.responses.create(model="scripted", input="x", max_output_tokens=2)
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None and resp.incomplete_details.reason == "max_output_tokens"


def test_weight_swap_endpoint_is_refused_by_scripted(store: Any) -> None:
    with serve_gateway(ScriptedBackend(["x"]), store) as url:
        r = httpx.post(url.root + "/agl/v1/weights", json={"path": "/nonexistent"})
        status = httpx.get(url.root + "/agl/v1/status").json()
    assert r.status_code == 400 and "cannot load weights" in r.json()["error"]["message"]
    assert status["backend"] == "scripted" and status["weight_version"] == 0


def test_concurrent_clients_each_get_their_own_span(store: Any) -> None:
    rollouts = [start_rollout(store, f"ro-c{i}") for i in range(8)]
    backend = ScriptedBackend(lambda req: f"reply to {req.rollout[0]}")

    async def main(url: Any) -> list[str]:
        async with httpx.AsyncClient() as http:

            async def one(r: tuple[str, int]) -> str:
                resp = await http.post(
                    url.for_rollout(*r) + "/chat/completions",
                    json={"model": "scripted", "messages": [{"role": "user", "content": "x"}]},
                )
                return resp.json()["choices"][0]["message"]["content"]

            return await asyncio.gather(*(one(r) for r in rollouts))

    with serve_gateway(backend, store) as url:
        answers = asyncio.run(main(url))
    assert answers == [f"reply to {r[0]}" for r in rollouts]
    for r in rollouts:
        (span,) = server_spans(store, r[0])
        assert json.loads(span.attributes[sc.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == f"reply to {r[0]}"


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_span_write_failure_does_not_fail_the_call(store: Any, api: str) -> None:
    """A rollout the store does not know: the reply is served, the failed span write is counted."""
    with serve_gateway(ScriptedBackend(["ok"]), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout("ro-unknown", 1), api_key="x")
        if api == "chat":
            out = (
                client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "x"}])
                .choices[0]
                .message.content
            )
        else:
            out = client.responses.create(model="scripted", input="x").output_text
        assert out == "ok"
        assert url.gateway.stats["span_write_errors"] == 1
