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
BARE = "bare proxy (Starlette + aiohttp, no spans)"


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


# ------------------------------------------------------------------ real path: vllm/openai backends
UPSTREAM_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
N_ROLLOUTS = 16


def serve_real(port: int, backend_name: str, upstream: str, store_url: str) -> None:
    """A gateway process in front of the fake upstream: vllm or openai backend, spans into ``store_url``."""
    import uvicorn

    import agl.store
    from agl.gateway.app import create_app
    from agl.gateway.backends.openai import OpenAIBackend
    from agl.gateway.backends.vllm import VLLMBackend

    backend: Any
    if backend_name == "vllm":
        backend = VLLMBackend(upstream, model=UPSTREAM_MODEL)
    else:
        backend = OpenAIBackend(upstream + "/v1", api_key="sk-bench", models=[UPSTREAM_MODEL])
    store = None if store_url == "none" else agl.store.open(store_url)
    if store_url == "memory://":  # the rollouts live in this process: enqueue and claim them here
        _claim_rollouts(store)
    # the gateway's default (before_reply) unless --span-writes after-reply asks for the other mode
    app = create_app(backend, store, span_writes=os.environ.get("AGL_BENCH_SPAN_WRITES", "before_reply"))
    if os.environ.get("AGL_BENCH_PROFILE"):  # cProfile (CPU time) of the gateway, dumped at shutdown
        import cProfile

        prof = cProfile.Profile(time.process_time)  # CPU, not wall: the machine's load stays out
        prof.enable()
        try:
            uvicorn.run(
                app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop="uvloop"
            )
        finally:
            prof.disable()
            prof.dump_stats(os.environ["AGL_BENCH_PROFILE"])
        return
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


def _wait_http(url: str, proc: subprocess.Popen[Any], timeout_s: float = 90.0) -> None:
    import httpx

    deadline = time.time() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(0.1)


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its children (uvicorn or hydra may fork)."""
    total = _cpu_s(pid)
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return total + sum(_tree_cpu_s(int(c)) for c in children)


def _claim_rollouts(store: Any) -> list[tuple[str, int]]:
    """Enqueue and claim the bench's rollouts; their (id, attempt)s."""
    from agl.types import NewRollout

    store.enqueue([NewRollout(id=f"ro-bench-{i}") for i in range(N_ROLLOUTS)])
    out = []
    for _ in range(N_ROLLOUTS):
        claim = store.claim("bench")
        assert claim is not None
        out.append((claim.rollout.id, claim.attempt.number))
    return out


def _rollouts_in(store_url: str) -> list[tuple[str, int]]:
    """Enqueue and claim the bench's rollouts in a fresh store; their (id, attempt)s."""
    import agl.store

    store = agl.store.open(store_url)
    out = _claim_rollouts(store)
    store.close()
    return out


class Target:
    """One thing to measure: a URL prefix per rollout, and the process whose CPU is counted."""

    def __init__(
        self,
        label: str,
        paths: list[str],
        port: int,
        proc: subprocess.Popen[Any] | None,
        streams: bool = True,
    ) -> None:
        self.label, self.paths, self.port, self.proc, self.streams = label, paths, port, proc, streams


def _chat_body() -> bytes:
    return json.dumps({"model": UPSTREAM_MODEL, "messages": MESSAGES, "max_tokens": 64}).encode()


async def _latency_paths(port: int, paths: list[str], n: int) -> list[float]:
    body = _chat_body()
    conns = [Conn(port, p, body) for p in paths]
    await conns[0].open()
    for c in conns[1:]:  # one connection, rollouts taken in turn
        c.reader, c.writer = conns[0].reader, conns[0].writer
    for i in range(100):
        await conns[i % len(conns)].call()
    out = []
    for i in range(n):
        t = time.perf_counter()
        await conns[i % len(conns)].call()
        out.append(time.perf_counter() - t)
    conns[0].close()
    return out


async def _throughput_paths(port: int, paths: list[str], n: int, concurrency: int) -> float:
    body = _chat_body()
    conns = [Conn(port, paths[i % len(paths)], body) for i in range(concurrency)]
    for c in conns:
        await c.open()
        for _ in range(5):
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


async def _stream_latency(port: int, paths: list[str], n: int) -> tuple[list[float], list[float]]:
    """Sequential streamed calls: (time to the first chunk, time to ``[DONE]``) per call."""
    body = json.dumps(
        {"model": UPSTREAM_MODEL, "messages": MESSAGES, "max_tokens": 64, "stream": True}
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    reqs = [
        (
            f"POST {p} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
        for p in paths
    ]
    first, total = [], []
    for i in range(n + 50):
        t = time.perf_counter()
        writer.write(reqs[i % len(reqs)])
        buf = await reader.read(65536)
        if not buf.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"stream refused: {buf[:200]!r}")
        t_first = time.perf_counter() - t if b"data: " in buf else None
        while not (buf.endswith(b"0\r\n\r\n") and b"[DONE]" in buf):
            buf += await reader.read(65536)
            if t_first is None and b"data: " in buf:
                t_first = time.perf_counter() - t
        if i >= 50:
            first.append(t_first or 0.0)
            total.append(time.perf_counter() - t)
    writer.close()
    return first, total


def _measure(target: Target, n: int, concurrency: int) -> dict[str, float]:
    out: dict[str, float] = {}
    if target.streams:
        first, total = asyncio.run(_stream_latency(target.port, target.paths, max(200, n // 4)))
        out = {"ttft_p50": statistics.median(first), "stream_p50": statistics.median(total)}
    cpu0 = _tree_cpu_s(target.proc.pid) if target.proc else 0.0
    lat = asyncio.run(_latency_paths(target.port, target.paths, n))
    cpu_seq = (_tree_cpu_s(target.proc.pid) - cpu0) / n if target.proc else 0.0
    total = max(n, concurrency * 200)
    cpu0 = _tree_cpu_s(target.proc.pid) if target.proc else 0.0
    rps = asyncio.run(_throughput_paths(target.port, target.paths, total, concurrency))
    cpu = (_tree_cpu_s(target.proc.pid) - cpu0) / (total // concurrency * concurrency) if target.proc else 0.0
    return {
        "p50": statistics.median(lat),
        "p99": _pct(lat, 0.99),
        "rps": rps,
        "cpu": cpu,
        "cpu_seq": cpu_seq,
        **out,
    }


def _start_al(python: str, port: int, upstream: str, tmp: Path) -> subprocess.Popen[Any]:
    """agentlightning 1.0.2's server (``agl-server``: FastAPI proxy + in-memory event store)."""
    import httpx

    exe = str(Path(python).parent / "agl-server")
    proc = subprocess.Popen(
        [
            exe,
            f"port={port}",
            "host=127.0.0.1",
            f"default_proxy.model_name={UPSTREAM_MODEL}",
            f"hydra.run.dir={tmp / 'al-hydra'}",
        ],
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_http(f"http://127.0.0.1:{port}/healthz", proc)
    root = f"http://127.0.0.1:{port}"
    r = httpx.post(root + "/api/models", json=[{"model": UPSTREAM_MODEL, "endpoint": upstream + "/v1"}])
    r.raise_for_status()
    r = httpx.post(
        root + "/api/rollouts",
        json=[{"input": None, "rollout_id": f"ro-bench-{i}"} for i in range(N_ROLLOUTS)],
    )
    r.raise_for_status()
    return proc


def _archive(rev: str, tmp: Path) -> Path:
    """``rev``'s ``core/`` (git archive) importable as ``agl``: the before side of a before/after run."""
    out = tmp / "before"
    out.mkdir()
    archive = subprocess.run(["git", "archive", rev, "core"], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    (out / "pkg").mkdir()
    (out / "pkg" / "agl").symlink_to(out / "core")
    return out / "pkg"


def bench_real(
    n: int,
    concurrency: int,
    rounds: int,
    baseline_python: str | None,
    configs: list[str],
    before: str | None = None,
) -> dict[str, list[dict[str, float]]]:
    """Every target in front of one fake upstream, measured in alternating rounds."""
    import tempfile

    import httpx

    tmp = Path(tempfile.mkdtemp(prefix="agl-bench-gw-"))
    procs: list[subprocess.Popen[Any]] = []
    here = str(Path(__file__).resolve())
    try:
        up_port = _free_port()
        up = subprocess.Popen([sys.executable, str(Path(here).parent / "_upstream.py"), str(up_port)])
        procs.append(up)
        upstream = f"http://127.0.0.1:{up_port}"
        _wait_http(upstream + "/v1/models", up)
        targets = [Target("upstream alone", ["/v1/chat/completions"], up_port, up)]
        bare_port = _free_port()
        bare = subprocess.Popen(
            [sys.executable, str(Path(here).parent / "_bare_proxy.py"), str(bare_port), upstream]
        )
        procs.append(bare)
        _wait_http(f"http://127.0.0.1:{bare_port}/v1/models", bare)
        targets.append(Target(BARE, ["/v1/chat/completions"], bare_port, bare))
        trees = [("", None)] + ([(f" ({before})", _archive(before, tmp))] if before else [])
        for cfg, (tag, tree) in ((c, t) for c in configs for t in trees):
            backend, store_kind = cfg.split("+")
            store_url = "none"
            paths = ["/v1/chat/completions"]
            if store_kind == "memory":  # the gateway process holds the store (and its rollouts)
                store_url = "memory://"
                paths = [f"/rollouts/ro-bench-{i}/attempts/1/v1/chat/completions" for i in range(N_ROLLOUTS)]
            if store_kind in ("sqlite", "http"):
                db = tmp / f"{cfg}{bool(tree)}.db"
                store_url = f"sqlite:///{db}"
                ros = _rollouts_in(store_url)
                paths = [f"/rollouts/{r}/attempts/{a}/v1/chat/completions" for r, a in ros]
                if store_kind == "http":
                    sport = _free_port()
                    sp = subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "agl.cli",
                            "store",
                            "serve",
                            "--db",
                            str(db),
                            "--port",
                            str(sport),
                        ],
                        cwd=ROOT,
                    )
                    procs.append(sp)
                    _wait_http(f"http://127.0.0.1:{sport}/health", sp)
                    store_url = f"http://127.0.0.1:{sport}"
            port = _free_port()
            p = subprocess.Popen(
                [
                    *(sys.executable, here, "--serve-real", str(port), "--backend", backend),
                    *("--upstream", upstream, "--store", store_url),
                ],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(tree)} if tree else None,
            )
            procs.append(p)
            _wait_http(f"http://127.0.0.1:{port}/v1/models", p)
            targets.append(Target(f"agl {backend}, spans: {store_kind}{tag}", paths, port, p))
        if baseline_python:
            port = _free_port()
            p = _start_al(baseline_python, port, upstream, tmp)
            procs.append(p)
            paths = [
                f"/proxy/rollout/ro-bench-{i}/attempt/1/mode/train/openai/v1/chat/completions"
                for i in range(N_ROLLOUTS)
            ]
            # its proxy refuses stream=true (400 "Streaming responses are not supported")
            targets.append(
                Target("agentlightning 1.0.2 proxy (memory events)", paths, port, p, streams=False)
            )
        results: dict[str, list[dict[str, float]]] = {t.label: [] for t in targets}
        for r in range(rounds):
            order = targets if r % 2 == 0 else targets[::-1]
            for t in order:
                results[t.label].append(_measure(t, n, concurrency))
                print(f"  round {r + 1} {t.label}: {results[t.label][-1]}", flush=True)
        for t in targets[1:]:
            if t.label.startswith("agl") and "none" not in t.label:
                stats = httpx.get(f"http://127.0.0.1:{t.port}/agl/v1/status").json()["stats"]
                print(f"  {t.label}: {stats}")
        return results
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def report_ratios(results: dict[str, list[dict[str, float]]]) -> None:
    """Each agl gateway against the bare pass-through proxy measured in the same rounds: server CPU per
    request (sequential and at the run's concurrency) as a ratio, and the latency it adds beyond it."""
    bare, up = results.get(BARE), results["upstream alone"]
    if not bare:
        return
    print(f"\nagainst {BARE} (same rounds; medians over rounds)")
    print(
        f"{'target':46} {'CPU/req seq x':>14} {'CPU/req conc x':>15} {'added p50 ms':>13} {'added p99 ms':>13}"
    )
    for label, rows in results.items():
        if label in (BARE, "upstream alone"):
            continue
        seq = statistics.median(r["cpu_seq"] / b["cpu_seq"] for r, b in zip(rows, bare, strict=True))
        conc = statistics.median(r["cpu"] / b["cpu"] for r, b in zip(rows, bare, strict=True))
        a50 = statistics.median((r["p50"] - u["p50"]) * 1e3 for r, u in zip(rows, up, strict=True))
        a99 = statistics.median((r["p99"] - u["p99"]) * 1e3 for r, u in zip(rows, up, strict=True))
        print(f"{label:46} {seq:14.2f} {conc:15.2f} {a50:13.3f} {a99:13.3f}")
    for label, rows in results.items():
        if label != "upstream alone":
            cpu_seq = statistics.median(r["cpu_seq"] for r in rows) * 1e3
            print(f"  {label}: CPU/req sequential {cpu_seq:.3f} ms")


def report_real(results: dict[str, list[dict[str, float]]]) -> None:
    up = results["upstream alone"]

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def rng(vals: list[float], fmt: str) -> str:
        return f"[{format(min(vals), fmt)}–{format(max(vals), fmt)}]"

    print(
        "\nreal path: chat completion through a proxy in front of the fake vLLM upstream; "
        "added = proxy minus upstream alone, same round; medians over rounds [range]"
    )
    print(f"{'target':46} {'added p50 ms':>20} {'added p99 ms':>20} {'req/s @16':>16} {'CPU/req ms':>16}")
    for label, rows in results.items():
        if label == "upstream alone":
            print(
                f"{label:46} {'e2e ' + format(med(rows, 'p50') * 1e3, '.3f'):>20} "
                f"{'e2e ' + format(med(rows, 'p99') * 1e3, '.3f'):>20} {med(rows, 'rps'):16.0f} "
                f"{med(rows, 'cpu') * 1e3:16.3f}"
            )
            continue
        a50 = [(r["p50"] - u["p50"]) * 1e3 for r, u in zip(rows, up, strict=True)]
        a99 = [(r["p99"] - u["p99"]) * 1e3 for r, u in zip(rows, up, strict=True)]
        rps = [r["rps"] for r in rows]
        cpu = [r["cpu"] * 1e3 for r in rows]
        print(
            f"{label:46} {statistics.median(a50):7.3f} {rng(a50, '.2f'):>12} "
            f"{statistics.median(a99):7.3f} {rng(a99, '.2f'):>12} "
            f"{statistics.median(rps):6.0f} {rng(rps, '.0f'):>9} {statistics.median(cpu):6.3f} {rng(cpu, '.2f'):>9}"
        )
    print("\nstreamed (stream: true, 8 token chunks), sequential: p50 of first chunk / [DONE], ms")
    for label, rows in results.items():
        if "ttft_p50" in rows[0]:
            ttft = med(rows, "ttft_p50") * 1e3
            done = med(rows, "stream_p50") * 1e3
            print(f"{label:46} first chunk {ttft:7.3f}   [DONE] {done:7.3f}")


def bench_smollm2(new_tokens: int, threads: int | None) -> list[dict[str, Any]]:
    """SmolLM2 through the gateway over HTTP (1 and 8 concurrent clients, streamed TTFT) and Hugging
    Face ``generate`` at batch 8 on the same prompts, model object and threads."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from agl.engine import EngineSettings
    from agl.gateway.backends.transformers import TransformersBackend
    from agl.gateway.testing import serve_gateway

    backend = TransformersBackend(settings=EngineSettings(max_batch_size=8, threads=threads or 0))
    backend.engine.load()
    name = backend.model_name or ""
    rows: list[dict[str, Any]] = []

    # Hugging Face generate, batch 8, greedy, left-padded: the reference (bench/generation.py's)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.generation import PROMPTS, hf_generate

    hf_generate(backend, PROMPTS[:1], 2)  # warm-up
    ref = hf_generate(backend, PROMPTS, new_tokens)
    rows.append({"what": "HF generate, batch 8", **ref, "ttft_s": None})

    with serve_gateway(backend) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)

        def one(i: int) -> int:
            r = client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": PROMPTS[i % 8]}],
                max_tokens=new_tokens,
                temperature=0,
            )
            return r.usage.completion_tokens if r.usage else 0

        one(0)  # warm-up
        for c in (1, 8):
            backend.batch_sizes.clear()
            t, cpu = time.perf_counter(), time.process_time()
            with ThreadPoolExecutor(c) as pool:
                tokens = sum(pool.map(one, range(c)))
            elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
            print(f"  {c} concurrent: batch sizes {list(backend.batch_sizes)}", flush=True)
            rows.append(
                {
                    "what": f"gateway, {c} concurrent",
                    "tokens": tokens,
                    "seconds": elapsed,
                    "cpu_s": cpu,
                    "ttft_s": None,
                }
            )
        t = time.perf_counter()
        ttft = None
        count = 0
        for chunk in client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=new_tokens,
            temperature=0,
            stream=True,
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                count += 1
                if ttft is None:
                    ttft = time.perf_counter() - t
        rows.append(
            {
                "what": "gateway, 1 streamed",
                "tokens": count,
                "seconds": time.perf_counter() - t,
                "cpu_s": None,
                "ttft_s": ttft,
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
    parser.add_argument("--skip-real", action="store_true", help="skip the vllm/openai real-path section")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the real-path section")
    parser.add_argument(
        "--configs",
        default="vllm+sqlite,vllm+http,openai+sqlite,vllm+none",
        help="real-path gateways: BACKEND+STORE (STORE: sqlite, memory, http or none), comma-separated",
    )
    parser.add_argument(
        "--span-writes",
        choices=["before-reply", "after-reply"],
        default="before-reply",
        help="when agl's gateways store a span: before its reply (the default) or just after it",
    )
    parser.add_argument(
        "--baseline-python",
        help="python of a venv with agentlightning==1.0.2 (its agl-server proxy joins the real-path runs)",
    )
    parser.add_argument(
        "--before",
        metavar="REV",
        help="also run each agl gateway from git revision REV's core/ (before/after in the same rounds)",
    )
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-real", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="vllm", help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    parser.add_argument("--store", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    if args.serve_real:
        serve_real(args.serve_real, args.backend, args.upstream, args.store)
        return
    os.environ["AGL_BENCH_SPAN_WRITES"] = args.span_writes.replace("-", "_")  # the gateway processes read it
    print(f"load average before: {os.getloadavg()[0]:.2f}; spans stored {args.span_writes}")
    if not args.skip_real:
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
        results = bench_real(
            args.requests, args.concurrency, args.rounds, args.baseline_python, configs, args.before
        )
        report_real(results)
        report_ratios(results)
    if not args.skip_scripted:
        report_scripted(bench_scripted(args.requests, args.concurrency))
    if not args.skip_smollm2:
        print(f"\nSmolLM2-135M-Instruct, greedy, up to {args.new_tokens} new tokens per request")
        print(f"{'what':26} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'CPU s':>7} {'first token s':>13}")
        for r in bench_smollm2(args.new_tokens, args.threads):
            cpu = f"{r['cpu_s']:7.1f}" if r["cpu_s"] is not None else f"{'-':>7}"
            ttft = f"{r['ttft_s']:13.2f}" if r["ttft_s"] is not None else f"{'-':>13}"
            print(
                f"{r['what']:26} {r['tokens']:7d} {r['seconds']:8.2f} {r['tokens'] / r['seconds']:9.1f} {cpu} {ttft}"
            )
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
