"""One rendering on every engine: the vllm backend renders chats as the embedded engine does and sends
vLLM the prompt ids (fake vLLM server serving a folder this machine can read; real HTTP)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM
from gw_helpers import ADD_TOOL, server_spans

from agl import semconv as sc
from agl.chat.format import TOOL_CALL_OPEN, render_tool_call
from agl.chat.tokenizer import ChatTokenizer, load_default_tokenizer
from agl.errors import UsageError
from agl.gateway.backends.vllm import VLLMBackend
from agl.gateway.testing import serve_asgi, serve_gateway

openai = pytest.importorskip("openai")

TOK = load_default_tokenizer()
MODEL = "SmolLM2-135M-Instruct"
#: the shipped SmolLM2 tokenizer folder (tokenizer.json, tokenizer_config.json, chat_template.jinja)
ASSETS = str(resources.files("agl.chat").joinpath("assets"))
CALL = render_tool_call("add", {"a": 2, "b": 3})


@pytest.fixture
def upstream() -> Iterator[tuple[FakeVLLM, str]]:
    fake = FakeVLLM(["Hello from vLLM.", CALL, "It is 5."], model=MODEL, root=ASSETS)
    with serve_asgi(fake.app) as root:
        yield fake, root


def test_from_dir_reads_a_model_folder_like_the_shipped_tokenizer() -> None:
    tok = ChatTokenizer.from_dir(ASSETS)
    chat = [{"role": "user", "content": "hi"}]
    assert tok.encode_chat(chat, [ADD_TOOL]) == TOK.encode_chat(chat, [ADD_TOOL])
    assert tok.eos_token_id == TOK.eos_token_id


def test_chat_reaches_vllm_as_agls_prompt_ids_and_tool_calls_are_parsed_by_agl(
    store: Any, rollout: tuple[str, int], upstream: tuple[FakeVLLM, str]
) -> None:
    fake, root = upstream
    with serve_gateway(VLLMBackend(root), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        first = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[ADD_TOOL], max_tokens=50
        )
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "2+3?"},
        ]
        second = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[ADD_TOOL], temperature=0.5
        )
    assert first.choices[0].message.content == "Hello from vLLM."
    call = second.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    assert second.choices[0].finish_reason == "tool_calls"
    assert [k for k, _ in fake.requests] == ["completions", "completions"]  # never the chat route
    sent = [b for _, b in fake.requests]
    # the tools reach the model lowered into the system prompt, as on the embedded engine
    expected = [
        TOK.encode(TOK.render(messages[:1], [ADD_TOOL])),
        TOK.encode(TOK.render(messages, [ADD_TOOL])),
    ]
    assert [b["prompt"] for b in sent] == expected
    assert len(expected[0]) > 100  # the tool listing is in it
    assert sent[0]["max_tokens"] == 50 and sent[0]["return_token_ids"] is True and sent[0]["logprobs"] == 0
    assert sent[1]["temperature"] == 0.5 and sent[1]["max_tokens"] == 2048 - len(expected[1])
    s1, s2 = server_spans(store, rollout[0])
    assert s1.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS] == expected[0]
    assert s1.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS] == TOK.encode("Hello from vLLM.") + [TOK.eos_token_id]
    assert s1.attributes[sc.AGL_LLM_EXACT] is True and s2.attributes[sc.AGL_LLM_PREFIX_MATCH] is True


def test_tool_choice_forces_the_opening_into_the_prompt(store: Any, upstream: tuple[FakeVLLM, str]) -> None:
    fake, root = upstream
    fake.replies = ['"add", "arguments": {"a": 1, "b": 2}}\n</tool_call>']
    with serve_gateway(VLLMBackend(root), store) as url:
        client = openai.OpenAI(base_url=url, api_key="x")
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "1+2"}],
            tools=[ADD_TOOL],
            tool_choice={"type": "function", "function": {"name": "add"}},
        )
    call = reply.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 1, "b": 2})
    sent = fake.requests[0][1]
    opening = TOOL_CALL_OPEN + '{"name": "add", "arguments": '
    rendered = TOK.render([{"role": "user", "content": "1+2"}], [ADD_TOOL])
    assert sent["prompt"] == TOK.encode(rendered) + TOK.encode(opening)
    assert "</tool_call>" in sent["stop"]


def test_streamed_chat_sends_content_then_the_parsed_tool_call(
    store: Any, rollout: tuple[str, int], upstream: tuple[FakeVLLM, str]
) -> None:
    fake, root = upstream
    fake.replies = ["Let me add.\n" + CALL]
    with serve_gateway(VLLMBackend(root), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "2+3"}], tools=[ADD_TOOL], stream=True
            )
        )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert text == "Let me add."  # the tool call's text is held back, then sent parsed
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        ("add", {"a": 2, "b": 3})
    ]
    assert fake.requests[0][1]["stream"] is True
    (span,) = server_spans(store, rollout[0])
    assert span.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS] == TOK.encode(fake.replies[0]) + [TOK.eos_token_id]
    assert span.attributes[sc.AGL_LLM_EXACT] is True


def test_completion_prompt_is_tokenised_by_agl(store: Any, upstream: tuple[FakeVLLM, str]) -> None:
    fake, root = upstream
    with serve_gateway(VLLMBackend(root), store) as url:
        comp = openai.OpenAI(base_url=url, api_key="x").completions.create(
            model=MODEL, prompt="Hi", max_tokens=9
        )
    assert comp.choices[0].text == "Hello from vLLM."[: len(comp.choices[0].text)]
    assert fake.requests[0][1]["prompt"] == TOK.encode("Hi")


def test_a_prompt_over_the_context_is_refused_before_vllm(store: Any, upstream: tuple[FakeVLLM, str]) -> None:
    fake, root = upstream
    fake.max_model_len = 64
    with serve_gateway(VLLMBackend(root), store) as url:
        r = httpx.post(
            url + "/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "word " * 200}]},
        )
    assert r.status_code == 400 and "maximum context length is 64" in r.json()["error"]["message"]
    assert fake.requests == []


def test_render_upstream_keeps_vllms_chat_route(store: Any, upstream: tuple[FakeVLLM, str]) -> None:
    fake, root = upstream
    with serve_gateway(VLLMBackend(root, render="upstream"), store) as url:
        openai.OpenAI(base_url=url, api_key="x").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    assert fake.requests[0][0] == "chat"


def test_render_agl_without_a_readable_tokenizer_is_refused() -> None:
    fake = FakeVLLM(["x"], model=MODEL, root="/nonexistent/SmolLM2")
    with serve_asgi(fake.app) as root:
        backend = VLLMBackend(root, render="agl")
        import asyncio

        with pytest.raises(UsageError, match="tokenizer="):
            asyncio.run(backend.start())
    with pytest.raises(UsageError, match="render"):
        VLLMBackend("http://127.0.0.1:1", render="vllm")


def test_an_adapter_name_an_earlier_run_left_loaded_is_replaced_in_place(
    store: Any, upstream: tuple[FakeVLLM, str]
) -> None:
    fake, root = upstream
    fake.loras[f"{MODEL}-agl-v1"] = "/earlier-run/adapters/v1"  # a long-running server, a second run
    with serve_gateway(VLLMBackend(root), store) as url:
        r = httpx.post(url.root + "/agl/v1/adapters", json={"path": "/this-run/adapters/v1", "version": 1})
        assert r.status_code == 200 and r.json() == {"weight_version": 1}
        r = httpx.post(url.root + "/agl/v1/adapters", json={"path": "/x", "name": f"{MODEL}-agl-v1"})
        assert r.status_code == 400  # a name the user chose is never replaced behind their back
    assert fake.loras[f"{MODEL}-agl-v1"] == "/this-run/adapters/v1"
    loads = [b for k, b in fake.requests if k == "load_lora_adapter"]
    assert [b.get("load_inplace", False) for b in loads] == [False, True, False]
