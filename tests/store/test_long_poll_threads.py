"""Waiting long-polls cost no threads: 2,000 runners blocked in ``POST /claim`` on one store server
(a real ``agl store serve`` process) hold fewer than 50 threads, and enqueued work reaches them at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agl.store.http import HttpStore
from agl.store.server import ServerProcess
from agl.types import NewRollout

N_POLLS = 2000


@pytest.fixture
def enough_open_files() -> Iterator[None]:
    """Both this process and the server (which inherits the limit) hold one socket per long-poll, past
    the 1,024 open files a non-root login gets by default; raise the soft limit to the hard one."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = N_POLLS + 512
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"needs {need} open files per process; the hard limit (ulimit -Hn) is {hard}")
    if (
        soft != resource.RLIM_INFINITY and soft < need
    ):  # to the hard limit: an earlier run's sockets may linger
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (4 * N_POLLS if hard == resource.RLIM_INFINITY else hard, hard)
        )
    yield  # not lowered again: a limit below the descriptors still open would fail later tests


@pytest.fixture(params=["sqlite", "postgres"])
def server(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    pg_database_url: Callable[[], str],
    enough_open_files: None,
) -> ServerProcess:
    if request.param == "sqlite":
        proc = ServerProcess(tmp_path / "polls.db", log_path=tmp_path / "server.log")
    else:
        proc = ServerProcess(store_url=pg_database_url(), log_path=tmp_path / "server.log")
    proc.start()
    yield proc  # type: ignore[misc]
    proc.stop()


def _threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


async def _claim(port: int, worker: str, ready: asyncio.Event, opened: list[int]) -> dict:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await _exchange(reader, writer, worker, ready, opened)
    finally:
        writer.close()  # also when cancelled: 2,000 sockets must not outlive the test


async def _exchange(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    worker: str,
    ready: asyncio.Event,
    opened: list[int],
) -> dict:
    body = json.dumps({"worker_id": worker, "timeout_s": 55}).encode()
    writer.write(
        b"POST /claim HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    opened.append(1)
    if len(opened) == N_POLLS:
        ready.set()
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(
        next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
    )
    return json.loads(await reader.readexactly(length))  # type: ignore[no-any-return]  # type: ignore[no-any-return]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads through /proc")
def test_2000_waiting_long_polls_hold_few_threads(server: ServerProcess) -> None:
    assert server.proc is not None and server.url is not None
    pid, port = server.proc.pid, int(server.url.rsplit(":", 1)[1])
    client = HttpStore(server.url)

    async def drill() -> tuple[int, int, list[dict]]:
        ready = asyncio.Event()
        opened: list[int] = []
        tasks = [asyncio.ensure_future(_claim(port, f"w{i}", ready, opened)) for i in range(N_POLLS)]
        await asyncio.wait_for(ready.wait(), 60)
        await asyncio.sleep(5)  # let every request be parsed and parked
        held_threads = _threads(pid)
        early = sum(t.done() for t in tasks)
        # enqueued work reaches waiting claimers promptly
        t0 = time.monotonic()
        await asyncio.to_thread(client.enqueue, [NewRollout() for _ in range(5)])
        while sum(t.done() for t in tasks) < 5 and time.monotonic() - t0 < 40:
            await asyncio.sleep(0.02)
        claimed = [t.result() for t in tasks if t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return held_threads, early, claimed

    held_threads, early, claimed = asyncio.run(drill())
    client.close()
    assert early == 0, f"{early} long-polls returned before their timeout with nothing queued"
    assert held_threads < 50, f"{N_POLLS} waiting long-polls hold {held_threads} threads"
    got = [c["claim"] for c in claimed if c.get("claim")]
    assert len(got) == 5 and len({c["rollout"]["id"] for c in got}) == 5
