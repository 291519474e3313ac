"""What reproducible generation costs and what it buys: the transformers engine, default vs ``deterministic=True``.

    python bench/reproducible.py [--threads 1] [--new-tokens 32] [--rounds 3]

SmolLM2-135M-Instruct (``agl models prepare``), one model object shared by two engines: the default one
(continuous batching, up to 8 rows) and a ``deterministic=True`` one (one row at a time). Each round
sends the same 8 seeded requests (temperature 1, distinct seeds, the prompts of bench/generation.py)
concurrently to each engine, in alternating order, and counts generated tokens per second of wall time
(ratios are taken within a round: the load of a shared machine moves them much less than absolute
figures). It also sends each request *alone* to both engines and reports how many of the 8 batched
replies equal the lone reply token for token, and with their log-probs to the last bit: the
deterministic engine must give 8/8 by construction; the default engine's counts show how often
batching's float rounding flips a draw at temperature 1, and how often it changes the behaviour
log-probs the update weighs each token by.
"""

from __future__ import annotations

import argparse
import asyncio
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
SEEDS = [1000 + i for i in range(8)]


def _requests(new_tokens: int) -> list[Any]:
    from agl.gateway.backends.base import GenerationRequest

    return [
        GenerationRequest(
            model="m",
            messages=[{"role": "user", "content": p}],
            seed=s,
            temperature=1.0,
            max_tokens=new_tokens,
        )
        for p, s in zip(PROMPTS, SEEDS, strict=True)
    ]


Reply = tuple[list[int], list[float]]  # response ids, their log-probs


async def _batch(engine: Any, new_tokens: int) -> tuple[float, list[Reply]]:
    """Tokens per second for the 8 requests at once, and their replies."""
    t0 = time.perf_counter()
    out = await asyncio.gather(*(engine.generate(r) for r in _requests(new_tokens)))
    dt = time.perf_counter() - t0
    replies = [(o.choices[0].response_ids, o.choices[0].logprobs) for o in out]
    return sum(len(ids) for ids, _ in replies) / dt, replies


async def _alone(engine: Any, new_tokens: int) -> list[Reply]:
    out = [(await engine.generate(r)).choices[0] for r in _requests(new_tokens)]
    return [(c.response_ids, c.logprobs) for c in out]


async def run(threads: int, new_tokens: int, rounds: int) -> dict[str, Any]:
    import torch

    from agl.gateway.backends.transformers import TransformersBackend

    torch.set_num_threads(threads)
    default = TransformersBackend(max_batch_size=8, threads=threads)
    default._load_sync()
    det = TransformersBackend(default.model, tokenizer=default.tokenizer, deterministic=True, threads=threads)
    await _batch(default, 4)  # warm-up: first-call allocations out of the figures
    await _batch(det, 4)
    tps: dict[str, list[float]] = {"default": [], "deterministic": []}
    batched: dict[str, list[Reply]] = {}
    for k in range(rounds):
        order = [("default", default), ("deterministic", det)]
        for name, engine in order if k % 2 == 0 else order[::-1]:
            rate, ids = await _batch(engine, new_tokens)
            tps[name].append(rate)
            if name in batched and batched[name] != ids:
                print(f"  note: {name} gave other tokens in round {k} than in round 0")
            batched.setdefault(name, ids)
        print(
            f"round {k}: default {tps['default'][-1]:.1f} tok/s, deterministic {tps['deterministic'][-1]:.1f} tok/s",
            flush=True,
        )
    same, exact = {}, {}
    for name, engine in (("default", default), ("deterministic", det)):
        alone = await _alone(engine, new_tokens)
        same[name] = sum(1 for a, b in zip(alone, batched[name], strict=True) if a[0] == b[0])
        exact[name] = sum(1 for a, b in zip(alone, batched[name], strict=True) if a == b)
    return {"tps": tps, "same_alone_vs_batch": same, "exact_alone_vs_batch": exact}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: a shared CPU)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    res = asyncio.run(run(args.threads, args.new_tokens, args.rounds))
    d, t = res["tps"]["default"], res["tps"]["deterministic"]
    ratios = [b / a for a, b in zip(d, t, strict=True)]
    print(
        f"8 concurrent seeded requests, {args.new_tokens} new tokens, {args.threads} thread(s): default "
        f"{statistics.median(d):.1f} tok/s, deterministic {statistics.median(t):.1f} tok/s, ratio "
        f"{statistics.median(ratios):.2f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    s, e = res["same_alone_vs_batch"], res["exact_alone_vs_batch"]
    print(
        f"batched reply == the same request alone: tokens: default {s['default']}/8, deterministic "
        f"{s['deterministic']}/8; tokens and log-probs to the bit: default {e['default']}/8, "
        f"deterministic {e['deterministic']}/8"
    )


if __name__ == "__main__":
    main()
