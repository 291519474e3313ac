"""LightningRL policy-update throughput against TRL's GRPOTrainer on the same batch.

    python bench/trainer.py                       # tiny random Llama (seconds)
    python bench/trainer.py --model smollm2       # the embedded SmolLM2-135M-Instruct (LoRA)
    python bench/trainer.py --model /path/to/hf   # any local model (on a GPU when there is one)
    python bench/trainer.py --model qwen0.5b-random   # a model's shape with random weights: no files
                                                      # needed (smollm2-random, qwen0.5b-/qwen1.5b-random)

Both sides train the same LoRA model on the same transitions (prompt + response token ids, one
advantage each, engine log-probs as the behaviour policy) for ``--iters`` optimizer steps:

- agl: ``PolicyUpdate.step`` (micro-batches packed by ``--micro-batch-tokens``, gradient accumulation);
- TRL: ``GRPOTrainer.training_step`` on the whole batch padded as GRPO pads it, then clip + optimizer
  step — the inner loop of ``GRPOTrainer.train()`` without generation.

Both sides checkpoint activations or neither (``--gradient-checkpointing``, default on: what agl picks
for these batches on a CPU and always on a GPU); TRL's side has it switched on as ``Trainer.train()``
would, since the benchmark drives ``training_step`` directly. The ``*-random`` models need no model
files (the tokenizer is the one agl ships): their throughput is the real model's, their log-probs not.

tokens/s counts prompt + response tokens per second of update. Target (docs/architecture.md §10):
agl within 10% of TRL. Each side runs in its own child process, so the peak RSS reported for it
(``ru_maxrss``: model, optimizer, activations) is its own. Long agent prompts:

    python bench/trainer.py --model smollm2 --transitions 4 --prompt-len 2048 --response-len 32 \
        --micro-batch-tokens 4096
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _model(name: str, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if name == "tiny":
        cfg = LlamaConfig(
            vocab_size=49152,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
        return LlamaForCausalLM(cfg)
    shapes = {
        "smollm2-random": dict(
            kind="llama",
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        ),
        "qwen0.5b-random": dict(
            kind="qwen2",
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
        ),
        "qwen1.5b-random": dict(
            kind="qwen2",
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
        ),
    }
    if name in shapes:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        spec = dict(shapes[name])
        kind = spec.pop("kind")
        if kind == "llama":
            m = LlamaForCausalLM(LlamaConfig(**spec))
        else:
            m = Qwen2ForCausalLM(Qwen2Config(**spec))
        return m.to(torch.bfloat16) if torch.cuda.is_available() else m
    if name == "smollm2":
        from agl.chat.models import prepare_default_model

        name = str(prepare_default_model())
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype)


def _batch(n: int, prompt_len: int, response_len: int, seed: int):
    from agl.types import Transition

    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = max(8, int(prompt_len * rng.uniform(0.5, 1.5)))
        r = max(2, int(response_len * rng.uniform(0.5, 1.5)))
        out.append(
            Transition(
                rollout_id=f"r{i}",
                attempt=1,
                index=0,
                prompt_ids=tuple(rng.randrange(100, 40000) for _ in range(p)),
                response_ids=tuple(rng.randrange(100, 40000) for _ in range(r)),
                response_logprobs=tuple(-rng.uniform(0.5, 3.0) for _ in range(r)),
            )
        )
    adv = [rng.choice((-1.0, 1.0)) * rng.uniform(0.2, 1.5) for _ in range(n)]
    return out, adv


def bench_agl(args, transitions, adv, tok) -> float:
    import agl
    from agl.algorithms.update import PolicyUpdate

    algo = agl.LightningRL(
        learning_rate=1e-5,
        micro_batch_tokens=args.micro_batch_tokens,
        lora_r=16,
        lora_alpha=32,
        gradient_checkpointing=args.gradient_checkpointing == "on",
    )
    up = PolicyUpdate(_model(args.model, 0), tok, algo, output_dir="/tmp/agl-bench-trainer/agl")
    args.used_micro_batch_tokens = up.micro_batch_tokens
    up.step(transitions, adv)  # warm-up
    rates = []
    for _ in range(args.iters):
        rates.append(up.step(transitions, adv)["tokens_per_s"])
    return statistics.median(rates)


def bench_trl(args, transitions, adv, tok) -> float:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import pad

    use_cuda = torch.cuda.is_available()
    n = len(transitions)
    cfg = GRPOConfig(
        output_dir="/tmp/agl-bench-trainer/trl",
        report_to=[],
        learning_rate=1e-5,
        loss_type="dapo",
        beta=0.0,
        num_generations=n,
        per_device_train_batch_size=n,
        steps_per_generation=1,
        gradient_checkpointing=args.gradient_checkpointing == "on",
        bf16=use_cuda and torch.cuda.is_bf16_supported(),
        use_cpu=not use_cuda,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        lr_scheduler_type="constant",
    )
    trainer = GRPOTrainer(
        model=_model(args.model, 0),
        reward_funcs=lambda **k: [0.0] * n,
        args=cfg,
        train_dataset=Dataset.from_list([{"prompt": ""}]),
        processing_class=tok,
        peft_config=LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        ),
    )
    model, _ = trainer._prepare_for_training(10**9, None, None)
    if cfg.gradient_checkpointing:  # what Trainer.train() does before its loop
        trainer.model.get_base_model().activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    dev = trainer.accelerator.device
    prompt = [torch.tensor(t.prompt_ids) for t in transitions]
    resp = [torch.tensor(t.response_ids) for t in transitions]
    inputs = {
        "prompt_ids": pad(prompt, padding_value=tok.pad_token_id, padding_side="left").to(dev),
        "prompt_mask": pad([torch.ones_like(p) for p in prompt], padding_value=0, padding_side="left").to(
            dev
        ),
        "completion_ids": pad(resp, padding_value=tok.pad_token_id, padding_side="right").to(dev),
        "completion_mask": pad([torch.ones_like(r) for r in resp], padding_value=0, padding_side="right").to(
            dev
        ),
        "advantages": torch.tensor(adv, device=dev),
        "old_per_token_logps": pad(
            [torch.tensor(t.response_logprobs) for t in transitions], padding_value=0.0, padding_side="right"
        ).to(dev),
    }
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in transitions)
    trainer._prepare_inputs = lambda x: x  # the batch is already what generation would have produced
    trainer.current_gradient_accumulation_steps = 1  # set by train()'s loop; one batch per step here

    def one() -> float:
        if use_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.training_step(model, dict(inputs), None)
        trainer.accelerator.clip_grad_norm_(model.parameters(), 1.0)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        if use_cuda:
            torch.cuda.synchronize()
        return tokens / (time.perf_counter() - t0)

    one()  # warm-up
    return statistics.median(one() for _ in range(args.iters))


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _child(args: argparse.Namespace, side: str) -> dict:
    """Run one side in a fresh interpreter; returns its tokens/s and peak RSS."""
    import json
    import subprocess

    argv = [sys.executable, __file__, "--side", side]
    for key in (
        "model",
        "transitions",
        "prompt_len",
        "response_len",
        "micro_batch_tokens",
        "iters",
        "threads",
        "gradient_checkpointing",
    ):
        if getattr(args, key) is not None:
            argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode:
        print(out.stderr[-3000:], file=sys.stderr)
        out.check_returncode()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", choices=("agl", "trl"), help=argparse.SUPPRESS)
    p.add_argument(
        "--model",
        default="tiny",
        help="tiny | smollm2 | smollm2-random | qwen0.5b-random | qwen1.5b-random | a local HF model dir",
    )
    p.add_argument("--transitions", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--response-len", type=int, default=16)
    p.add_argument(
        "--micro-batch-tokens", type=int, default=None, help="default: agl's per-device pick (RunConfig)"
    )
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument(
        "--gradient-checkpointing",
        choices=("on", "off"),
        default="on",
        help="activation checkpointing, on both sides (default: on)",
    )
    args = p.parse_args()
    import torch

    from agl.trainer.trainer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_tokenizer(
        None if args.model in ("tiny", "smollm2") or args.model.endswith("-random") else args.model
    )
    transitions, adv = _batch(args.transitions, args.prompt_len, args.response_len, seed=0)
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in transitions)
    if args.side is not None:
        import json

        run = bench_agl if args.side == "agl" else bench_trl
        rate = run(args, transitions, adv, tok)
        budget = getattr(args, "used_micro_batch_tokens", None)
        print(json.dumps({"tokens_per_s": rate, "peak_rss_mb": _peak_rss_mb(), "micro_batch_tokens": budget}))
        return
    mine, theirs = _child(args, "agl"), _child(args, "trl")
    ours, trl = mine["tokens_per_s"], theirs["tokens_per_s"]
    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"CPU ({torch.get_num_threads()} threads)"
    )
    print(f"\nLightningRL update vs TRL GRPOTrainer — {args.model}, {device}")
    print(
        f"{len(transitions)} transitions, {tokens} tokens, median of {args.iters} steps, "
        f"agl micro_batch_tokens {mine.get('micro_batch_tokens')}, "
        f"gradient checkpointing {args.gradient_checkpointing}\n"
    )
    print("| update | tokens/s | vs TRL | peak RSS (MB) |")
    print("|---|---:|---:|---:|")
    print(f"| TRL GRPOTrainer.training_step | {trl:,.0f} | 1.00 | {theirs['peak_rss_mb']:,.0f} |")
    print(f"| agl PolicyUpdate.step | {ours:,.0f} | {ours / trl:.2f} | {mine['peak_rss_mb']:,.0f} |")


if __name__ == "__main__":
    main()
