"""What bf16 autocast would buy a LoRA SFT step on this CPU: fp32 against bf16, the same batch.

    python bench/sft_precision.py [--threads 2] [--batch 4] [--length 457] [--rounds 2]

SmolLM2-135M-Instruct (``agl models prepare``) with the LoRA ``agl sft`` trains (r=16, alpha 32, every
linear layer), one AdamW step on a fixed random batch of ``--batch`` x ``--length`` tokens (457: the
mean BFCL demonstration, examples/bfcl_agent/README.md). Each round times 3 steps in fp32, then 3 under
``torch.autocast("cpu", bfloat16)``, after one warm-up step each, and prints tokens per second; the
ratio is taken within a round. ``agl sft`` runs fp32 on a CPU by default (``--precision auto``) and this
autocast under ``--precision bf16``; this is the measurement behind that option, on a CPU with AMX or
AVX512-BF16 (`lscpu`), where bf16 matmuls are fast. A probe of speed, not of what bf16 does to learning.
"""

from __future__ import annotations

import argparse
import time

import torch


def positive(text: str) -> int:
    """An argparse type: a whole number above 0 (a zero batch or length has no tokens to time)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=positive, default=2)
    ap.add_argument("--batch", type=positive, default=4)
    ap.add_argument("--length", type=positive, default=457)
    ap.add_argument("--rounds", type=positive, default=2)
    args = ap.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from agl.chat.models import prepare_default_model

    torch.set_num_threads(args.threads)
    base = AutoModelForCausalLM.from_pretrained(
        str(prepare_default_model(progress=False)), dtype=torch.float32
    )
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(
        0, base.config.vocab_size, (args.batch, args.length), generator=torch.Generator().manual_seed(0)
    )

    def step(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    tokens = args.batch * args.length
    for r in range(args.rounds):
        rates = {}
        for bf16 in (False, True):
            step(bf16)
            t = time.perf_counter()
            for _ in range(3):
                step(bf16)
            rates[bf16] = 3 * tokens / (time.perf_counter() - t)
        print(
            f"round {r}: fp32 {rates[False]:.0f} tokens/s, bf16 {rates[True]:.0f} tokens/s, bf16/fp32 x{rates[True] / rates[False]:.2f}"
        )


if __name__ == "__main__":
    main()
