"""Weight pushes that do not drain the transformers engine: an in-place swap (load_weights, a later
push) runs between two decode steps, the running call completes on the new weights, its tokens carry
the two versions that drew them (run-length on the span), and the adapter puts them on the Transition
with the call's staleness taken from the oldest. A tiny random Llama made slow per forward pass stands
in for a CPU model mid-generation."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from gw_helpers import server_spans, start_rollout

from agl import semconv as sc
from agl.adapter import Adapter
from agl.gateway.backends.base import GenerationRequest
from agl.gateway.testing import serve_gateway

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from agl.chat.tokenizer import load_default_tokenizer  # noqa: E402
from agl.gateway.backends.transformers import TransformersBackend  # noqa: E402

TOK = load_default_tokenizer()
N_TOKENS = 30


def tiny(seed: int) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
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
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model


class Slow:
    """A forward pre-hook that makes every pass take ``delay_s`` and counts the decode steps."""

    def __init__(self, model: Any, delay_s: float) -> None:
        self.delay_s = delay_s
        self.steps = 0
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        time.sleep(self.delay_s)


def request() -> GenerationRequest:
    return GenerationRequest(
        model="tiny",
        messages=[{"role": "user", "content": "Say something."}],
        temperature=0,
        max_tokens=N_TOKENS,
    )


async def test_an_in_place_push_lands_between_decode_steps_of_a_running_call() -> None:
    model = tiny(seed=1)
    slow = Slow(model, delay_s=0.02)
    backend = TransformersBackend(model, model_name="tiny")
    backend.engine.eos_ids = [-1]  # greedy on a random model: never end before N_TOKENS
    before = await backend.generate(request())
    assert before.weight_versions == [(0, N_TOKENS)]
    running = asyncio.create_task(backend.generate(request()))
    while slow.steps < N_TOKENS + N_TOKENS // 3:  # a third of the way into the second call
        await asyncio.sleep(0.005)
    version = await backend.load_weights(tiny(seed=2).state_dict(), version=3)
    assert version == 3 and not running.done()  # the push did not wait for the call to finish
    result = await running
    runs = result.weight_versions
    assert runs is not None and [v for v, _ in runs] == [0, 3] and sum(n for _, n in runs) == N_TOKENS
    n_old = runs[0][1]
    assert 0 < n_old < N_TOKENS and result.weight_version == 0  # the call's version: its oldest
    got, ref = result.choices[0], before.choices[0]
    assert got.response_ids[:n_old] == ref.response_ids[:n_old]  # the old weights drew these
    assert got.logprobs[:n_old] == pytest.approx(ref.logprobs[:n_old], abs=1e-5)
    moved = [abs(a - b) for a, b in zip(got.logprobs[n_old:], ref.logprobs[n_old:], strict=True)]
    assert max(moved) > 1e-3  # the rest came from the new weights
    after = await backend.generate(request())
    assert after.weight_versions == [(3, N_TOKENS)] and after.weight_version == 3
    backend.engine._executor.shutdown(wait=False)


def test_a_push_mid_call_is_recorded_on_the_span_and_the_transition(store: Any, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = tiny(seed=1)
    slow = Slow(model, delay_s=0.02)
    backend = TransformersBackend(model, model_name="tiny")
    backend.engine.eos_ids = [-1]
    other = tiny(seed=2)
    path = tmp_path / "new.safetensors"
    save_file({k: v.contiguous() for k, v in other.state_dict().items() if k != "lm_head.weight"}, str(path))
    rid, attempt = start_rollout(store, "ro-live")
    with serve_gateway(backend, store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(rid, attempt), api_key="x", max_retries=0)
        out: dict[str, Any] = {}

        def call() -> None:
            out["r"] = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "Say something."}],
                temperature=0,
                max_tokens=N_TOKENS,
            )

        th = threading.Thread(target=call)
        th.start()
        deadline = time.monotonic() + 60
        while slow.steps < N_TOKENS // 3 and time.monotonic() < deadline:  # a third of the way in
            time.sleep(0.005)
        swapped = httpx.post(url.root + "/agl/v1/weights", json={"path": str(path), "version": 5}, timeout=30)
        assert swapped.status_code == 200 and swapped.json() == {"weight_version": 5}
        assert th.is_alive()  # the push returned while the call was still decoding
        th.join(timeout=60)
    assert out["r"].usage.completion_tokens == N_TOKENS
    (span,) = server_spans(store, rid)
    flat = span.attributes[sc.AGL_LLM_WEIGHT_VERSIONS]
    assert (
        flat[0::2] == [0, 5]
        and sum(flat[1::2]) == N_TOKENS
        and span.attributes[sc.AGL_LLM_WEIGHT_VERSION] == 0
    )
    store.finish_attempt(rid, attempt, "succeeded")
    (t,) = Adapter().from_store(store, [store.get_rollout(rid)])
    assert t.weight_versions == ((0, flat[1]), (5, flat[3]))
    assert t.weight_version == 0  # its staleness: the oldest weights that drew a token
    backend.engine._executor.shutdown(wait=False)
