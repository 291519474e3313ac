"""Continuous batching in the transformers backend (tiny random Llama and Qwen2, shipped SmolLM2
tokenizer): batched rows generate what they generate alone, requests join a running batch between
decode steps, cancelled and finished rows leave it, and streams still get their tokens as drawn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from gw_helpers import server_spans, start_rollout, tiny_lm

from agl import semconv as sc
from agl.chat.tokenizer import load_default_tokenizer
from agl.gateway.backends.base import GenerationRequest, GenerationResult
from agl.gateway.testing import serve_gateway

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from agl.gateway.backends.transformers import TransformersBackend  # noqa: E402

TOK = load_default_tokenizer()


def tiny(kind: str, seed: int = 0) -> Any:
    """A tiny random model with its (tied) output embeddings scaled so its next-token distributions are
    peaked, as a trained model's are. At random init its logits have a std of ~0.1 over 49k tokens, so a
    sampled token's interval of the CDF (~2e-5 wide) is as narrow as the rounding that a batched forward
    pass's other GEMM shapes put on the logits (~1e-6): which token an inverse-CDF draw picks then depends
    on the CPU's kernels (seen: the Qwen2 row drew the neighbouring token id on an EPYC without AVX-512),
    and "batched rows draw what they draw alone" stops being a property of the engine."""
    model = tiny_lm(kind, seed)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(PEAK)
    return model


#: the output-embedding scale: logits with a std of a few units, like a trained model's
PEAK = 60.0


class Steps:
    """Records the batch shape of every forward pass; ``delay_s`` makes each pass slow (a CPU model)."""

    def __init__(self, model: Any, delay_s: float = 0.0) -> None:
        self.shapes: list[tuple[int, int]] = []
        self.delay_s = delay_s
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: Any, args: Any, kwargs: Any) -> None:
        self.shapes.append(tuple(kwargs["input_ids"].shape))
        if self.delay_s:
            time.sleep(self.delay_s)

    def decode_batches(self) -> list[int]:
        return [b for b, n in self.shapes if n == 1]


def request(content: str, **kw: Any) -> GenerationRequest:
    return GenerationRequest(model="tiny", messages=[{"role": "user", "content": content}], **kw)


#: mixed per-request settings: greedy, seeded samples at several temperatures/top_p/top_k, stop strings,
#: different prompt lengths and max_tokens
REQUESTS: list[dict[str, Any]] = [
    {"content": "Say something.", "temperature": 0, "max_tokens": 14},
    {"content": "word " * 9, "temperature": 0.7, "seed": 1, "max_tokens": 10},
    {
        "content": "Tell me a long story about a cat.",
        "temperature": 1.0,
        "top_p": 0.5,
        "seed": 2,
        "max_tokens": 16,
    },
    {"content": "Hi", "temperature": 1.3, "seed": 3, "max_tokens": 6},
    {"content": "Count to ten.", "temperature": 1.0, "seed": 4, "max_tokens": 12, "raw": {"top_k": 20}},
    {"content": "x " * 30, "temperature": 0.9, "seed": 5, "max_tokens": 9, "stop": ["e"]},
]


def make(spec: dict[str, Any]) -> GenerationRequest:
    spec = dict(spec)
    return request(spec.pop("content"), **spec)


def assert_same(a: GenerationResult, b: GenerationResult) -> None:
    ca, cb = a.choices[0], b.choices[0]
    assert ca.response_ids == cb.response_ids
    assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-4)
    assert (ca.text, ca.finish_reason) == (cb.text, cb.finish_reason)
    assert a.prompt_ids == b.prompt_ids


@pytest.fixture(params=["llama", "qwen2"])
def setup(request: Any) -> Iterator[tuple[TransformersBackend, Steps]]:
    model = tiny(request.param)
    steps = Steps(model)
    be = TransformersBackend(model, model_name="tiny", default_max_tokens=12)
    yield be, steps
    be.engine._executor.shutdown(wait=False)


async def test_batched_rows_generate_what_they_generate_alone(
    setup: tuple[TransformersBackend, Steps],
) -> None:
    backend, steps = setup
    alone = [await backend.generate(make(spec)) for spec in REQUESTS]
    assert max(b for b, _ in steps.shapes) == 1  # one at a time: every pass had one row
    steps.shapes.clear()
    together = await asyncio.gather(*(backend.generate(make(spec)) for spec in REQUESTS))
    assert max(b for b, _ in steps.shapes) == len(REQUESTS)  # ... and now they shared passes
    for a, b in zip(alone, together, strict=True):
        assert_same(a, b)
    # a stop string ends its row; other rows ran to their own max_tokens
    assert together[0].choices[0].finish_reason in ("length", "stop")
    assert [len(r.choices[0].response_ids) for r in together][1:4] == [10, 16, 6] or any(
        r.choices[0].finish_reason == "stop" for r in together[1:4]
    )
    # finished rows left: the batch shrank as rows ended (decode passes with fewer rows at the end)
    decode = steps.decode_batches()
    assert decode[0] > decode[-1]
    assert len(decode) < sum(len(r.choices[0].response_ids) for r in together)


async def test_a_request_joins_a_running_batch_between_decode_steps() -> None:
    model = tiny("llama")
    steps = Steps(model, delay_s=0.02)
    backend = TransformersBackend(model, model_name="tiny")
    long_spec = {"content": "Say something.", "temperature": 0.8, "seed": 11, "max_tokens": 40}
    short_spec = {"content": "Hi there, friend.", "temperature": 0, "max_tokens": 5}
    long_alone = await backend.generate(make(long_spec))
    short_alone = await backend.generate(make(short_spec))
    steps.shapes.clear()
    long_task = asyncio.create_task(backend.generate(make(long_spec)))
    while len(steps.shapes) < 8:  # the long one is decoding
        await asyncio.sleep(0.01)
    short = await backend.generate(make(short_spec))
    assert not long_task.done()  # the short one did not wait for the long one to finish
    long = await long_task
    assert_same(long, long_alone)
    assert_same(short, short_alone)
    decode = steps.decode_batches()
    assert decode[:3] == [1, 1, 1] and 2 in decode and decode[-1] == 1  # joined, then left
    assert list(backend.batch_sizes)[-2:] == [1, 2]
    backend.engine._executor.shutdown(wait=False)


async def test_a_cancelled_request_leaves_the_batch() -> None:
    model = tiny("llama")
    steps = Steps(model, delay_s=0.02)
    backend = TransformersBackend(model, model_name="tiny")
    keep_spec = {"content": "Say something.", "temperature": 0, "max_tokens": 30}
    alone = await backend.generate(make(keep_spec))
    steps.shapes.clear()
    keep = asyncio.create_task(backend.generate(make(keep_spec)))
    doomed = asyncio.create_task(
        backend.generate(make({"content": "go on", "temperature": 0, "max_tokens": 400}))
    )
    while len(steps.decode_batches()) < 5:
        await asyncio.sleep(0.01)
    assert steps.decode_batches()[-1] == 2
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    seen = len(steps.shapes)
    result = await keep
    assert_same(result, alone)  # the other row is unaffected
    after = [b for b, n in steps.shapes[seen + 1 :] if n == 1]
    assert after and set(after) == {1}  # the cancelled row left at the next step
    assert len(steps.shapes) < 60  # far from its 400 tokens
    backend.engine._executor.shutdown(wait=False)


async def test_streams_under_batching_get_their_own_tokens_as_drawn() -> None:
    model = tiny("llama")
    steps = Steps(model, delay_s=0.02)
    backend = TransformersBackend(model, model_name="tiny")
    specs = [
        {"content": "Say something.", "temperature": 0.9, "seed": 21, "max_tokens": 20},
        {"content": "Count to ten please.", "temperature": 0, "max_tokens": 20},
        {"content": "word " * 5, "temperature": 1.0, "seed": 22, "max_tokens": 12},
    ]
    alone = [await backend.generate(make(s)) for s in specs]

    async def consume(spec: dict[str, Any]) -> tuple[list[int], list[float], GenerationResult, float, float]:
        t0 = time.perf_counter()
        ids: list[int] = []
        first = last = 0.0
        end: GenerationResult | None = None
        async for event in backend.stream(make(spec)):
            if event["type"] == "delta" and event["token_ids"]:
                ids.extend(event["token_ids"])
                first = first or time.perf_counter() - t0
            if event["type"] == "end":
                end = event["result"]
                last = time.perf_counter() - t0
        assert end is not None
        return ids, [], end, first, last

    steps.shapes.clear()
    streamed, plain = await asyncio.gather(
        asyncio.gather(consume(specs[0]), consume(specs[2])), backend.generate(make(specs[1]))
    )
    assert max(steps.decode_batches()) == 3
    for (ids, _, end, first, last), ref in zip(streamed, [alone[0], alone[2]], strict=True):
        assert ids == end.choices[0].response_ids  # each stream got its own row's tokens
        assert_same(end, ref)
        assert first < last - 0.1  # the first token came long before the end
    assert_same(plain, alone[1])
    backend.engine._executor.shutdown(wait=False)


async def test_a_weight_swap_waits_for_the_running_batch() -> None:
    model = tiny("llama", seed=1)
    Steps(model, delay_s=0.01)
    backend = TransformersBackend(model, model_name="tiny")
    spec = {"content": "Say something.", "temperature": 0, "max_tokens": 25}
    before = await backend.generate(make(spec))
    running = asyncio.create_task(backend.generate(make(spec)))
    await asyncio.sleep(0.1)
    version = await backend.set_model(tiny("llama", seed=2), version=3)
    assert running.done()  # the swap ran after the batch drained
    result = running.result()
    assert result.weight_version == 0 and version == 3
    assert_same(result, before)
    after = await backend.generate(make(spec))
    assert after.weight_version == 3
    new, old = after.choices[0].logprobs, before.choices[0].logprobs
    assert max(abs(x - y) for x, y in zip(new, old, strict=False)) > 1e-3  # the new weights serve now
    backend.engine._executor.shutdown(wait=False)


def test_concurrent_clients_over_http_mix_streams_and_replies(store: Any) -> None:
    """Through the gateway: 4 concurrent clients (two streaming) share the batch and each span holds
    the ids and logprobs the same request gets alone."""
    model = tiny("llama")
    backend = TransformersBackend(model, model_name="tiny")
    rollouts = [start_rollout(store, f"ro-cb{i}") for i in range(5)]
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "temperature": 0.8, "seed": 5}
    with serve_gateway(backend, store) as url:

        def call(i: int, stream: bool) -> None:
            client = openai.OpenAI(base_url=url.for_rollout(*rollouts[i]), api_key="x", max_retries=0)
            out = client.chat.completions.create(
                messages=[{"role": "user", "content": "Pick a word " * (i % 4 + 1)}], stream=stream, **kw
            )
            if stream:
                list(out)

        call(4, False)  # alone: the reference for client 0's prompt
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(call, range(4), [False, True, False, True]))
    (ref,) = server_spans(store, "ro-cb4")
    for i in range(4):
        (span,) = server_spans(store, f"ro-cb{i}")
        a = span.attributes
        assert len(a[sc.AGL_LLM_RESPONSE_TOKEN_IDS]) == len(a[sc.AGL_LLM_RESPONSE_LOGPROBS]) > 0
    (first,) = server_spans(store, "ro-cb0")  # same prompt and seed as the reference, batched
    assert first.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS] == ref.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]
    assert first.attributes[sc.AGL_LLM_RESPONSE_LOGPROBS] == pytest.approx(
        ref.attributes[sc.AGL_LLM_RESPONSE_LOGPROBS], abs=1e-4
    )
    assert max(backend.batch_sizes) > 1
    backend.engine._executor.shutdown(wait=False)


async def test_the_models_own_processors_apply_per_row() -> None:
    """A repetition penalty in the model's generation config applies to each row over its own ids,
    as ``generate`` applies it: batched or alone, the greedy tokens are ``generate``'s."""
    model = tiny("llama")
    plain = TransformersBackend(model, model_name="tiny")
    spec = {"content": "Say something.", "temperature": 0, "max_tokens": 10}
    unpenalised = await plain.generate(make(spec))
    plain.engine._executor.shutdown(wait=False)
    model.generation_config.repetition_penalty = 1.5
    backend = TransformersBackend(model, model_name="tiny")
    other = {"content": "word " * 7, "temperature": 0.9, "seed": 3, "max_tokens": 10}
    alone = await backend.generate(make(spec))
    together, _ = await asyncio.gather(backend.generate(make(spec)), backend.generate(make(other)))
    assert_same(together, alone)
    ids = torch.tensor([alone.prompt_ids])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, eos_token_id=TOK.eos_token_id)
    assert alone.choices[0].response_ids == out[0, ids.shape[1] :].tolist()
    assert alone.choices[0].response_ids != unpenalised.choices[0].response_ids  # the penalty mattered
    backend.engine._executor.shutdown(wait=False)


async def test_a_sliding_window_model_batches_without_joining() -> None:
    """A cache that cannot be left-padded and concatenated (sliding-window layers): requests admitted
    together still share the batch, a later one waits for it to drain, and each gets what it gets alone."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=TOK._tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        eos_token_id=TOK.eos_token_id,
        pad_token_id=TOK.eos_token_id,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
    )
    model = transformers.Qwen2ForCausalLM(config).eval()
    steps = Steps(model, delay_s=0.01)
    backend = TransformersBackend(model, model_name="tiny")
    specs = [
        {"content": "Say something.", "temperature": 0, "max_tokens": 12},
        {"content": "word " * 6, "temperature": 0.8, "seed": 9, "max_tokens": 12},
    ]
    alone = [await backend.generate(make(s)) for s in specs]
    steps.shapes.clear()
    first = asyncio.create_task(backend.generate(make(specs[0])))
    while len(steps.shapes) < 4:
        await asyncio.sleep(0.005)
    second = await backend.generate(make(specs[1]))
    assert first.done()  # it could not join: it waited for the running batch
    assert_same(first.result(), alone[0])
    assert_same(second, alone[1])
    assert 2 not in steps.decode_batches()
    backend.engine._executor.shutdown(wait=False)
