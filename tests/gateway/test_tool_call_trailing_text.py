"""A tool call is not lost when the model keeps writing after the call's closing brace.

The scripted backend replies what a model writes (a ``<tool_call>`` block with prose after the JSON,
unterminated, fenced, two calls in a row); through the real gateway, on each wire format (Chat
Completions, Responses, Anthropic Messages, each plain and streamed, with the real SDKs), the call
arrives as a call, the prose as content, and the span counts the repair (``agl.llm.tool_call_repairs``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from gw_helpers import ADD_TOOL, server_spans

from agl import semconv as sc
from agl.chat.format import parse_reply
from agl.gateway.testing import ScriptedBackend, serve_gateway

openai = pytest.importorskip("openai")

CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
PROSE = "I will wait for the result."
#: what a model writes -> (the calls, the content)
FORMS: dict[str, tuple[str, list[tuple[str, dict[str, Any]]], str | None]] = {
    "prose-inside": (f"<tool_call>\n{CALL}\n{PROSE}\n</tool_call>", [("add", {"a": 2, "b": 3})], PROSE),
    "unterminated": (f"<tool_call>\n{CALL} {PROSE}", [("add", {"a": 2, "b": 3})], PROSE),
    "fenced": (f"<tool_call>\n```json\n{CALL}\n```\n{PROSE}</tool_call>", [("add", {"a": 2, "b": 3})], PROSE),
    "parameters-string": (
        '<tool_call>{"name": "add", "parameters": "{\\"a\\": 2, \\"b\\": 3}"} ' + PROSE + "</tool_call>",
        [("add", {"a": 2, "b": 3})],
        PROSE,
    ),
    "two-in-a-row": (
        f'Sure.<tool_call>\n{CALL}\n{{"name": "add", "arguments": {{"a": 1, "b": 1}}}}\n</tool_call>',
        [("add", {"a": 2, "b": 3}), ("add", {"a": 1, "b": 1})],
        "Sure.",
    ),
}
ADD_MSG = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": ADD_TOOL["function"]["parameters"],
}
RESPONSES_TOOL = {"type": "function", **ADD_TOOL["function"]}


def test_the_parser_keeps_each_form_s_calls_and_its_prose() -> None:
    for name, (text, calls, content) in FORMS.items():
        reply = parse_reply(text)
        assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == calls, name
        assert reply.content == content and reply.repairs == 1, (name, reply)
    clean = parse_reply(f"<tool_call>\n{CALL}\n</tool_call> and after the block")
    assert clean.repairs == 0 and clean.content == "and after the block" and len(clean.tool_calls) == 1


def _span_repairs(store: Any, rollout: tuple[str, int]) -> list[Any]:
    return [s.attributes.get(sc.AGL_LLM_TOOL_CALL_REPAIRS) for s in server_spans(store, rollout[0])]


def test_a_call_whose_arguments_are_not_an_object_is_no_call() -> None:
    """Seen from vLLM's SmolLM2 on a forced call: ``{"name": "add", "arguments": 2`` then more text. The
    arguments of a call are a JSON object, so such a block stays content; null is no arguments."""
    for text in (
        '<tool_call>{"name": "add", "arguments": 2}, 3)',
        '<tool_call>{"name": "add", "arguments": [2, 3]}',
    ):
        parsed = parse_reply(text, allowed={"add"})
        assert parsed.tool_calls == [] and parsed.content == text
    (call,) = parse_reply('<tool_call>{"name": "add", "arguments": null}</tool_call>').tool_calls
    assert (call.name, call.arguments) == ("add", "{}")


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("streamed", [False, True])
def test_chat_completions(store: Any, rollout: tuple[str, int], form: str, streamed: bool) -> None:
    text, calls, content = FORMS[form]
    with serve_gateway(ScriptedBackend([text]), store) as url:
        client = openai.OpenAI(base_url=str(url.for_rollout(*rollout)), api_key="x", max_retries=0)
        kw: dict[str, Any] = {"model": "scripted", "tools": [ADD_TOOL]}
        messages = [{"role": "user", "content": "2 + 3?"}]
        if streamed:
            got_content, got_calls, finish = "", {}, None
            for chunk in client.chat.completions.create(messages=messages, stream=True, **kw):
                delta = chunk.choices[0].delta
                got_content += delta.content or ""
                for tc in delta.tool_calls or ():
                    entry = got_calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    entry["name"] += tc.function.name or ""
                    entry["arguments"] += tc.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            pairs = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(got_calls.items())]
            assert (pairs, got_content or None, finish) == (calls, content, "tool_calls")
        else:
            choice = client.chat.completions.create(messages=messages, **kw).choices[0]
            pairs = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
            assert (pairs, choice.message.content, choice.finish_reason) == (calls, content, "tool_calls")
    assert _span_repairs(store, rollout) == [1]


@pytest.mark.parametrize("form", ["prose-inside", "unterminated", "two-in-a-row"])
@pytest.mark.parametrize("streamed", [False, True])
def test_responses(store: Any, rollout: tuple[str, int], form: str, streamed: bool) -> None:
    text, calls, content = FORMS[form]
    with serve_gateway(ScriptedBackend([text]), store) as url:
        client = openai.OpenAI(base_url=str(url.for_rollout(*rollout)), api_key="x", max_retries=0)
        kw: dict[str, Any] = {"model": "scripted", "tools": [RESPONSES_TOOL], "input": "2 + 3?"}
        if streamed:
            with client.responses.stream(**kw) as stream:
                for _ in stream:
                    pass
                response = stream.get_final_response()
        else:
            response = client.responses.create(**kw)
    pairs = [(o.name, json.loads(o.arguments)) for o in response.output if o.type == "function_call"]
    texts = [c.text for o in response.output if o.type == "message" for c in o.content]
    assert pairs == calls and ("".join(texts) or None) == content
    assert _span_repairs(store, rollout) == [1]


@pytest.mark.parametrize("form", ["prose-inside", "unterminated", "two-in-a-row"])
@pytest.mark.parametrize("streamed", [False, True])
def test_anthropic_messages(store: Any, rollout: tuple[str, int], form: str, streamed: bool) -> None:
    anthropic = pytest.importorskip("anthropic")
    text, calls, content = FORMS[form]
    with serve_gateway(ScriptedBackend([text]), store) as url:
        base = str(url.for_rollout(*rollout)).removesuffix("/v1")
        client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
        kw: dict[str, Any] = {
            "model": "scripted",
            "max_tokens": 128,
            "tools": [ADD_MSG],
            "messages": [{"role": "user", "content": "2 + 3?"}],
        }
        if streamed:
            with client.messages.stream(**kw) as stream:
                for _ in stream:
                    pass
                message = stream.get_final_message()
        else:
            message = client.messages.create(**kw)
    pairs = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    texts = [b.text for b in message.content if b.type == "text"]
    assert pairs == calls and ("".join(texts) or None) == content and message.stop_reason == "tool_use"
    assert _span_repairs(store, rollout) == [1]
