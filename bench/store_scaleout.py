"""PostgreSQL behind the store server: SQLite vs PostgreSQL over HTTP, and 1 vs 2 servers on one database.

    python bench/store_scaleout.py [--spans 20000] [--rollouts 1000] [--concurrent-rollouts 2000] [--runners 64]

Part 1 serves a fresh SQLite file, then a fresh PostgreSQL database, with one ``agl store serve``
process each, and measures from one client: spans/s (batches of 100), claim + span + finish
sequential, and 32 concurrent asyncio clients. Part 2 starts one, then two ``agl store serve`` processes
on one PostgreSQL database and drives ``--runners`` concurrent runners (claim + span + finish), spread
evenly over the servers: the ratio is the scale-out factor. Every figure is measured on this machine in
this run (PostgreSQL: a throwaway server with fsync on, as a deployment runs). On a small machine the
database, the servers and the runners share its cores: the factor there says what a second server
costs or gains when nothing else is added, not what a second host would bring.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from agl.store.http import AsyncHttpStore, HttpStore
from agl.store.postgres import LocalPostgres
from agl.store.server import ServerProcess
from agl.types import NewRollout, Span

BATCH = 100


def make_span(rid: str, trace_id: str | None = None) -> Span:
    now = time.time_ns()
    return Span(
        trace_id=trace_id or os.urandom(16).hex(),
        span_id=os.urandom(8).hex(),
        name="chat",
        kind="CLIENT",
        start_ns=now,
        end_ns=now + 1_000_000,
        attributes={"gen_ai.request.model": "m", "gen_ai.usage.input_tokens": 512, "agl.side": "client"},
        resource={"service.name": "bench"},
        rollout_id=rid,
        attempt=1,
    )


def http_figures(url: str, spans: int, rollouts: int, concurrent_rollouts: int) -> dict[str, float]:
    out: dict[str, float] = {}
    store = HttpStore(url)
    rid = store.enqueue([NewRollout()])[0].id
    store.claim("bench")
    batches = [
        [make_span(rid, t) for _ in range(BATCH)]
        for t in (os.urandom(16).hex() for _ in range(spans // BATCH))
    ]
    store.add_spans(batches[0][:10])  # warm-up
    t0 = time.perf_counter()
    for batch in tqdm(batches, desc="spans", unit="batch", leave=False):
        store.add_spans(batch)
    out["spans_per_s"] = len(batches) * BATCH / (time.perf_counter() - t0)
    for i in range(0, rollouts, 1000):
        store.enqueue([NewRollout() for _ in range(min(1000, rollouts - i))])
    t0 = time.perf_counter()
    for _ in tqdm(range(rollouts), desc="sequential", unit="rollout", leave=False):
        c = store.claim("bench")
        assert c is not None
        store.add_spans([make_span(c.rollout.id)])
        store.finish_attempt(c.rollout.id, c.attempt.number, "succeeded")
    out["rollouts_seq_per_s"] = rollouts / (time.perf_counter() - t0)
    store.close()
    out["rollouts_c32_per_s"] = asyncio.run(runners([url], concurrent_rollouts, 32))
    return out


async def runners(urls: list[str], n: int, count: int) -> float:
    """``count`` runners, spread evenly over ``urls``, each looping claim + span + finish until the queue
    is empty; returns rollouts/s."""
    async with AsyncHttpStore(urls[0]) as feeder:
        for i in range(0, n, 1000):
            await feeder.enqueue([NewRollout() for _ in range(min(1000, n - i))])
    clients = [AsyncHttpStore(urls[i % len(urls)]) for i in range(count)]
    bar = tqdm(total=n, desc=f"{count} runners / {len(urls)} server(s)", unit="rollout", leave=False)
    done = 0

    async def runner(store: AsyncHttpStore) -> None:
        nonlocal done
        while True:
            c = await store.claim("bench")
            if c is None:
                return
            await store.add_spans([make_span(c.rollout.id)])
            await store.finish_attempt(c.rollout.id, c.attempt.number, "succeeded")
            done += 1
            bar.update()

    t0 = time.perf_counter()
    await asyncio.gather(*(runner(s) for s in clients))
    elapsed = time.perf_counter() - t0
    bar.close()
    for s in clients:
        await s.aclose()
    assert done == n, f"{done} of {n} rollouts ran"
    return n / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--spans", type=int, default=20_000)
    ap.add_argument("--rollouts", type=int, default=1_000)
    ap.add_argument("--concurrent-rollouts", type=int, default=2_000)
    ap.add_argument("--runners", type=int, default=64)
    ap.add_argument("--skip-http", action="store_true", help="only the 1 vs 2 servers part")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    pg = LocalPostgres()
    pg.start()
    rows: dict[str, dict[str, float]] = {}
    scale: dict[int, float] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="agl-bench-") as tmp:
            if not args.skip_http:
                for name, server in (
                    ("sqlite", ServerProcess(Path(tmp) / "bench.db")),
                    ("postgres", ServerProcess(store_url=pg.create_database("bench_http"))),
                ):
                    url = server.start()
                    try:
                        rows[name] = http_figures(url, args.spans, args.rollouts, args.concurrent_rollouts)
                    finally:
                        server.stop()
            for n_servers in (1, 2):
                db = pg.create_database(f"bench_scale{n_servers}")
                servers = [ServerProcess(store_url=db) for _ in range(n_servers)]
                urls = [s.start() for s in servers]
                try:
                    scale[n_servers] = asyncio.run(runners(urls, args.concurrent_rollouts, args.runners))
                finally:
                    for s in servers:
                        s.stop()
    finally:
        pg.stop()
    load1 = os.getloadavg()[0]
    if rows:
        print(f"{'over HTTP':<10}{'spans/s':>10}{'seq rollouts/s':>16}{'32 clients rollouts/s':>23}")
        for name, r in rows.items():
            print(
                f"{name:<10}{r['spans_per_s']:>10,.0f}{r['rollouts_seq_per_s']:>16,.0f}{r['rollouts_c32_per_s']:>23,.0f}"
            )
    print(
        f"{args.runners} runners on PostgreSQL: 1 server {scale[1]:,.0f} rollouts/s, 2 servers {scale[2]:,.0f} "
        f"rollouts/s (x{scale[2] / scale[1]:.2f})"
    )
    print(f"load average {load0:.2f} at start, {load1:.2f} at end; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
