"""Store throughput: batched span inserts (spans/s) and claim + span + finish (rollouts/s).

    python bench/store.py [--spans 50000] [--rollouts 5000] [--stores memory,sqlite,sqlite-full]

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


def bench_spans(store: Store, n: int) -> float:
    rid = store.enqueue([NewRollout()])[0].id
    store.claim("bench")
    batches = []
    for b in range(n // BATCH):
        trace = os.urandom(16).hex()
        batches.append([make_span(rid, b * BATCH + i, trace) for i in range(BATCH)])
    t0 = time.perf_counter()
    for batch in tqdm(batches, desc="spans", unit="batch", leave=False):
        store.add_spans(batch)
    return (len(batches) * BATCH) / (time.perf_counter() - t0)


def bench_rollouts(store: Store, n: int) -> float:
    for _ in range(0, n, 1000):
        store.enqueue([NewRollout(input={"q": "what is 2+2?"}) for _ in range(1000)])
    t0 = time.perf_counter()
    for _ in tqdm(range(n), desc="rollouts", unit="rollout", leave=False):
        c = store.claim("bench")
        assert c is not None
        store.add_spans([make_span(c.rollout.id, 0)])
        store.finish_attempt(c.rollout.id, c.attempt.number, "succeeded")
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=50_000)
    ap.add_argument("--rollouts", type=int, default=5_000)
    ap.add_argument("--stores", default="memory,sqlite,sqlite-full")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        counter = iter(range(1_000_000))
        openers: dict[str, Callable[[], Store]] = {
            "memory": MemoryStore,
            "sqlite": lambda: SQLiteStore(Path(tmp) / f"b{next(counter)}.db"),
            "sqlite-full": lambda: SQLiteStore(Path(tmp) / f"b{next(counter)}.db", synchronous="FULL"),
        }
        rows = []
        for name in args.stores.split(","):
            s1 = openers[name]()
            spans = bench_spans(s1, args.spans)
            s1.close()
            s2 = openers[name]()
            rollouts = bench_rollouts(s2, args.rollouts)
            s2.close()
            rows.append((name, spans, rollouts))
    print(f"{'store':<12} {'spans/s (batch 100)':>20} {'x baseline':>10} {'rollouts/s':>11} {'x baseline':>10}")
    print(f"{'agl-0.3 mem':<12} {BASELINE['spans']:>20,.0f} {1.0:>10.2f} {BASELINE['rollouts']:>11,.0f} {1.0:>10.2f}")
    for name, spans, rollouts in rows:
        print(
            f"{name:<12} {spans:>20,.0f} {spans / BASELINE['spans']:>10.2f} "
            f"{rollouts:>11,.0f} {rollouts / BASELINE['rollouts']:>10.2f}"
        )
    print(f"targets for sqlite: >= {TARGET_SQLITE['spans']:,.0f} spans/s, >= {TARGET_SQLITE['rollouts']:,.0f} rollouts/s")


if __name__ == "__main__":
    main()
