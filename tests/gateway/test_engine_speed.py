"""The embedded engine's speed-ups keep what it computes: inverse-CDF sampling draws from the row's
distribution with its own generator (never a token of probability zero), the in-place KV cache gives
the logits a growing ``DynamicCache`` gives, and ``dtype="auto"`` serves in bf16 only where the CPU
multiplies it natively, with the trainer told the engine's dtype differs from the policy's."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from agl.engine import EngineSettings  # noqa: E402
from agl.engine.batching import Batch, Row, draw, sample  # noqa: E402
from agl.engine.dtype import cpu_has_native_bf16, resolve_dtype, serves_other_dtype  # noqa: E402
from agl.engine.kv import SLACK, SlackLayer  # noqa: E402


def tiny(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


def test_draw_follows_the_distribution_and_never_draws_a_zero_probability_token() -> None:
    logp = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0, float("-inf"), 0.5]]), dim=-1)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[int(draw(logp, [gen])[0])] += 1
    assert counts[3] == 0
    assert (counts / counts.sum() - logp.exp()[0]).abs().max() < 0.03


def test_a_seeded_row_draws_the_same_tokens_whatever_rows_share_its_batch() -> None:
    logits = torch.randn(3, 50)

    def row(seed: int) -> Row:
        return Row([1], 10, 1.0, 1.0, None, torch.Generator().manual_seed(seed))

    alone = [sample([row(7)], logits[1:2])[0][0] for _ in range(1)]
    together = sample([row(1), row(7), row(3)], logits)[0][1]
    assert together == alone[0]
    # the recorded logprob is that of the sampled token under the distribution (top_p truncates it)
    r = Row([1], 10, 0.7, 0.5, None, torch.Generator().manual_seed(2))
    tokens, lps = sample([r], logits[:1])
    want = torch.log_softmax(logits[:1] / 0.7, dim=-1)
    assert lps[0] >= float(want[0, tokens[0]]) - 1e-6  # renormalised over the nucleus: never lower


def test_the_in_place_cache_gives_the_logits_a_growing_cache_gives() -> None:
    model = tiny()
    prompt = [5, 9, 13, 2, 7]
    batch = Batch(model, 0)
    rows = [Row(prompt, SLACK + 20, 0.0, 1.0, None, None), Row(prompt[:3], SLACK + 20, 0.0, 1.0, None, None)]
    with torch.inference_mode():
        batch.admit(rows)
        assert all(isinstance(layer, SlackLayer) for layer in batch.cache.layers)
        for _ in range(SLACK + 10):  # past one buffer: it grows once
            batch.step()
        ids = rows[0].prompt_ids + rows[0].ids[:-1]
        full = model(torch.tensor([ids])).logits[0, len(prompt) - 1 :].log_softmax(-1)
    greedy = full.argmax(-1).tolist()
    assert rows[0].ids == greedy
    assert rows[0].logprobs == pytest.approx(full.max(-1).values.tolist(), abs=1e-4)


def test_auto_dtype_is_bf16_only_where_the_cpu_has_it_and_the_trainer_is_told() -> None:
    assert resolve_dtype(None, "cpu") is None
    assert resolve_dtype("float32", "cpu") is torch.float32
    assert resolve_dtype("auto", "cpu") is (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("int8", "cpu")

    from agl.gateway.backends.transformers import TransformersBackend

    class Policy:
        model = tiny()

    engine = TransformersBackend.for_policy(Policy, settings=EngineSettings(dtype="bfloat16"))
    assert engine.serving_dtype is torch.bfloat16 and serves_other_dtype(engine, Policy)
    assert next(Policy.model.parameters()).dtype is torch.float32  # the policy's weights are not cast
    same = TransformersBackend.for_policy(Policy)
    assert same.serving_dtype is torch.float32 and not serves_other_dtype(same, Policy)


def test_a_push_into_a_bf16_engine_copies_the_trainable_tensors_cast() -> None:
    import asyncio

    from agl.gateway.backends.transformers import TransformersBackend

    class Policy:
        model = tiny(1)

    for name, p in Policy.model.named_parameters():
        p.requires_grad_("q_proj" in name)  # the trainable tensors (LoRA's role); the rest frozen
    engine = TransformersBackend.for_policy(Policy, settings=EngineSettings(dtype="bfloat16"))
    with torch.no_grad():
        for p in Policy.model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    version = asyncio.run(engine.push(Policy, version=3))
    assert version == 3
    served = dict(engine.model.named_parameters())
    for name, p in Policy.model.named_parameters():
        assert served[name].dtype is torch.bfloat16
        assert torch.equal(served[name], p.detach().to(torch.bfloat16))


def test_a_bf16_engine_serves_a_lora_policy_merged_and_each_push_remerges_it() -> None:
    import asyncio

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    from agl.gateway.backends.transformers import TransformersBackend

    class Policy:
        model = get_peft_model(tiny(2), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))

    lora_layers = {n: m for n, m in Policy.model.named_modules() if isinstance(m, LoraLayer)}
    engine = TransformersBackend.for_policy(Policy, settings=EngineSettings(dtype="bfloat16"))
    # no peft module left in the engine: the adapter is in the weights
    assert not any(isinstance(m, LoraLayer) for m in engine.model.modules())
    assert engine.serving_dtype is torch.bfloat16 and serves_other_dtype(engine, Policy)
    ids = torch.tensor([[5, 9, 11, 3, 7, 21, 30, 2]])

    def logps(model: Any) -> Any:
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)

    for step in range(2):  # train the adapter a little (B starts at zero: the first push changes it)
        with torch.no_grad():
            for p in Policy.model.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn_like(p))
        asyncio.run(engine.push(Policy, version=step + 1))
        served = dict(engine.model.named_modules())
        for name, lora in lora_layers.items():
            inner = name.removeprefix("base_model.model.")
            want = lora.get_base_layer().weight + lora.get_delta_weight("default")
            assert torch.equal(served[inner].weight, want.detach().to(torch.bfloat16))
        # the engine's log-probs are the policy's up to bf16 rounding, and far from the unadapted base's
        policy, served_lp = logps(Policy.model), logps(engine.model)
        with Policy.model.disable_adapter():
            base = logps(Policy.model)
        assert (served_lp - policy).abs().max() < 0.05 < (base - policy).abs().max()
    assert engine.weight_version == 2
    # an fp32 engine (the policy's dtype) still shares the frozen weights and runs the adapter unmerged
    same = TransformersBackend.for_policy(Policy)
    assert any(isinstance(m, LoraLayer) for m in same.model.modules())
