"""Gateway overhead and throughput (scripted backend), and SmolLM2 tokens/s (transformers backend).

    python bench/gateway.py [--requests 3000] [--concurrency 16] [--skip-smollm2]

1. Latency added: p50/p99 of one chat completion end to end over HTTP (gateway in its own process:
   uvicorn + uvloop + httptools, a keep-alive HTTP/1.1 client on asyncio streams, one request at a
   time) minus p50/p99 of calling the same ``ScriptedBackend.generate`` directly in-process. Two
   server configurations: a per-rollout URL with the span built and stored in a memory store (what
   training does), and a plain ``/v1`` call with no rollout (nothing stored).
2. Throughput: requests/s with ``--concurrency`` clients (default 16), each keep-alive, same request;
   and the gateway process's CPU time per request (user + system, from /proc) with the req/s one
   core would serve at that cost — a figure the load of a shared machine moves much less.
3. SmolLM2-135M-Instruct (transformers backend, greedy, ``--new-tokens`` per request) generated
   tokens/s at concurrency 1 and 8 (requests queued and batched by the backend).

Baseline (docs/architecture.md §10, agentlightning 1.0.2's LLM proxy measured on this machine):
1.5 ms p50 added, 472 req/s at 16 concurrent. Targets: <= 0.5 ms p50 added, >= 1.4k req/s.
The machine's load average is printed with the figures: the development machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant that answers briefly."},
    {"role": "user", "content": "What is the capital of France? Answer in one word."},
]
REPLY = "The capital of France is Paris."
ROLLOUT = ("ro-bench", 1)
BASELINE_P50_MS = 1.5
BASELINE_RPS = 472.0


# --------------------------------------------------------------------------------- server process
def serve(port: int) -> None:
    """The gateway process: scripted backend, memory store with one running rollout."""
    import uvicorn

    import agl.store
    from agl.gateway.app import create_app
    from agl.gateway.backends.scripted import ScriptedBackend
    from agl.types import NewRollout

    store = agl.store.open("memory://")
    store.enqueue([NewRollout(id=ROLLOUT[0])])
    store.claim("bench")
    app = create_app(ScriptedBackend([REPLY], on_exhausted="repeat"), store)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ------------------------------------------------------------------------------------- HTTP client
class Conn:
    """A minimal keep-alive HTTP/1.1 client: the client's own cost stays far below the server's."""

    def __init__(self, port: int, path: str, body: bytes) -> None:
        self.port = port
        self.request = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def call(self) -> bytes:
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = head[9:12]
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        body = await self.reader.readexactly(length)
        if status != b"200":
            raise RuntimeError(f"HTTP {status.decode()}: {body[:200]!r}")
        return body

    def close(self) -> None:
        self.writer.close()


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


async def latency(port: int, path: str, n: int) -> list[float]:
    body = json.dumps({"model": "scripted", "messages": MESSAGES}).encode()
    conn = Conn(port, path, body)
    await conn.open()
    for _ in range(200):  # warm-up
        await conn.call()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await conn.call()
        out.append(time.perf_counter() - t)
    conn.close()
    return out


async def throughput(port: int, path: str, n: int, concurrency: int) -> float:
    body = json.dumps({"model": "scripted", "messages": MESSAGES}).encode()
    conns = [Conn(port, path, body) for _ in range(concurrency)]
    for c in conns:
        await c.open()
        await c.call()
    per = n // concurrency

    async def worker(c: Conn) -> None:
        for _ in range(per):
            await c.call()

    t = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - t
    for c in conns:
        c.close()
    return per * concurrency / elapsed


async def direct(n: int) -> list[float]:
    from agl.gateway.backends.base import GenerationRequest
    from agl.gateway.backends.scripted import ScriptedBackend

    backend = ScriptedBackend([REPLY], on_exhausted="repeat")
    out = []
    for i in range(n + 200):
        req = GenerationRequest(model="scripted", messages=[dict(m) for m in MESSAGES], rollout=ROLLOUT)
        t = time.perf_counter()
        await backend.generate(req)
        if i >= 200:
            out.append(time.perf_counter() - t)
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_scripted(n: int, concurrency: int) -> list[dict[str, Any]]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], cwd=ROOT)
    try:
        import httpx

        deadline = time.time() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError("the gateway process did not start") from None
                time.sleep(0.1)
        base = asyncio.run(direct(n))
        rows = []
        for label, path in (
            (
                "per-rollout URL, span stored",
                f"/rollouts/{ROLLOUT[0]}/attempts/{ROLLOUT[1]}/v1/chat/completions",
            ),
            ("plain /v1, no rollout", "/v1/chat/completions"),
        ):
            lat = asyncio.run(latency(port, path, n))
            total = max(n, concurrency * 100)
            cpu0 = _cpu_s(proc.pid)
            rps = asyncio.run(throughput(port, path, total, concurrency))
            cpu_per_req = (_cpu_s(proc.pid) - cpu0) / (total // concurrency * concurrency)
            rows.append(
                {
                    "config": label,
                    "backend_p50_ms": statistics.median(base) * 1e3,
                    "backend_p99_ms": _pct(base, 0.99) * 1e3,
                    "e2e_p50_ms": statistics.median(lat) * 1e3,
                    "e2e_p99_ms": _pct(lat, 0.99) * 1e3,
                    "added_p50_ms": (statistics.median(lat) - statistics.median(base)) * 1e3,
                    "added_p99_ms": (_pct(lat, 0.99) - _pct(base, 0.99)) * 1e3,
                    "rps": rps,
                    "server_cpu_us": cpu_per_req * 1e6,
                }
            )
        stats = httpx.get(f"http://127.0.0.1:{port}/agl/v1/status").json()["stats"]
        rows[0]["spans_stored"] = stats.get("spans_stored", 0)
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def bench_smollm2(new_tokens: int, threads: int | None) -> list[dict[str, Any]]:
    from agl.gateway.backends.base import GenerationRequest
    from agl.gateway.backends.transformers import TransformersBackend

    backend = TransformersBackend(max_batch_size=8, threads=threads)
    prompts = [
        "Write a short story about a robot learning to paint.",
        "Explain how photosynthesis works.",
        "List some tips for learning a new language.",
        "Describe the city of Paris to a tourist.",
        "What are the benefits of regular exercise?",
        "Explain what a neural network is.",
        "Write a poem about the sea.",
        "How do airplanes stay in the air?",
    ]

    async def run(concurrency: int) -> tuple[int, float, float]:
        await backend.start()
        reqs = [
            GenerationRequest(
                model=backend.model_name or "",
                messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
                max_tokens=new_tokens,
                temperature=0,
            )
            for i in range(concurrency)
        ]
        await backend.generate(
            GenerationRequest(
                model=backend.model_name or "", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        )
        t, cpu = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(backend.generate(r) for r in reqs))
        elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
        return sum(len(r.choices[0].response_ids or ()) for r in results), elapsed, cpu

    rows = []
    for c in (1, 8):
        tokens, elapsed, cpu = asyncio.run(run(c))
        rows.append(
            {
                "concurrency": c,
                "tokens": tokens,
                "seconds": elapsed,
                "tokens_per_s": tokens / elapsed,
                "cpu_s": cpu,
                "tokens_per_cpu_s": tokens / cpu,
            }
        )
    return rows


def report_scripted(rows: list[dict[str, Any]]) -> None:
    print("\nscripted backend, chat completion (ms; 'added' = end to end over HTTP minus the backend call)")
    print(
        f"{'config':32} {'backend p50':>11} {'e2e p50':>8} {'e2e p99':>8} {'added p50':>9} "
        f"{'added p99':>9} {'req/s':>7} {'server CPU/req':>14} {'req/s/core':>10}"
    )
    for r in rows:
        print(
            f"{r['config']:32} {r['backend_p50_ms']:11.3f} {r['e2e_p50_ms']:8.3f} {r['e2e_p99_ms']:8.3f} "
            f"{r['added_p50_ms']:9.3f} {r['added_p99_ms']:9.3f} {r['rps']:7.0f} "
            f"{r['server_cpu_us']:11.0f} us {1e6 / r['server_cpu_us']:10.0f}"
        )
    main_row = rows[0]
    print(
        "\nvs agentlightning 1.0.2 proxy (1.5 ms p50 added, 472 req/s): "
        f"p50 added {BASELINE_P50_MS / max(main_row['added_p50_ms'], 1e-9):.1f}x lower, "
        f"req/s {main_row['rps'] / BASELINE_RPS:.1f}x higher (targets: <= 0.5 ms, >= 1400 req/s; "
        f"{main_row.get('spans_stored', 0)} spans stored)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-smollm2", action="store_true")
    parser.add_argument("--skip-scripted", action="store_true")
    parser.add_argument("--threads", type=int, help="torch CPU threads for SmolLM2 (default: torch's choice)")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    if not args.skip_scripted:
        report_scripted(bench_scripted(args.requests, args.concurrency))
    if not args.skip_smollm2:
        print(
            f"\nSmolLM2-135M-Instruct, transformers backend, greedy, {args.new_tokens} new tokens per request"
        )
        print(
            f"{'concurrency':>11} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'CPU s':>7} {'tokens/CPU s':>12}"
        )
        for r in bench_smollm2(args.new_tokens, args.threads):
            print(
                f"{r['concurrency']:11d} {r['tokens']:7d} {r['seconds']:8.2f} {r['tokens_per_s']:9.1f} "
                f"{r['cpu_s']:7.1f} {r['tokens_per_cpu_s']:12.1f}"
            )
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
