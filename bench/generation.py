"""CPU generation throughput of the transformers backend (continuous batching) vs Hugging Face ``generate``.

    python bench/generation.py [--threads 1] [--new-tokens 32] [--rounds 2]

SmolLM2-135M-Instruct (``agl models prepare``), greedy, the same model object, prompts and torch
threads for every row; each round runs all rows back to back (ratios are taken within a round, which
the load of a shared machine moves much less than absolute figures):

- HF ``generate`` at batch 8: the 8 prompts as one left-padded batch (the reference), and at batch 1
  (the reference for one request: what the backend ran per request before continuous batching);
- the gateway over HTTP (openai client in threads, no store): 1 request, then 8 concurrent requests
  (the 8 prompts), tokens counted up to EOS as the gateway reports them;
- time to first token (streamed; the client stops reading after the first token, which cancels the
  rest): one request alone, 8 started together (median), and one request arriving once 7 streamed
  others have their first token, i.e. are decoding (it joins their batch between two decode steps;
  before continuous batching it waited for them to finish).

Target (issue 18): 8 concurrent through the gateway >= 1.0x HF ``generate`` at batch 8.

``--probe`` instead measures, on the model alone (batch 8, the 8 prompts): the backend's decode loop
(``_batching.Batch``) eager and under ``torch.compile(dynamic=True)`` (warm-up time included), and HF
``generate`` with its dynamic and its static KV cache: whether a static cache or compilation pays on
this CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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


def hf_generate(backend: Any, prompts: list[str], new_tokens: int, **extra: Any) -> dict[str, Any]:
    """``generate`` on the prompts as one left-padded batch; tokens counted up to each row's EOS."""
    import torch

    tok = backend.tokenizer
    encoded = [tok.encode_chat([{"role": "user", "content": p}], None)[1] for p in prompts]
    width = max(map(len, encoded))
    ids = torch.full((len(encoded), width), backend.engine.pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for r, e in enumerate(encoded):
        ids[r, width - len(e) :] = torch.tensor(e)
        mask[r, width - len(e) :] = 1
    with torch.inference_mode():
        t, cpu = time.perf_counter(), time.process_time()
        out = backend.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=backend.engine.pad_id,
            eos_token_id=backend.engine.eos_ids,
            **extra,
        )
        elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
    n = 0
    for row in out[:, width:].tolist():
        ends = [k for k, t_id in enumerate(row) if t_id in backend.engine.eos_ids]
        n += ends[0] + 1 if ends else len(row)
    return {"tokens": n, "seconds": elapsed, "cpu_s": cpu}


def run(threads: int, new_tokens: int, rounds: int) -> list[dict[str, dict[str, Any]]]:
    import openai
    import torch

    from agl.engine import EngineSettings
    from agl.gateway.backends.transformers import TransformersBackend
    from agl.gateway.testing import serve_gateway

    torch.set_num_threads(threads)
    backend = TransformersBackend(settings=EngineSettings(max_batch_size=8, threads=threads))
    backend.engine.load()
    name = backend.model_name or ""
    results: list[dict[str, dict[str, Any]]] = []
    with serve_gateway(backend) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=900)

        def call(i: int, max_tokens: int = new_tokens) -> int:
            r = client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": PROMPTS[i % 8]}],
                max_tokens=max_tokens,
                temperature=0,
            )
            return r.usage.completion_tokens if r.usage else 0

        def first_token(i: int) -> float:
            t = time.perf_counter()
            stream = client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": PROMPTS[i % 8]}],
                max_tokens=new_tokens,
                temperature=0,
                stream=True,
                extra_body={"return_token_ids": True},
            )
            try:
                for chunk in stream:
                    if chunk.choices and (chunk.choices[0].model_extra or {}).get("token_ids"):
                        return time.perf_counter() - t
            finally:
                stream.close()  # a disconnect: the gateway cancels the rest
            return float("nan")

        def stream_all(i: int, decoding: threading.Barrier) -> None:
            """A streamed request read to its end; meets the others at ``decoding`` after its first token."""
            stream = client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": PROMPTS[i % 8]}],
                max_tokens=new_tokens,
                temperature=0,
                stream=True,
                extra_body={"return_token_ids": True},
            )
            waiting = True
            for chunk in stream:
                if waiting and chunk.choices and (chunk.choices[0].model_extra or {}).get("token_ids"):
                    waiting = False
                    decoding.wait()

        def gateway(c: int) -> dict[str, Any]:
            t, cpu = time.perf_counter(), time.process_time()
            with ThreadPoolExecutor(c) as pool:
                tokens = sum(pool.map(call, range(c)))
            return {"tokens": tokens, "seconds": time.perf_counter() - t, "cpu_s": time.process_time() - cpu}

        call(0, 4)  # warm-up
        hf_generate(backend, PROMPTS[:1], 4)
        for r in range(rounds):
            row: dict[str, dict[str, Any]] = {}
            row["hf8"] = hf_generate(backend, PROMPTS, new_tokens)
            backend.batch_sizes.clear()
            row["gw8"] = gateway(8)
            row["gw8"]["batches"] = list(backend.batch_sizes)
            row["hf1"] = hf_generate(backend, PROMPTS[:1], new_tokens)
            row["gw1"] = gateway(1)
            row["ttft1"] = {"s": first_token(0)}
            with ThreadPoolExecutor(8) as pool:
                row["ttft8"] = {"s": statistics.median(pool.map(first_token, range(8)))}
            decoding = threading.Barrier(8)
            with ThreadPoolExecutor(7) as pool:  # one request arrives once 7 others are decoding
                busy = [pool.submit(stream_all, i, decoding) for i in range(1, 8)]
                decoding.wait()
                row["ttft_join"] = {"s": first_token(0)}
                for f in busy:
                    f.result()
            results.append(row)
            print(f"round {r + 1}: {summary(row)} (load {os.getloadavg()[0]:.1f})", flush=True)
    return results


def probe(threads: int, new_tokens: int) -> None:
    """Static KV cache and ``torch.compile`` on the model alone, against the eager decode loop."""
    import torch

    from agl.engine import EngineSettings
    from agl.engine.batching import Batch, Row
    from agl.gateway.backends.transformers import TransformersBackend

    torch.set_num_threads(threads)
    backend = TransformersBackend(settings=EngineSettings(threads=threads))
    backend.engine.load()
    tok = backend.tokenizer
    assert tok is not None
    encoded = [tok.encode_chat([{"role": "user", "content": p}], None)[1] for p in PROMPTS]

    def loop(model: Any, n: int = new_tokens) -> float:
        batch = Batch(model, backend.engine.pad_id)
        rows = [Row(e, n, 0.0, 1.0, None, None, frozenset(backend.engine.eos_ids)) for e in encoded]
        t = time.perf_counter()
        batch.admit(rows)
        while len(batch):
            batch.step()
        return time.perf_counter() - t

    def hf(**extra: Any) -> float:
        return float(hf_generate(backend, PROMPTS, new_tokens, **extra)["seconds"])

    with torch.inference_mode():
        loop(backend.model, 2)
        print(f"eager decode loop: {loop(backend.model):.2f} s; HF generate: {hf():.2f} s", flush=True)
        print(f"HF generate, static cache: {hf(cache_implementation='static'):.2f} s", flush=True)
        compiled = torch.compile(backend.model, dynamic=True)
        t = time.perf_counter()
        loop(compiled, 2)
        print(f"torch.compile warm-up: {time.perf_counter() - t:.1f} s", flush=True)
        print(f"compiled decode loop: {loop(compiled):.2f} s; eager: {loop(backend.model):.2f} s", flush=True)


def tps(x: dict[str, Any]) -> float:
    return x["tokens"] / x["seconds"]


def summary(row: dict[str, dict[str, Any]]) -> str:
    return (
        f"HF b8 {tps(row['hf8']):.1f} tok/s, gateway 8 {tps(row['gw8']):.1f} "
        f"({tps(row['gw8']) / tps(row['hf8']):.2f}x, batches {row['gw8']['batches']}), "
        f"HF b1 {tps(row['hf1']):.1f}, gateway 1 {tps(row['gw1']):.1f} "
        f"({tps(row['gw1']) / tps(row['hf1']):.2f}x), TTFT 1/8/join "
        f"{row['ttft1']['s']:.2f}/{row['ttft8']['s']:.2f}/{row['ttft_join']['s']:.2f} s"
    )


def report(results: list[dict[str, dict[str, Any]]], new_tokens: int, threads: int) -> None:
    def med(key: str, fn: Any) -> str:
        values = [fn(r[key]) for r in results]
        spread = f" [{min(values):.2f}–{max(values):.2f}]" if len(values) > 1 else ""
        return f"{statistics.median(values):.2f}{spread}"

    print(f"\nSmolLM2-135M-Instruct, greedy, up to {new_tokens} new tokens, torch {threads} thread(s)")
    print(f"{'what':34} {'tokens/s':>22} {'CPU s':>14}")
    labels = {
        "hf8": "HF generate, batch 8",
        "gw8": "gateway, 8 concurrent",
        "hf1": "HF generate, batch 1",
        "gw1": "gateway, 1 request",
    }
    for key, label in labels.items():
        print(f"{label:34} {med(key, tps):>22} {med(key, lambda x: x['cpu_s']):>14}")
    ratio8 = [tps(r["gw8"]) / tps(r["hf8"]) for r in results]
    ratio1 = [tps(r["gw1"]) / tps(r["hf1"]) for r in results]
    print(
        f"gateway 8 / HF batch 8: {statistics.median(ratio8):.2f}x  (per round {[round(x, 2) for x in ratio8]})"
    )
    print(
        f"gateway 1 / HF batch 1: {statistics.median(ratio1):.2f}x  (per round {[round(x, 2) for x in ratio1]})"
    )
    for key, label in (
        ("ttft1", "first token, 1 request"),
        ("ttft8", "first token, 8 together (median)"),
        ("ttft_join", "first token, joining 7 decoding"),
    ):
        print(f"{label:34} {med(key, lambda x: x['s']):>22} s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: a shared CPU)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--probe", action="store_true", help="static cache / torch.compile on the model alone"
    )
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    if args.probe:
        probe(args.threads, args.new_tokens)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        return
    results = run(args.threads, args.new_tokens, args.rounds)
    report(results, args.new_tokens, args.threads)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
