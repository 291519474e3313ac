"""What serving a LoRA policy through peft costs the embedded engine, against the adapter merged.

    python bench/engine_lora.py [--rounds 3] [--threads 0] [--batch 1 8] [--prompt 96] [--steps 10]

SmolLM2-135M-Instruct (``agl models prepare``) with a LoRA adapter like the main job's (r=16, alpha 32,
every linear layer, random non-zero B so the adapter changes the output), in fp32 and bf16, served
three ways: the base model alone (no adapter: the floor), the adapter through peft (what an engine
that shares the policy's frozen weights runs), and the adapter merged into a copy of the weights
(``agl.engine.merged_lora.merged_copy``, what a bf16 engine of a LoRA policy runs). For each,
one prefill of ``--prompt`` tokens per row and ``--steps`` decode steps through a ``DynamicCache``, at
each ``--batch`` size, in interleaved rounds (every variant once per round); the median round is
reported, with merged / peft within each round. The merged and peft models' log-probs of the same
prompt are compared with the fp32 policy's through peft (what the trainer computes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(variant: str, dtype: Any) -> Any:
    """The variant's model with the engine's LM-head fix (``contiguous_head``), as the engine runs it."""
    from agl.engine.batching import contiguous_head

    model = _build(variant, dtype)
    contiguous_head(model)
    return model


def _build(variant: str, dtype: Any) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from agl.chat.models import prepare_default_model
    from agl.engine.merged_lora import merged_copy

    base = AutoModelForCausalLM.from_pretrained(str(prepare_default_model()), dtype=torch.float32)
    if variant == "base":
        return base.to(dtype).eval()
    torch.manual_seed(0)
    policy = get_peft_model(
        base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    )
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    if variant == "peft":
        return policy.to(dtype).eval()
    merged = merged_copy(policy, dtype)
    assert merged is not None
    return merged.model.eval()


def timed(model: Any, batch: int, prompt: int, steps: int) -> tuple[float, float]:
    """Seconds of one prefill of ``batch`` rows and of one decode step (mean over ``steps``)."""
    import torch
    from transformers import DynamicCache

    ids = torch.randint(100, 20000, (batch, prompt), generator=torch.Generator().manual_seed(batch))
    with torch.inference_mode():
        cache = DynamicCache()
        t0 = time.perf_counter()
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - t0
        nxt = ids[:, -1:]
        t0 = time.perf_counter()
        for _ in range(steps):
            model(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return prefill, (time.perf_counter() - t0) / steps


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt", type=int, default=96)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    variants = ["base", "peft", "merged"]
    models = {(d, v): build(v, dt) for d, dt in dtypes.items() for v in variants}
    ids = torch.randint(100, 20000, (1, args.prompt), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():  # against the fp32 policy through peft (what the trainer computes)
        lp = {
            k: torch.log_softmax(m(input_ids=ids).logits.float(), -1)
            for k, m in models.items()
            if k[1] != "base"
        }
        for key, got in lp.items():
            if key != ("fp32", "peft"):
                dev = (got - lp[("fp32", "peft")]).abs()
                print(
                    f"{key[0]} {key[1]}: |log-prob - fp32 peft's| max {dev.max().item():.4f}, mean {dev.mean().item():.5f}"
                )
    for model in models.values():  # warm-up
        timed(model, 2, 16, 2)
    results: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for b in args.batch:
            for key, model in models.items():
                results.setdefault((*key, b), []).append(timed(model, b, args.prompt, args.steps))
        print(f"round {r + 1} done (load {os.getloadavg()[0]:.1f})", flush=True)
    print(
        f"\ntorch threads {torch.get_num_threads()}, prompt {args.prompt} tokens, median of {args.rounds} rounds\n"
    )
    print(
        "| dtype | batch | variant | prefill ms | decode step ms | merged/peft prefill | merged/peft step |"
    )
    print("|---|---:|---|---:|---:|---:|---:|")
    for d in dtypes:
        for b in args.batch:
            for v in variants:
                runs = results[(d, v, b)]
                pre = statistics.median(x[0] for x in runs) * 1e3
                step = statistics.median(x[1] for x in runs) * 1e3
                ratio = ("", "")
                if v == "merged":
                    peft = results[(d, "peft", b)]
                    ratio = (
                        f"{statistics.median(m[0] / q[0] for m, q in zip(runs, peft, strict=True)):.2f}",
                        f"{statistics.median(m[1] / q[1] for m, q in zip(runs, peft, strict=True)):.2f}",
                    )
                print(f"| {d} | {b} | {v} | {pre:.0f} | {step:.0f} | {ratio[0]} | {ratio[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
