"""Serving cost of an adapter per agent on CPU: one continuous batch whose rows use different LoRA adapters.

    python bench/adapters.py [--threads 2] [--new-tokens 48] [--rounds 2]

SmolLM2-135M-Instruct (``agl models prepare``) wrapped by peft with LoRA r=16 on every linear layer,
each adapter's B matrices random (so adapters really differ). 8 concurrent requests (greedy, the
same 8 prompts, ``min_tokens``-free: tokens counted as the backend returns them) straight into
``TransformersBackend.generate`` (no HTTP), in one round, back to back:

- ``plain``: one adapter, active in peft, served the way a shared-policy run serves it (no per-row
  ``adapter_names``): the reference;
- ``1 adapter/row``: the same adapter named per row (the per-agent path with one agent);
- ``2 adapters``, ``4 adapters``: the 8 rows spread round-robin over 2 or 4 adapters;
- with ``--batched-lora``, also ``2 batched``/``4 batched``: the same rows through the batched LoRA
  product (``TransformersBackend(batched_lora=True)``: the adapters concatenated once per layer, two
  dense matmuls over the whole batch with a per-row mask on the rank blocks) instead of peft's
  per-adapter loop.

Target (issue 35): 2 and 4 adapters >= 0.8x ``plain`` tokens/s. Figures: bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time
from typing import Any

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how photosynthesis works.",
    "List some tips for learning a new language.",
    "Describe the city of Paris to a tourist.",
    "What are the benefits of regular exercise?",
    "Explain what a neural network is.",
    "Write a poem about the sea.",
    "How do airplanes stay in the air?",
]
NAMES = ["a0", "a1", "a2", "a3"]


def peft_model() -> Any:
    """SmolLM2 with four LoRA adapters (r=16, all linear layers), B random per adapter."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from agl.chat.models import prepare_default_model

    base = AutoModelForCausalLM.from_pretrained(str(prepare_default_model()), dtype=torch.float32)
    cfg = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg, adapter_name=NAMES[0])
    for name in NAMES[1:]:
        model.add_adapter(name, cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for k, p in model.named_parameters():
            if "lora_B" in k:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    model.set_adapter(NAMES[0])
    return model.eval()


def run(backend: Any, adapters: list[str | None], new_tokens: int) -> tuple[float, int]:
    """8 concurrent greedy requests, row i on ``adapters[i % len]``; returns (seconds, tokens)."""
    from agl.gateway.backends.base import GenerationRequest

    async def go() -> list[Any]:
        reqs = [
            GenerationRequest(
                model="m",
                messages=[{"role": "user", "content": p}],
                temperature=0.0,
                max_tokens=new_tokens,
                adapter=adapters[i % len(adapters)],
            )
            for i, p in enumerate(PROMPTS)
        ]
        return await asyncio.gather(*(backend.generate(r) for r in reqs))

    t0 = time.perf_counter()
    results = asyncio.run(go())
    return time.perf_counter() - t0, sum(len(r.choices[0].response_ids) for r in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batched-lora", action="store_true", help="also the batched LoRA product's cases")
    ap.add_argument(
        "--cases",
        nargs="+",
        default=None,
        help="only these cases, by label (e.g. plain '4 adapters' '4 batched'): more rounds in the same time",
    )
    args = ap.parse_args()
    import torch

    from agl.engine import EngineSettings
    from agl.gateway.backends.transformers import TransformersBackend

    torch.set_num_threads(args.threads)
    model = peft_model()
    backend = TransformersBackend(
        model, model_name="m", settings=EngineSettings(max_batch_size=8, threads=args.threads)
    )
    cases: list[tuple[str, list[str], list[str | None], bool]] = [
        ("plain", [], [None], False),
        ("1 adapter/row", NAMES[:1], NAMES[:1], False),
        ("2 adapters", NAMES[:2], NAMES[:2], False),
        ("4 adapters", NAMES, NAMES, False),
    ]
    if args.batched_lora:
        cases += [("2 batched", NAMES[:2], NAMES[:2], True), ("4 batched", NAMES, NAMES, True)]
    if args.cases:
        unknown = set(args.cases) - {c[0] for c in cases}
        if unknown or "plain" not in args.cases:
            raise SystemExit(f"--cases: unknown {sorted(unknown)} or no 'plain' (the reference)")
        cases = [c for c in cases if c[0] in args.cases]
    run(backend, [None], 4)  # warm-up
    ratios: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        ref = None
        for label, served, rows, batched in cases:
            engine = backend.engine
            engine.lora_names = served
            engine.settings = dataclasses.replace(engine.settings, batched_lora=batched)
            engine._lora_stack = None  # the stacks of this case's adapters
            seconds, tokens = run(backend, rows, args.new_tokens)
            rate = tokens / seconds
            ref = ref or rate
            ratios.setdefault(label, []).append(rate / ref)
            print(
                f"round {rnd} {label:>14}: {seconds:6.2f} s {tokens:4d} tokens {rate:7.1f} tok/s {rate / ref:5.2f}x"
            )
    for label, rs in ratios.items():  # each case against the plain run of its own round
        print(f"{label:>14}: median {statistics.median(rs):.2f}x of plain, range {min(rs):.2f}-{max(rs):.2f}")
    per_adapter = sum(p.numel() for k, p in model.named_parameters() if f".{NAMES[0]}." in k)
    print(
        f"LoRA parameters per adapter: {per_adapter / 1e6:.2f} M ({per_adapter * 4 / 2**20:.1f} MiB fp32; "
        f"with AdamW moments {per_adapter * 12 / 2**20:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
