"""The gateway's span writer (``agl.gateway.span_writer``) driven directly: calls that overlap on a
SQLite store go to the writer thread, which stores what queued meanwhile in one ``add_spans`` (one
commit); every waiting call returns only once its own spans are readable; ``close`` stops the thread.

The gateway test of the same (tests/gateway/test_streaming.py) depends on how the server's requests
happen to interleave; here the overlap is certain."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter
from pathlib import Path
from typing import Any

from gw_helpers import start_rollout

import agl.store
from agl.gateway.span_writer import SpanWriter
from agl.types import Span


def _span(rollout_id: str, attempt: int) -> Span:
    now = time.time_ns()
    return Span(
        trace_id=secrets.token_hex(16),
        span_id=secrets.token_hex(8),
        name="chat",
        start_ns=now,
        end_ns=now + 1000,
        rollout_id=rollout_id,
        attempt=attempt,
        attributes={},
    )


def test_overlapping_writes_share_a_commit_in_the_writer_thread_and_close_stops_it(tmp_path: Path) -> None:
    store = agl.store.open(f"sqlite:///{tmp_path / 'spans.db'}")
    ros = [start_rollout(store, f"ro-{i}") for i in range(8)]
    add_spans = store.add_spans

    def slow(spans: Any, **kw: Any) -> Any:
        time.sleep(0.05)  # the first write holds the thread while the others queue behind it
        return add_spans(spans, **kw)

    store.add_spans = slow  # type: ignore[method-assign]
    stats: Counter[str] = Counter()
    writer = SpanWriter(store, stats)
    assert writer.batch_overlapping  # SQLite: a commit per write, so overlapping calls are batched
    seen: dict[str, int] = {}

    async def call(rollout: tuple[str, int]) -> None:
        await writer.write([_span(*rollout)], alone=False)
        seen[rollout[0]] = len(store.query_spans(rollout_id=rollout[0]))  # read right after the await

    async def main() -> None:
        await asyncio.gather(*(call(r) for r in ros))

    asyncio.run(main())
    thread = writer._thread
    assert thread is not None and thread.is_alive()
    assert stats["spans_stored"] == 8
    assert stats["span_writes"] < 8  # batched: fewer transactions than calls
    assert seen == {r[0]: 1 for r in ros}  # each call's span was stored before its await returned
    writer.close(timeout_s=10)
    assert not thread.is_alive()
    store.close()
