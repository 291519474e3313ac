"""The embedded engine's prefix cache (``agl.engine.prefix_cache``): prompts that start like
an earlier prompt or an earlier conversation are prefilled from the cached prefix, rows with the same
prompt in one admission are prefilled once, and what is generated is what the engine without the cache
generates (tiny random Llama and Qwen2, the shipped SmolLM2 tokenizer)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from gw_helpers import tiny_lm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from agl.chat.tokenizer import load_default_tokenizer  # noqa: E402
from agl.engine import EngineSettings  # noqa: E402
from agl.engine.prefix_cache import MIN_HIT, PrefixCache  # noqa: E402
from agl.gateway.backends.base import GenerationRequest, GenerationResult  # noqa: E402
from agl.gateway.backends.transformers import TransformersBackend  # noqa: E402

TOK = load_default_tokenizer()
SYSTEM = "You are a careful calculator. Reply with one line: Answer: <number>. " * 2


def tiny(kind: str, seed: int = 0) -> Any:
    return tiny_lm(kind, seed, max_positions=1024)


class Prefills:
    """Records the input shape of every forward pass that is not a decode step."""

    def __init__(self, model: Any) -> None:
        self.shapes: list[tuple[int, int]] = []
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: Any, args: Any, kwargs: Any) -> None:
        shape = tuple(kwargs["input_ids"].shape)
        if shape[1] > 1:
            self.shapes.append(shape)


def ask(
    question: str, *, seed: int, history: list[dict[str, str]] | None = None, **kw: Any
) -> GenerationRequest:
    messages = [
        {"role": "system", "content": SYSTEM},
        *(history or []),
        {"role": "user", "content": question},
    ]
    return GenerationRequest(model="tiny", messages=messages, seed=seed, temperature=1.0, max_tokens=8, **kw)


def same(a: GenerationResult, b: GenerationResult) -> None:
    ca, cb = a.choices[0], b.choices[0]
    assert a.prompt_ids == b.prompt_ids
    assert ca.response_ids == cb.response_ids
    assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-4)


def pair(kind: str, **kw: Any) -> tuple[TransformersBackend, TransformersBackend]:
    """Two engines on the same weights: the prefix cache on (the default) and off."""
    model = tiny(kind)
    plain = tiny(kind)
    plain.load_state_dict(model.state_dict())
    return (
        TransformersBackend(model, model_name="tiny", **kw),
        TransformersBackend(plain, model_name="tiny", settings=EngineSettings(prefix_cache_mb=0)),
    )


QUESTIONS = ["What is 3 * 4 + 5?", "What is (2 + 9) * 7?", "What is 8 * 8 - 1?", "What is 6 + 5 * 3?"]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
async def test_prompts_sharing_a_prefix_reuse_it_and_generate_what_the_engine_without_it_does(
    kind: str,
) -> None:
    cached, plain = pair(kind)
    seen = Prefills(cached.model)
    first = await cached.generate(ask(QUESTIONS[0], seed=1))
    full = seen.shapes[-1][1]
    assert full == len(first.prompt_ids)  # nothing cached yet: the whole prompt
    later = [await cached.generate(ask(q, seed=i + 2)) for i, q in enumerate(QUESTIONS[1:])]
    # each later prompt ran from the end of the shared system prompt, not from its start
    assert all(n < full - 20 for _, n in seen.shapes[1:])
    stats = cached.prefix_stats()
    assert stats["prefix_hit_tokens"] >= 3 * 20 and stats["prefix_entries"] >= 1
    # and generated what the engine without the cache generates, token for token
    for i, (q, got) in enumerate(zip(QUESTIONS, [first, *later], strict=True)):
        same(got, await plain.generate(ask(q, seed=i + 1)))
    # concurrently (hits of different lengths in one padded prefill) too
    together = await asyncio.gather(*(cached.generate(ask(q, seed=10 + i)) for i, q in enumerate(QUESTIONS)))
    for i, (q, got) in enumerate(zip(QUESTIONS, together, strict=True)):
        same(got, await plain.generate(ask(q, seed=10 + i)))
    assert plain.prefix_stats() == {}


async def test_a_group_sending_one_prompt_is_prefilled_once_per_admission() -> None:
    cached, plain = pair("llama")
    seen = Prefills(cached.model)
    group = await asyncio.gather(*(cached.generate(ask(QUESTIONS[1], seed=s)) for s in range(4)))
    assert seen.shapes[0][0] == 1  # one row through the model for the four members
    assert len({tuple(r.choices[0].response_ids) for r in group}) > 1  # each drew with its own seed
    for s, got in enumerate(group):
        same(got, await plain.generate(ask(QUESTIONS[1], seed=s)))


async def test_the_next_turn_of_a_conversation_starts_from_the_cached_turn() -> None:
    cached, plain = pair("llama")
    seen = Prefills(cached.model)
    turn1 = await cached.generate(ask(QUESTIONS[0], seed=3))
    history = [
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": turn1.choices[0].text},
    ]
    turn2 = await cached.generate(ask("And times two?", seed=4, history=history))
    n_turn2 = seen.shapes[-1][1]
    assert n_turn2 <= len(turn2.prompt_ids) - len(turn1.prompt_ids)  # the first turn's prompt was reused
    same(turn2, await plain.generate(ask("And times two?", seed=4, history=history)))


async def test_a_weight_swap_clears_the_cache() -> None:
    cached, plain = pair("llama")
    await cached.generate(ask(QUESTIONS[0], seed=1))
    assert cached.prefix_stats()["prefix_entries"] >= 1
    new = tiny("llama", seed=7)
    twin = tiny("llama", seed=7)
    twin.load_state_dict(new.state_dict())
    await cached.set_model(new)
    await plain.set_model(twin)
    assert cached.prefix_stats()["prefix_entries"] == 0
    # the old weights' prefix is not used: the new weights' tokens and log-probs
    same(await cached.generate(ask(QUESTIONS[1], seed=2)), await plain.generate(ask(QUESTIONS[1], seed=2)))


def test_the_cache_keeps_to_its_budget_and_a_longer_entry_replaces_its_prefix() -> None:
    def kv(n: int) -> list[tuple[Any, Any]]:
        return [(torch.zeros(1, 1, n, 4), torch.zeros(1, 1, n, 4))]  # 32 bytes a token

    cache = PrefixCache(budget_bytes=32 * 40)
    a = list(range(1, 21))
    cache.store(None, a, kv(20))
    cache.store(None, [*a, 50, 51], kv(22))  # extends a: a is superseded
    assert len(cache) == 1 and cache.nbytes == 32 * 22
    assert cache.lookup(None, [*a, 99]) == (20, cache._entries[(None, (*a, 50, 51))])
    assert cache.lookup("other-adapter", [*a, 99]) == (0, None)  # per adapter
    assert cache.lookup(None, a[:MIN_HIT]) == (0, None)  # too short to be worth it
    cache.store(None, list(range(100, 120)), kv(20))  # over budget: the least recently used goes
    assert cache.nbytes <= cache.budget_bytes and len(cache) == 1
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.epoch == 1


def test_deterministic_serving_keeps_the_cache_off() -> None:
    backend = TransformersBackend(
        tiny("llama"), model_name="tiny", settings=EngineSettings(deterministic=True)
    )
    assert backend.prefix_stats() == {}
