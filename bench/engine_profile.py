"""Where the embedded engine's decode step goes, and what each change bought (model alone, no HTTP).

    python bench/engine_profile.py [--old path/to/old/_batching.py] [--batch 1 8 16] [--rounds 3] [--threads 1]

SmolLM2-135M-Instruct, 8-16 rows of a 40-token prompt, temperature 1: per configuration (fp32 or bf16
weights; the engine's decode loop ``_batching.Batch``, and with ``--old`` the same loop from an older
``_batching.py``, e.g. ``git show <rev>:core/engine/batching.py``) the mean time of 16
decode steps after 4 warm-up steps, configurations interleaved within each round (the median round
is printed, with the load average). ``--profile`` prints torch's operator table of the current loop.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _loop(module: Any, model: Any, batch: int, steps: int = 16) -> float:
    import torch

    rows = [
        module.Row(
            prompt_ids=list(range(100 + i, 140 + i)),
            max_new=10**6,
            temperature=1.0,
            top_p=1.0,
            top_k=None,
            generator=torch.Generator().manual_seed(i),
        )
        for i in range(batch)
    ]
    with torch.inference_mode():
        b = module.Batch(model, 0)
        b.admit(rows)
        for _ in range(4):
            b.step()
        t = time.perf_counter()
        for _ in range(steps):
            b.step()
    return (time.perf_counter() - t) / steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, help="an older _batching.py to compare with")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AutoModelForCausalLM

    from agl.chat.models import prepare_default_model
    from agl.engine import batching as new

    torch.set_num_threads(args.threads)
    loops = {"current": new}
    if args.old:
        spec = importlib.util.spec_from_file_location("agl_old_batching", args.old)
        assert spec and spec.loader
        old = importlib.util.module_from_spec(spec)
        sys.modules["agl_old_batching"] = old  # dataclasses look their module up
        spec.loader.exec_module(old)
        loops = {"old": old, **loops}
    path = str(prepare_default_model())
    models = {
        d: AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, d)).eval()
        for d in ("float32", "bfloat16")
    }
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            _loop(new, models["bfloat16"], max(args.batch), steps=8)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    seen: dict[tuple[str, str, int], list[float]] = {}
    for k in range(args.rounds):
        for batch in args.batch:
            for dtype, model in models.items():
                for name, module in loops.items():
                    s = _loop(module, model, batch)
                    seen.setdefault((name, dtype, batch), []).append(s)
                    print(
                        f"round {k + 1} {name} {dtype} batch {batch}: {s * 1e3:.1f} ms/step load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
    print("\n| loop | weights | batch | ms per decode step (median) | tokens/s | load |")
    print("|---|---|---:|---:|---:|---:|")
    for (name, dtype, batch), xs in seen.items():
        med = statistics.median(xs)
        print(
            f"| {name} | {dtype} | {batch} | {med * 1e3:.1f} | {batch / med:.0f} | {os.getloadavg()[0]:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
