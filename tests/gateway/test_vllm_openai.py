"""The vllm proxy and the openai pass-through against a fake vLLM server (real HTTP, vLLM's fields)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM
from gw_helpers import ADD_TOOL, server_spans

from agl import semconv as sc
from agl.chat.format import render_tool_call
from agl.chat.tokenizer import load_default_tokenizer
from agl.gateway.backends.openai import OpenAIBackend
from agl.gateway.backends.vllm import VLLMBackend
from agl.gateway.testing import serve_asgi, serve_gateway

openai = pytest.importorskip("openai")

TOK = load_default_tokenizer()
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.fixture
def upstream() -> Iterator[tuple[FakeVLLM, str]]:
    fake = FakeVLLM(["Hello from vLLM.", render_tool_call("add", {"a": 2, "b": 3}), "It is 5."])
    with serve_asgi(fake.app) as root:
        yield fake, root


def test_vllm_proxy_adds_token_ids_and_records_them(
    store: Any, rollout: tuple[str, int], upstream: tuple[FakeVLLM, str]
) -> None:
    fake, root = upstream
    with serve_gateway(VLLMBackend(root), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        assert [m.id for m in client.models.list()] == [MODEL]
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        first = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[ADD_TOOL], temperature=0.7, max_tokens=50
        )
        assert first.choices[0].message.content == "Hello from vLLM."
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "2+3?"},
        ]
        second = client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD_TOOL])
        call = second.choices[0].message.tool_calls[0]  # type: ignore[index]
        assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
        assert second.choices[0].finish_reason == "tool_calls"
    kind, sent = fake.requests[0]
    assert kind == "chat"
    assert sent["return_token_ids"] is True and sent["logprobs"] is True and sent["top_logprobs"] == 0
    assert sent["model"] == MODEL and sent["temperature"] == 0.7 and sent["max_tokens"] == 50
    assert sent["stream"] is False
    s1, s2 = server_spans(store, rollout[0])
    a1 = s1.attributes
    assert a1[sc.AGL_LLM_PROMPT_TOKEN_IDS] == TOK.encode(
        TOK.render([{"role": "user", "content": "hi"}], [ADD_TOOL])
    )
    assert a1[sc.AGL_LLM_RESPONSE_TOKEN_IDS] == TOK.encode("Hello from vLLM.") + [TOK.eos_token_id]
    assert a1[sc.AGL_LLM_RESPONSE_LOGPROBS] == pytest.approx(
        [-0.05 * (k + 1) for k in range(len(a1[sc.AGL_LLM_RESPONSE_TOKEN_IDS]))]
    )
    assert a1[sc.AGL_LLM_BACKEND] == "vllm" and a1[sc.AGL_LLM_EXACT] is True
    # the engine's ids of turn 1 are a prefix of its ids of turn 2: no drift
    assert s2.attributes[sc.AGL_LLM_PREFIX_MATCH] is True
    assert first.choices[0].logprobs is None  # the client did not ask for logprobs: the span has them


def test_vllm_lora_load_routes_the_policy_to_the_new_adapter(
    store: Any, rollout: tuple[str, int], upstream: tuple[FakeVLLM, str]
) -> None:
    fake, root = upstream
    with serve_gateway(VLLMBackend(root, keep_adapters=1), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        msg = [{"role": "user", "content": "hi"}]
        client.chat.completions.create(model=MODEL, messages=msg)
        r = httpx.post(url.root + "/agl/v1/adapters", json={"path": "/ckpt/step1", "name": "policy-v1"})
        assert r.status_code == 200 and r.json() == {"weight_version": 1}
        client.chat.completions.create(model=MODEL, messages=msg)
        r = httpx.post(url.root + "/agl/v1/adapters", json={"path": "/ckpt/step2"})
        assert r.status_code == 200 and r.json() == {"weight_version": 2}
        client.chat.completions.create(model=MODEL, messages=msg)
        assert MODEL in [m.id for m in client.models.list()]
    chats = [b for k, b in fake.requests if k == "chat"]
    assert [b["model"] for b in chats] == [MODEL, "policy-v1", f"{MODEL}-agl-v2"]
    loads = [b for k, b in fake.requests if k == "load_lora_adapter"]
    assert loads == [
        {"lora_name": "policy-v1", "lora_path": "/ckpt/step1"},
        {"lora_name": f"{MODEL}-agl-v2", "lora_path": "/ckpt/step2"},
    ]
    assert ("unload_lora_adapter", {"lora_name": "policy-v1"}) in fake.requests
    assert list(fake.loras) == [f"{MODEL}-agl-v2"]
    versions = [s.attributes[sc.AGL_LLM_WEIGHT_VERSION] for s in server_spans(store, rollout[0])]
    assert versions == [0, 1, 2]


def test_vllm_lora_refusal_is_reported(store: Any, upstream: tuple[FakeVLLM, str]) -> None:
    fake, root = upstream
    fake.loras["taken"] = "/x"
    with serve_gateway(VLLMBackend(root), store) as url:
        r = httpx.post(url.root + "/agl/v1/adapters", json={"path": "/ckpt", "name": "taken"})
        assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
        assert httpx.get(url.root + "/agl/v1/status").json()["weight_version"] == 0


def test_vllm_completions_and_responses(
    store: Any, rollout: tuple[str, int], upstream: tuple[FakeVLLM, str]
) -> None:
    fake, root = upstream
    with serve_gateway(VLLMBackend(root), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20)
        tool = {"type": "function", "name": "add", "parameters": ADD_TOOL["function"]["parameters"]}
        resp = client.responses.create(model=MODEL, instructions="Be nice.", input="hi", tools=[tool])  # type: ignore[list-item]
    assert comp.choices[0].text == "Hello from vLLM."
    kind, sent = fake.requests[0]
    assert kind == "completions" and sent["return_token_ids"] is True and sent["logprobs"] == 1
    assert resp.output[0].type == "function_call"  # the second scripted upstream reply
    kind, sent = fake.requests[1]
    assert kind == "chat" and sent["messages"] == [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "content": "hi"},
    ]
    assert sent["tools"] == [
        {"type": "function", "function": {"name": "add", "parameters": ADD_TOOL["function"]["parameters"]}}
    ]
    s1, s2 = server_spans(store, rollout[0])
    assert s1.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS] == TOK.encode("Hello")
    assert s1.attributes[sc.AGL_LLM_RESPONSE_LOGPROBS][0] == pytest.approx(-0.05)
    assert s2.attributes[sc.AGL_LLM_EXACT] is True


def test_vllm_errors_pass_through(
    store: Any, rollout: tuple[str, int], upstream: tuple[FakeVLLM, str]
) -> None:
    fake, root = upstream
    with serve_gateway(VLLMBackend(root), store, only_model_names=True) as url:  # strict: a 404 for others
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x " * 3000}])
        assert "maximum context length is 2048" in str(info.value)
        assert isinstance(info.value.body, dict) and info.value.body["code"] == "context_length_exceeded"
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="other-model", messages=[{"role": "user", "content": "x"}])
        fake.fail_next = 1
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert err.value.status_code == 502 and "EngineCore" in str(err.value)
    (span,) = server_spans(store, rollout[0])  # the refused bad inputs record nothing; the 502 does
    assert span.status.code == "ERROR" and "EngineCore" in (span.status.message or "")


def test_vllm_unreachable_is_502(store: Any, rollout: tuple[str, int]) -> None:
    backend = VLLMBackend("http://127.0.0.1:9", model=MODEL, timeout_s=2)  # nothing listens on port 9
    with serve_gateway(backend, store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 502 and "unreachable" in str(info.value)


def test_openai_passthrough_is_marked_inexact(
    store: Any, rollout: tuple[str, int], upstream: tuple[FakeVLLM, str]
) -> None:
    fake, root = upstream
    with serve_gateway(OpenAIBackend(root + "/v1", api_key="sk-upstream"), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        out = client.chat.completions.create(
            model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(out)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="unknown", messages=messages)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello from vLLM."
    usage = next(c.usage for c in chunks if c.usage)
    assert usage.completion_tokens == len(TOK.encode("Hello from vLLM.")) + 1
    kind, sent = fake.requests[0]
    assert "return_token_ids" not in sent and "logprobs" not in sent
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}  # streamed upstream
    (span,) = server_spans(store, rollout[0])
    a = span.attributes
    assert a[sc.AGL_LLM_EXACT] is False
    assert sc.AGL_LLM_PROMPT_TOKEN_IDS not in a and sc.AGL_LLM_RESPONSE_TOKEN_IDS not in a
    assert json.loads(a[sc.GEN_AI_INPUT_MESSAGES]) == messages
    assert json.loads(a[sc.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == "Hello from vLLM."
    assert a[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == usage.completion_tokens


def _adapter_dir(root: Any, name: str, weights: bytes) -> str:
    """A folder holding an adapter weights file (the fake vLLM reads only its path; the gateway
    digests the file to skip reloading an unchanged adapter)."""
    path = root / name
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(weights)
    return str(path)


def test_vllm_adapter_per_agent_loads_by_name_and_routes_each_call(
    store: Any, rollout: tuple[str, int], upstream: tuple[FakeVLLM, str], tmp_path: Any
) -> None:
    """An adapter per agent on vLLM: until its first load an agent's calls go to the base model; a push
    loads each adapter by name and routes each call to its agent's (model ``"<base>:<adapter>"`` or
    baggage ``agl.agent``); an unchanged adapter is not reloaded; the old copies are unloaded; the
    spans record the adapter and the weight version; calls of other agents stay on the base model."""
    fake, root = upstream
    backend = VLLMBackend(root, keep_adapters=1, adapters=["writer", "rewriter"])
    msg = [{"role": "user", "content": "hi"}]
    with serve_gateway(backend, store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        assert [m.id for m in client.models.list()] == [MODEL, f"{MODEL}:writer", f"{MODEL}:rewriter"]

        def ask(model: str = MODEL, agent: str | None = None) -> None:
            headers = {sc.HEADER_BAGGAGE: f"{sc.BAGGAGE_AGENT}={agent}"} if agent else {}
            client.chat.completions.create(model=model, messages=msg, extra_headers=headers)

        ask(agent="writer")  # v0: no adapter loaded yet, the base model serves it
        v1 = {
            "writer": _adapter_dir(tmp_path / "v1", "writer", b"w1"),
            "rewriter": _adapter_dir(tmp_path / "v1", "rewriter", b"r1"),
        }
        r = httpx.post(url.root + "/agl/v1/adapters", json={"adapters": v1, "version": 1})
        assert r.status_code == 200 and r.json() == {"weight_version": 1}
        ask(agent="writer")
        ask(model=f"{MODEL}:rewriter")
        ask(agent="planner")  # an agent without an adapter: the base model
        # v2: only the rewriter changed (the writer's agent had no gradient)
        v2 = {
            "writer": _adapter_dir(tmp_path / "v2", "writer", b"w1"),
            "rewriter": _adapter_dir(tmp_path / "v2", "rewriter", b"r2"),
        }
        r = httpx.post(url.root + "/agl/v1/adapters", json={"adapters": v2, "version": 2})
        assert r.status_code == 200 and r.json() == {"weight_version": 2}
        ask(agent="writer")
        ask(agent="rewriter")
        # one adapter by name through the single-adapter body
        w3 = _adapter_dir(tmp_path / "v3", "writer", b"w3")
        r = httpx.post(url.root + "/agl/v1/adapters", json={"path": w3, "name": "writer", "version": 3})
        assert r.status_code == 200 and r.json() == {"weight_version": 3}
        ask(agent="writer")
        bad = httpx.post(url.root + "/agl/v1/adapters", json={"adapters": {"planner": v2["writer"]}})
        assert bad.status_code == 400 and "no agent adapter ['planner']" in bad.json()["error"]["message"]
    loads = [(b["lora_name"], b["lora_path"]) for k, b in fake.requests if k == "load_lora_adapter"]
    assert loads == [
        (f"{MODEL}-writer-v1", v1["writer"]),
        (f"{MODEL}-rewriter-v1", v1["rewriter"]),
        (f"{MODEL}-rewriter-v2", v2["rewriter"]),
        (f"{MODEL}-writer-v3", w3),
    ]
    chats = [b["model"] for k, b in fake.requests if k == "chat"]
    assert chats == [
        MODEL,
        f"{MODEL}-writer-v1",
        f"{MODEL}-rewriter-v1",
        MODEL,
        f"{MODEL}-writer-v1",
        f"{MODEL}-rewriter-v2",
        f"{MODEL}-writer-v3",
    ]
    assert sorted(fake.loras) == [f"{MODEL}-rewriter-v2", f"{MODEL}-writer-v3"]  # keep_adapters=1
    spans = sorted(server_spans(store, rollout[0]), key=lambda s: s.start_ns)
    assert [s.attributes[sc.AGL_LLM_ADAPTER] for s in spans] == [
        "writer",
        "writer",
        "rewriter",
        "__base__",
        "writer",
        "rewriter",
        "writer",
    ]
    assert [s.attributes[sc.AGL_LLM_WEIGHT_VERSION] for s in spans] == [0, 1, 1, 1, 2, 2, 3]


def test_vllm_adapter_per_agent_refused_load_keeps_the_routing(
    store: Any, upstream: tuple[FakeVLLM, str], tmp_path: Any
) -> None:
    """A push whose second adapter vLLM refuses changes nothing: the first one's new copy is unloaded,
    calls keep their adapters, the weight version stays."""
    fake, root = upstream
    fake.refuse_loras.add(f"{MODEL}-rewriter-v1")
    backend = VLLMBackend(root, adapters=["writer", "rewriter"])
    with serve_gateway(backend, store) as url:
        paths = {a: _adapter_dir(tmp_path, a, a.encode()) for a in ("writer", "rewriter")}
        r = httpx.post(url.root + "/agl/v1/adapters", json={"adapters": paths, "version": 1})
        assert r.status_code == 400 and "No adapter found" in r.json()["error"]["message"]
        assert httpx.get(url.root + "/agl/v1/status").json()["weight_version"] == 0
    assert ("unload_lora_adapter", {"lora_name": f"{MODEL}-writer-v1"}) in fake.requests
    assert backend.lora_served == {"writer": None, "rewriter": None}


def test_vllm_serves_adapters_given_up_front(
    store: Any, upstream: tuple[FakeVLLM, str], tmp_path: Any
) -> None:
    """``agl gateway serve --backend vllm --adapter writer=DIR``: vLLM loads each folder by name when the
    gateway starts; the writer's calls go to it, the others to the base model; a bad name is refused."""
    from agl.cli.gateway import build_backend, register_cli

    fake, root = upstream
    import argparse

    parser = argparse.ArgumentParser()
    register_cli(parser)
    folder = _adapter_dir(tmp_path, "writer", b"w")
    args = parser.parse_args(
        ["serve", "--backend", "vllm", "--upstream", root + "/v1", f"--adapter=writer={folder}"]
    )
    backend = build_backend(args)
    msg = [{"role": "user", "content": "hi"}]
    with serve_gateway(backend, store) as url:
        client = openai.OpenAI(base_url=url.root + "/v1", api_key="x")
        client.chat.completions.create(model=f"{MODEL}:writer", messages=msg)
        client.chat.completions.create(model=MODEL, messages=msg)
    assert ("load_lora_adapter", {"lora_name": f"{MODEL}-writer-v0", "lora_path": folder}) in fake.requests
    assert [b["model"] for k, b in fake.requests if k == "chat"] == [f"{MODEL}-writer-v0", MODEL]
    with pytest.raises(ValueError, match="not one an agent's adapter has"):
        VLLMBackend(root, adapters={"a.b": folder})


def test_vllm_adapter_per_agent_streams_from_the_agents_adapter(
    store: Any, rollout: tuple[str, int], upstream: tuple[FakeVLLM, str], tmp_path: Any
) -> None:
    fake, root = upstream
    backend = VLLMBackend(root, adapters=["writer", "rewriter"])
    with serve_gateway(backend, store) as url:
        paths = {a: _adapter_dir(tmp_path, a, a.encode()) for a in ("writer", "rewriter")}
        assert (
            httpx.post(url.root + "/agl/v1/adapters", json={"adapters": paths, "version": 4}).status_code
            == 200
        )
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_headers={sc.HEADER_BAGGAGE: f"{sc.BAGGAGE_AGENT}=rewriter"},
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Hello from vLLM."
    assert [b["model"] for k, b in fake.requests if k == "chat"] == [f"{MODEL}-rewriter-v4"]
    (span,) = server_spans(store, rollout[0])
    assert (
        span.attributes[sc.AGL_LLM_ADAPTER] == "rewriter" and span.attributes[sc.AGL_LLM_WEIGHT_VERSION] == 4
    )
