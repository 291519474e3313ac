"""The LightningRL policy update on TRL: packing, token-mean PPO-clip, behaviour log-probs, KL, LoRA
merging, checkpoints. A tiny random Llama with the shipped SmolLM2 tokenizer stands in for a model."""

from __future__ import annotations

import asyncio
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from agl.algorithms.lightning_rl import LightningRL  # noqa: E402
from agl.algorithms.update import PolicyUpdate, chunked_token_logps, pack_micro_batches  # noqa: E402
from agl.config import RunConfig  # noqa: E402
from agl.gateway.backends.base import GenerationRequest  # noqa: E402
from agl.gateway.backends.transformers import TransformersBackend  # noqa: E402
from agl.trainer.trainer import load_tokenizer  # noqa: E402
from agl.types import Transition  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core CI box OpenMP threads
    contending with other processes make each step ~10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


def make(tok, tmp_path, *, seed: int = 0, temperature: float = 1.0, **cfg) -> PolicyUpdate:
    # float32 on every device: the equalities below are exact up to float32 error, which bf16 autocast
    # (the GPU default) is not
    algo = LightningRL(
        **{"learning_rate": 5e-3, "lora_r": 8, "lora_alpha": 16, "mixed_precision": "no", **cfg}
    )
    config = RunConfig.resolve(algo, sampling={"temperature": temperature})
    return PolicyUpdate(tiny_model(seed), tok, config, output_dir=tmp_path / "ckpt", seed=seed)


def sample(backend: TransformersBackend, prompts: list[str], temperature: float) -> list[Transition]:
    """Transitions as the gateway records them: the engine's prompt ids, sampled ids and logprobs."""

    async def go() -> list:
        reqs = [
            GenerationRequest(
                model="tiny",
                messages=[{"role": "user", "content": p}],
                temperature=temperature,
                max_tokens=12,
            )
            for p in prompts
        ]
        return await asyncio.gather(*(backend.generate(r) for r in reqs))

    out = []
    for i, res in enumerate(asyncio.run(go())):
        c = res.choices[0]
        out.append(
            Transition(
                rollout_id=f"r{i}",
                attempt=1,
                index=0,
                prompt_ids=tuple(res.prompt_ids),
                response_ids=tuple(c.response_ids),
                response_logprobs=tuple(c.logprobs),
            )
        )
    return out


def tr(tok, prompt: str, response: str, rid: str = "r", logprobs=None) -> Transition:
    p = tuple(
        tok.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
    r = tuple(tok(response, add_special_tokens=False)["input_ids"]) + (tok.eos_token_id,)
    return Transition(
        rollout_id=rid, attempt=1, index=0, prompt_ids=p, response_ids=r, response_logprobs=logprobs
    )


def seq_logprob(up: PolicyUpdate, ts: list[Transition]) -> list[float]:
    return [sum(x) for x in up.response_logprobs(ts)]


def test_packing_respects_the_token_budget_and_never_mixes_behaviour_sources(tok) -> None:
    ts = [
        tr(tok, "short", "a", "r1"),
        tr(tok, "a somewhat longer prompt for the model to read", "longer answer here", "r2", logprobs=None),
        tr(tok, "x" * 400, "y", "r3"),
    ]
    ts.append(
        ts[0].model_copy(
            update={"rollout_id": "r4", "response_logprobs": tuple([-1.0] * len(ts[0].response_ids))}
        )
    )
    longest = max(len(t.prompt_ids) + len(t.response_ids) for t in ts[:2])
    mbs = pack_micro_batches(ts, longest * 2)
    assert sorted(i for mb in mbs for i in mb.rows) == [0, 1, 2, 3]
    for mb in mbs:
        assert len({ts[i].response_logprobs is not None for i in mb.rows}) == 1
        assert mb.has_logprobs == (ts[mb.rows[0]].response_logprobs is not None)
        if len(mb.rows) > 1:
            assert mb.padded_tokens <= longest * 2
    # the over-long transition runs alone rather than being dropped or split
    [alone] = [mb for mb in mbs if 2 in mb.rows]
    assert alone.rows == [2]
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack_micro_batches(ts, 0)


def test_rewarded_response_becomes_likelier_and_penalised_one_less(tok, tmp_path) -> None:
    up = make(tok, tmp_path)
    good, bad = tr(tok, "Say the answer", "Answer: 42", "g"), tr(tok, "Say the answer", "I do not know", "b")
    before = seq_logprob(up, [good, bad])
    for _ in range(4):
        # behaviour log-probs recorded by "the engine" (here: the current policy), as the gateway does
        lps = up.response_logprobs([good, bad])
        batch = [
            t.model_copy(update={"response_logprobs": tuple(lp)})
            for t, lp in zip([good, bad], lps, strict=True)
        ]
        metrics = up.step(batch, [1.0, -1.0])
    after = seq_logprob(up, [good, bad])
    assert after[0] > before[0] + 0.5
    assert after[1] < before[1] - 0.5
    assert metrics["trained_transitions"] == 2 and metrics["tokens_per_s"] > 0 and metrics["grad_norm"] > 0
    assert up.global_step == 4


def test_loss_is_the_token_mean_over_the_whole_step_across_micro_batches(tok, tmp_path) -> None:
    """At ratio 1 the PPO-clip loss is -sum_i(A_i * n_i) / sum_i(n_i): one token-mean over all response
    tokens of the step, whatever the micro-batching."""
    ts = [tr(tok, f"question {i}", "word " * (i + 1), f"r{i}") for i in range(4)]
    adv = [1.0, -0.5, 2.0, -1.5]
    n = [len(t.response_ids) for t in ts]
    expected = -sum(a * k for a, k in zip(adv, n, strict=True)) / sum(n)
    small = make(tok, tmp_path / "a", micro_batch_tokens=40)
    big = make(tok, tmp_path / "b", micro_batch_tokens=100_000)
    m_small = small.step(ts, adv)
    m_big = big.step(ts, adv)
    assert m_small["micro_batches"] > 1 and m_big["micro_batches"] == 1
    assert m_small["loss"] == pytest.approx(expected, abs=1e-5)
    assert m_big["loss"] == pytest.approx(expected, abs=1e-5)
    # gradient accumulation over micro-batches gives the same update as one big batch
    a, b = small.merged_state_dict(), big.merged_state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    assert m_small["grad_norm"] == pytest.approx(m_big["grad_norm"], rel=1e-4)


def test_ratio_uses_the_engine_logprobs_and_clips(tok, tmp_path) -> None:
    up = make(tok, tmp_path)
    assert up.precision == "no"  # what the trainer's off-policy warning reads
    t = tr(tok, "hello", "some response text", "r")
    [cur] = up.response_logprobs([t])
    # The engine was much less likely to produce this response than the policy now is: ratio e^1 > 1+eps,
    # so with a positive advantage every token is clipped and nothing moves.
    stale = t.model_copy(update={"response_logprobs": tuple(x - 1.0 for x in cur)})
    m = up.step([stale], [1.0])
    assert m["clip_fraction"] == pytest.approx(1.0)
    assert m["grad_norm"] == pytest.approx(0.0, abs=1e-8)
    # Without engine log-probs the current policy is the behaviour policy: ratio 1, nothing clipped.
    m = up.step([t], [1.0])
    assert m["clip_fraction"] == 0.0 and m["grad_norm"] > 0


def test_zero_advantage_transitions_are_skipped_without_kl(tok, tmp_path) -> None:
    up = make(tok, tmp_path)
    ts = [tr(tok, "a", "b", "r1"), tr(tok, "c", "d", "r2")]
    m = up.step(ts, [0.0, 0.0])
    assert m["skipped"] == 2 and m["trained_transitions"] == 0 and m["loss"] == 0.0
    with pytest.raises(ValueError, match="advantages"):
        up.step(ts, [1.0])
    with pytest.raises(ValueError, match="finite"):
        up.step(ts, [math.nan, 1.0])


def test_mask_truncated_leaves_calls_cut_at_max_tokens_out_of_the_loss(tok, tmp_path) -> None:
    """DAPO's overlong filtering: with mask_truncated a call the engine cut at max_tokens carries no
    gradient (its negative advantage would push down every token of an unfinished answer); without
    it, it is trained like any other. Either way the step reports how many calls were cut."""
    cut = tr(tok, "a", "b c d", "r1").model_copy(update={"truncated": True})
    done = tr(tok, "a", "e", "r2")
    m = make(tok, tmp_path / "plain").step([cut, done], [-1.0, 1.0])
    assert m["trained_transitions"] == 2 and m["skipped"] == 0 and m["truncated_calls"] == 1
    assert m["response_tokens"] == len(cut.response_ids) + len(done.response_ids)
    masked = make(tok, tmp_path / "masked", mask_truncated=True)
    m = masked.step([cut, done], [-1.0, 1.0])
    assert m["trained_transitions"] == 1 and m["skipped"] == 1 and m["truncated_calls"] == 1
    assert m["response_tokens"] == len(done.response_ids)
    m = masked.step([cut], [-1.0])  # only a cut call: nothing to train, the policy is left as it was
    assert m["trained_transitions"] == 0 and m["loss"] == 0.0 and m["grad_norm"] == 0.0
    # one conversation merged into one sequence: only the cut turn's tokens are masked
    follow = Transition(
        rollout_id="r1",
        attempt=1,
        index=1,
        prompt_ids=cut.prompt_ids
        + cut.response_ids
        + tuple(tok("go on", add_special_tokens=False)["input_ids"]),
        response_ids=done.response_ids,
    )
    m = masked.step([cut, follow], [-1.0, -1.0])
    assert m["sequences"] == 1 and m["trained_transitions"] == 1 and m["skipped"] == 1
    assert m["response_tokens"] == len(follow.response_ids)
    with pytest.raises(ValueError, match="mask_truncated must be True or False"):
        LightningRL(mask_truncated="yes")


def test_kl_to_the_base_model_with_lora_adapters_disabled(tok, tmp_path) -> None:
    up = make(tok, tmp_path, kl_coef=0.1)
    ts = [tr(tok, "hi", "Answer: 1", "r1"), tr(tok, "hi", "nope", "r2")]
    first = up.step(ts, [1.0, -1.0])
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # zero-initialised LoRA: policy == reference
    for _ in range(3):
        last = up.step(ts, [1.0, -1.0])
    assert last["kl"] > 1e-5


def test_full_finetuning_with_kl_keeps_a_frozen_reference(tok, tmp_path) -> None:
    up = make(tok, tmp_path, lora=False, kl_coef=0.1, learning_rate=1e-3)
    assert not up.is_lora and up.trainer.ref_model is not None
    ts = [tr(tok, "hi", "Answer: 1", "r1"), tr(tok, "hi", "nope", "r2")]
    for _ in range(3):
        m = up.step(ts, [1.0, -1.0])
    assert m["kl"] > 0
    ref = up.trainer.ref_model
    assert all(not p.requires_grad for p in ref.parameters())


def test_merged_weights_reproduce_the_lora_policy_in_a_plain_model(tok, tmp_path) -> None:
    up = make(tok, tmp_path)
    ts = [tr(tok, "q", "Answer: 7", "r1"), tr(tok, "q", "no", "r2")]
    for _ in range(2):
        up.step(ts, [1.0, -1.0])
    plain = tiny_model(seed=123).to(up.device)
    plain.load_state_dict(up.merged_state_dict(), strict=True)
    ids = torch.tensor([list(ts[0].prompt_ids + ts[0].response_ids)], device=up.device)
    with torch.no_grad():
        a = plain(ids).logits
        b = up.model(ids).logits
    assert (a - b).abs().max().item() < 1e-4
    assert up.is_lora  # the training model itself still carries the adapter


def test_checkpoint_round_trip_restores_policy_and_optimizer(tok, tmp_path) -> None:
    up = make(tok, tmp_path / "one")
    ts = [tr(tok, "q", "Answer: 7", "r1"), tr(tok, "q", "no", "r2")]
    for _ in range(3):
        up.step(ts, [1.0, -1.0])
    path = up.save_checkpoint()
    want = seq_logprob(up, ts)
    again = make(tok, tmp_path / "two")  # same base weights (same seed), fresh adapter
    assert seq_logprob(again, ts) != pytest.approx(want)
    assert again.load_checkpoint(path) == 3
    assert seq_logprob(again, ts) == pytest.approx(want, abs=1e-5)
    # the optimizer state came back too: the next step is identical
    m1, m2 = up.step(ts, [1.0, -1.0]), again.step(ts, [1.0, -1.0])
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert seq_logprob(again, ts) == pytest.approx(seq_logprob(up, ts), abs=1e-5)
    with pytest.raises(FileNotFoundError, match="not an agl checkpoint"):
        again.load_checkpoint(tmp_path)
    adapter_dir = up.save_adapter(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").exists() and adapter_dir.endswith("adapter")


def test_first_ratio_is_one_when_the_engine_sampled_at_the_update_temperature(tok, tmp_path) -> None:
    """On-policy by construction: the engine samples at 0.7 and records those logprobs; the update
    recomputes them at the run's temperature, 0.7, so every token's ratio is 1 before the first
    optimizer step. Scored at temperature 1 (what agl used to do) the same samples are off-policy."""
    up = make(tok, tmp_path / "a", temperature=0.7)
    engine = TransformersBackend.for_policy(up, tokenizer=tok, model_name="tiny")
    ts = sample(engine, ["tell me a story", "count to ten", "hi", "what is 2+2?"], 0.7)
    assert all(len(t.response_ids) > 0 for t in ts)
    m = up.step(ts, [1.0, -1.0, 0.5, -0.5])
    assert m["behaviour_ratio_dev"] < 1e-4
    assert m["clip_fraction"] == 0.0
    off = make(tok, tmp_path / "b", temperature=1.0)
    assert off.step(ts, [1.0, -1.0, 0.5, -0.5])["behaviour_ratio_dev"] > 0.05
    engine.engine._executor.shutdown(wait=False)


def test_chunked_logprobs_equal_the_full_log_softmax_with_gradients() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    targets = torch.randint(0, 300, (3, 7))
    lp, ent = chunked_token_logps(hidden, targets, head, 0.7, chunk=5)
    full = (head(hidden) / 0.7).log_softmax(-1)
    want = full.gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(lp, want, atol=1e-5)
    assert torch.allclose(ent, -(full.exp() * full).sum(-1), atol=1e-4)
    (g1,) = torch.autograd.grad(lp.sum(), hidden)
    (g2,) = torch.autograd.grad(want.sum(), hidden)
    assert torch.allclose(g1, g2, atol=1e-5)


def test_gradient_checkpointing_recomputes_the_layers_and_keeps_the_gradient(
    tok, tmp_path, monkeypatch
) -> None:
    """``gradient_checkpointing=True`` must reach the decoder layers (transformers only turns it on in
    ``Trainer.train()``, which agl never calls): each layer then runs twice per micro-batch (forward,
    and again in the backward pass) instead of keeping its activations, for the same gradient."""
    batch = [tr(tok, f"question {i}", "Answer: " + "7" * (i + 1), f"r{i}") for i in range(3)]
    advantages = [1.0, -0.5, 0.25]
    runs: dict[bool, tuple[int, float]] = {}
    for on in (False, True):
        up = make(tok, tmp_path / f"gc{on}", gradient_checkpointing=on)
        assert up.gradient_checkpointing is on
        calls: list[int] = []
        # counted in the MLP's forward: module hooks do not fire when checkpointing recomputes a layer
        mlp = up.model.get_base_model().model.layers[0].mlp
        forward = type(mlp).forward

        def counting(self, *args, _mlp=mlp, _forward=forward, _calls=calls, **kwargs):
            if self is _mlp:
                _calls.append(1)
            return _forward(self, *args, **kwargs)

        monkeypatch.setattr(type(mlp), "forward", counting)
        metrics = up.step(batch, advantages)
        monkeypatch.undo()
        assert metrics["micro_batches"] == 1
        runs[on] = (len(calls), metrics["grad_norm"])
    assert runs[False][0] == 1 and runs[True][0] == 2
    assert runs[True][1] == pytest.approx(runs[False][1], rel=1e-4)


def test_push_shares_the_base_weights_and_copies_only_the_adapter(tok, tmp_path) -> None:
    up = make(tok, tmp_path)
    engine = TransformersBackend.for_policy(up, tokenizer=tok, model_name="tiny")
    policy = dict(up.model.named_parameters())
    served = dict(engine.model.named_parameters())
    assert set(policy) == set(served)
    frozen = [n for n, p in policy.items() if not p.requires_grad]
    lora = [n for n, p in policy.items() if p.requires_grad]
    assert lora and all("lora_" in n for n in lora)
    # the base weights exist once: the engine's are the policy's tensors
    assert all(served[n] is policy[n] for n in frozen)
    assert all(served[n].data_ptr() != policy[n].data_ptr() for n in lora)
    ts = [tr(tok, "q", "Answer: 7", "r1"), tr(tok, "q", "no", "r2")]
    ids = torch.tensor([list(ts[0].prompt_ids + ts[0].response_ids)], device=up.device)
    with torch.no_grad():
        out0 = engine.model(ids).logits
    for _ in range(2):
        up.step(ts, [1.0, -1.0])
    with torch.no_grad():
        assert torch.equal(engine.model(ids).logits, out0)  # an update alone does not reach the engine
    snapshot = {n: p.detach().clone() for n, p in served.items()}
    ptrs = {n: served[n].data_ptr() for n in lora}
    assert asyncio.run(engine.push(up, version=5)) == 5 and engine.weight_version == 5
    changed = {n for n, p in engine.model.named_parameters() if not torch.equal(p, snapshot[n])}
    assert changed and changed <= set(lora)
    assert all(served[n].data_ptr() == ptrs[n] for n in lora)  # copied in place, nothing allocated
    with torch.no_grad():
        out1 = engine.model(ids).logits
        assert not torch.allclose(out0, out1)
        up.model.eval()
        assert torch.allclose(out1, up.model(ids).logits, atol=1e-5)
    engine.engine._executor.shutdown(wait=False)


def test_full_finetuning_push_copies_every_weight_in_place(tok, tmp_path) -> None:
    up = make(tok, tmp_path, lora=False, learning_rate=1e-3)
    engine = TransformersBackend.for_policy(up, tokenizer=tok, model_name="tiny")
    served = dict(engine.model.named_parameters())
    assert all(served[n] is not p for n, p in up.model.named_parameters())
    ts = [tr(tok, "q", "Answer: 7", "r1"), tr(tok, "q", "no", "r2")]
    up.step(ts, [1.0, -1.0])
    asyncio.run(engine.push(up, version=1))
    for n, p in up.model.named_parameters():
        assert torch.equal(served[n], p)
    engine.engine._executor.shutdown(wait=False)


def test_run_config_refuses_bad_values_with_clear_messages() -> None:
    assert RunConfig().sampling == {"temperature": 1.0, "top_p": 1.0, "max_tokens": 64}
    cases = [
        ({"temperature": -0.1}, "RunConfig.temperature must be a finite number >= 0"),
        ({"temperature": math.inf}, "RunConfig.temperature"),
        ({"top_p": 1.5}, "RunConfig.top_p must be a finite number > 0"),
        ({"max_tokens": 0}, "RunConfig.max_tokens must be an integer >= 1"),
        ({"learning_rate": -1.0}, "RunConfig.learning_rate"),
        ({"micro_batch_tokens": 2.5}, "RunConfig.micro_batch_tokens must be an integer"),
        ({"mixed_precision": "fp8"}, "RunConfig.mixed_precision"),
        ({"gradient_checkpointing": "yes"}, "RunConfig.gradient_checkpointing"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
            RunConfig(**kwargs)
    # valid for dev(), refused for training, with the reason
    with pytest.raises(ValueError, match="temperature must be > 0 for training"):
        RunConfig(temperature=0).check_trainable()
    with pytest.raises(ValueError, match="top_p must be 1.0 for training, got 0.9"):
        RunConfig(top_p=0.9).check_trainable()
    with pytest.raises(ValueError, match="top_p must be 1.0 for training"):
        PolicyUpdate(tiny_model(), load_tokenizer(), RunConfig(top_p=0.9))
    with pytest.raises(ValueError, match="unknown sampling setting 'temprature'"):
        RunConfig.resolve(sampling={"temprature": 0.7})
    with pytest.raises(ValueError, match="'learning_rate' is not a sampling setting"):
        RunConfig.resolve(sampling={"learning_rate": 0.1})
    # one source of defaults: the algorithm's update fields and the config's agree, overrides win
    cfg = RunConfig.resolve(LightningRL(learning_rate=3e-4), sampling={"temperature": 0.7})
    assert (cfg.learning_rate, cfg.temperature, cfg.clip_eps) == (3e-4, 0.7, LightningRL().clip_eps)
    base = RunConfig(temperature=0.5, lora_r=4)
    cfg = RunConfig.resolve(LightningRL(), base=base, update={"kl_coef": 0.1})
    assert (cfg.temperature, cfg.lora_r, cfg.kl_coef) == (0.5, 4, 0.1)


def test_micro_batch_budget_is_picked_per_device_when_unset(monkeypatch) -> None:
    """None means 4096 on CPU; on a GPU, the largest power of two up to 65536 whose estimated
    memory fits in half the free memory (bigger vocabularies get smaller budgets)."""
    from agl.algorithms import update as upd

    small, big = tiny_model(), tiny_model()
    big.config.vocab_size = 151936
    assert upd.auto_micro_batch_tokens(small, use_cuda=False) == 4096
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (80 * 2**30, 80 * 2**30))
    assert upd.auto_micro_batch_tokens(small, use_cuda=True) == 65536
    assert upd.auto_micro_batch_tokens(big, use_cuda=True) == 16384
    deep = tiny_model()
    deep.config.num_hidden_layers, deep.config.hidden_size = 28, 1536
    # without checkpointing every layer keeps its activations: a smaller budget for the same memory
    assert upd.auto_micro_batch_tokens(deep, use_cuda=True, checkpointing=False) < (
        upd.auto_micro_batch_tokens(deep, use_cuda=True)
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (2 * 2**30, 80 * 2**30))
    assert upd.auto_micro_batch_tokens(big, use_cuda=True) == 4096  # never below the CPU budget
    assert RunConfig(micro_batch_tokens=None).micro_batch_tokens is None
