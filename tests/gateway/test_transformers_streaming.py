"""True token streaming from the transformers backend (tiny random Llama, shipped SmolLM2 tokenizer)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gw_helpers import server_spans

from agl import semconv as sc
from agl.chat.tokenizer import load_default_tokenizer
from agl.gateway.testing import serve_gateway

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from agl.gateway.backends.transformers import TransformersBackend  # noqa: E402

TOK = load_default_tokenizer()
MSG = [{"role": "user", "content": "Say something."}]


def slow_tiny_model(step_s: float) -> tuple[Any, list[int]]:
    """A tiny random Llama whose every forward pass takes ``step_s`` more (a slow CPU model)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=TOK._tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        eos_token_id=TOK.eos_token_id,
        pad_token_id=TOK.eos_token_id,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    calls: list[int] = []

    def slow(module: Any, args: Any, kwargs: Any) -> None:
        calls.append(1)
        time.sleep(step_s)

    model.register_forward_pre_hook(slow, with_kwargs=True)
    return model, calls


@pytest.fixture
def slow_backend() -> Iterator[tuple[TransformersBackend, list[int]]]:
    model, calls = slow_tiny_model(0.04)
    be = TransformersBackend(model, model_name="tiny", default_max_tokens=24)
    yield be, calls
    be.engine._executor.shutdown(wait=False)


def test_first_chunk_arrives_before_generation_ends_and_ids_match(
    store: Any, rollout: tuple[str, int], slow_backend: tuple[TransformersBackend, list[int]]
) -> None:
    backend, _ = slow_backend
    with serve_gateway(backend, store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
        kw: dict[str, Any] = {
            "model": "tiny",
            "messages": MSG,
            "max_tokens": 20,
            "temperature": 1.0,
            "seed": 7,
        }
        plain = client.chat.completions.create(**kw)
        t0 = time.perf_counter()
        arrivals, chunks = [], []
        for chunk in client.chat.completions.create(
            **kw, stream=True, logprobs=True, extra_body={"return_token_ids": True}
        ):
            arrivals.append(time.perf_counter() - t0)
            chunks.append(chunk)
    # 20 tokens at >= 40 ms each: the first token's chunk comes long before the last
    first_token = next(
        i for i, c in enumerate(chunks) if c.choices and (c.choices[0].model_extra or {}).get("token_ids")
    )
    assert arrivals[first_token] < arrivals[-1] - 0.4, (arrivals[first_token], arrivals[-1])
    s_plain, s_stream = server_spans(store, rollout[0])
    ids = s_plain.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]
    assert len(ids) > 1
    # same seed: the streamed generation is the same, id for id and logprob for logprob
    assert s_stream.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS] == ids
    assert s_stream.attributes[sc.AGL_LLM_RESPONSE_LOGPROBS] == pytest.approx(
        s_plain.attributes[sc.AGL_LLM_RESPONSE_LOGPROBS], abs=1e-5
    )
    assert s_stream.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS] == s_plain.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS]
    # what the client received is that generation: ids per chunk, text, logprobs
    streamed = [
        i for c in chunks if c.choices for i in (c.choices[0].model_extra or {}).get("token_ids") or []
    ]
    assert streamed == ids
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    lps = [
        e.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert lps == pytest.approx(s_plain.attributes[sc.AGL_LLM_RESPONSE_LOGPROBS], abs=1e-5)
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_disconnect_mid_stream_stops_generation(
    store: Any, rollout: tuple[str, int], slow_backend: tuple[TransformersBackend, list[int]]
) -> None:
    backend, calls = slow_backend
    with serve_gateway(backend, store) as url:
        with httpx.Client(timeout=30) as http:
            with http.stream(
                "POST",
                url.for_rollout(*rollout) + "/chat/completions",
                json={"model": "tiny", "messages": MSG, "max_tokens": 200, "stream": True},
            ) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                for _ in range(6):
                    next(lines)
        stats = url.gateway.stats
        for _ in range(500):
            if stats["cancelled_calls"]:
                break
            time.sleep(0.01)
        assert stats["cancelled_calls"] == 1
        steps = len(calls)
        time.sleep(0.5)
        assert len(calls) - steps <= 2  # the row stopped at the next token
    assert len(calls) < 100  # far from the 200 tokens asked for
    (span,) = server_spans(store, rollout[0])
    assert span.status.code == "ERROR" and "disconnected" in (span.status.message or "")
