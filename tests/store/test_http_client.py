"""HttpStore / AsyncHttpStore robustness: retries with backoff, idempotent retries, async API."""

from __future__ import annotations

import asyncio
import inspect
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import agl.store
from agl.store.base import ConflictError, InvalidInputError, NotFoundError
from agl.store.http import AsyncHttpStore, HttpStore, StoreUnavailableError
from agl.store.memory import MemoryStore
from agl.store.server import ServerProcess, serve_in_thread
from agl.types import NewRollout, RolloutConfig, Span


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_span(rollout_id: str, i: int = 1, attempt: int = 1) -> Span:
    return Span(
        trace_id=f"{i:032x}",
        span_id=f"{i:016x}",
        name="step",
        start_ns=1,
        end_ns=2,
        rollout_id=rollout_id,
        attempt=attempt,
    )


@pytest.fixture
def served() -> Iterator[tuple[MemoryStore, str]]:
    store = MemoryStore()
    with serve_in_thread(store) as url:
        yield store, url


class LoseFirstAnswer(httpx.BaseTransport):
    """Delivers each matching request to the server, then loses the answer once (a dropped link)."""

    def __init__(self, inner: httpx.BaseTransport, match: str, strip_key: bool = False) -> None:
        self.inner = inner
        self.match = match
        self.strip_key = strip_key
        self.lost: list[str] = []
        self.keys: list[str | None] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.match in request.url.path:
            self.keys.append(request.headers.get("idempotency-key"))
            if self.strip_key and "idempotency-key" in request.headers:
                del request.headers["idempotency-key"]  # as if the server had forgotten the key
        response = self.inner.handle_request(request)
        if self.match in request.url.path and not self.lost:
            response.read()
            self.lost.append(request.url.path)
            raise httpx.ReadError("connection reset after the server answered")
        return response

    def close(self) -> None:
        self.inner.close()


def test_open_picks_the_http_client(served: tuple[MemoryStore, str]) -> None:
    _, url = served
    store = agl.store.open(url)
    assert isinstance(store, HttpStore)
    assert store.health()
    store.close()
    with pytest.raises(ConflictError, match="closed"):
        store.query_rollouts()
    with pytest.raises(InvalidInputError):
        HttpStore("ftp://x")


def test_close_wakes_a_blocked_long_poll(served: tuple[MemoryStore, str]) -> None:
    store, url = served
    client = HttpStore(url)
    client.query_rollouts()  # this thread's connection exists; the claimer opens its own
    outcome: list[BaseException | object] = []

    def claimer() -> None:
        try:
            outcome.append(client.claim("w", timeout_s=20))
        except BaseException as exc:
            outcome.append(exc)

    th = threading.Thread(target=claimer)
    th.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    client.close()
    th.join(10)
    assert not th.is_alive() and time.monotonic() - t0 < 5
    assert isinstance(outcome[0], ConflictError) and "closed" in str(outcome[0])
    # the server's held claim may still take work that arrives now; it gives it straight back
    rid = store.enqueue([NewRollout(config=RolloutConfig(max_attempts=2))])[0].id
    time.sleep(1.5)  # past the server's poll slice: nothing of the closed client is left running
    rollout = store.get_rollout(rid)
    assert rollout.status == "queued"
    assert all(a.error is not None and a.error.type == "client_disconnected" for a in rollout.attempts)


def test_retries_until_the_server_comes_up(tmp_path: Path) -> None:
    port = free_port()
    client = HttpStore(f"http://127.0.0.1:{port}", retry_timeout_s=60)
    assert not client.health()
    result: list[Any] = []
    th = threading.Thread(target=lambda: result.append(client.enqueue([NewRollout(id="ro-late")])))
    th.start()
    time.sleep(0.3)  # the first tries are refused: nothing listens yet
    with ServerProcess(tmp_path / "s.db", port=port):
        th.join(60)
        assert result and result[0][0].id == "ro-late"
        assert [r.id for r in client.query_rollouts()] == ["ro-late"]
    client.close()


def test_gives_up_after_the_retry_window() -> None:
    client = HttpStore(f"http://127.0.0.1:{free_port()}", retry_timeout_s=0.4)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="unreachable") as info:
        client.get_resources()
    assert 0.3 <= time.monotonic() - t0 < 5
    assert info.value.status == 503


def test_a_retried_write_is_applied_once(served: tuple[MemoryStore, str]) -> None:
    store, url = served
    client = HttpStore(url)
    real = client._transport

    client._transport = LoseFirstAnswer(real, "/rollouts")
    out = client.enqueue([NewRollout(), NewRollout()])
    assert len(store.query_rollouts()) == 2 and [r.id for r in store.query_rollouts()] == [r.id for r in out]
    rid = out[0].id
    store.claim("w")

    lossy = LoseFirstAnswer(real, "/spans")
    client._transport = lossy
    spans = client.add_spans([make_span(rid, i) for i in range(1, 6)])
    assert lossy.lost == ["/spans"]
    assert [s.seq for s in spans] == [1, 2, 3, 4, 5]
    assert [s.seq for s in store.query_spans(rollout_id=rid)] == [1, 2, 3, 4, 5]

    lossy = LoseFirstAnswer(real, "/finish")
    client._transport = lossy
    done = client.finish_attempt(rid, 1, "succeeded")
    assert done.status == "succeeded" and lossy.lost
    assert len(set(lossy.keys)) == 1 and len(lossy.keys) == 2  # one key, reused by the retry

    client._transport = LoseFirstAnswer(real, "/resources")
    assert (
        client.add_resources({"main": {"type": "llm", "base_url": "http://x/v1", "model": "m"}}).version == 1
    )
    assert store.get_resources().version == 1  # type: ignore[union-attr]
    client.close()


def test_retried_finish_reconciles_when_the_key_was_forgotten(served: tuple[MemoryStore, str]) -> None:
    store, url = served
    rid = store.enqueue([NewRollout(), NewRollout()])[0].id
    store.claim("w")
    client = HttpStore(url)
    client._transport = LoseFirstAnswer(client._transport, "/finish", strip_key=True)
    # first try finishes the attempt; the retry meets "already ended" and finds it was its own doing
    done = client.finish_attempt(rid, 1, "failed", error={"type": "E", "message": "m"})
    assert done.status == "failed" and done.attempts[0].error is not None
    client._transport = LoseFirstAnswer(client._transport.inner, "/cancel", strip_key=True)  # type: ignore[attr-defined]
    other = store.query_rollouts(status="queued")[0].id
    assert client.cancel(other).status == "cancelled"
    # but a genuine conflict (not our own earlier try) is still reported
    with pytest.raises(ConflictError):
        client.finish_attempt(rid, 1, "succeeded")
    client.close()


async def test_async_client_round_trip(served: tuple[MemoryStore, str]) -> None:
    _, url = served
    async with AsyncHttpStore(url) as store:
        claimer = asyncio.create_task(store.claim("w", timeout_s=20))
        await asyncio.sleep(0.2)
        assert not claimer.done()
        (r,) = await store.enqueue([NewRollout(input={"q": 1})])
        claim = await asyncio.wait_for(claimer, 10)
        assert claim is not None and claim.rollout.id == r.id and claim.attempt.number == 1
        spans = await store.add_spans([make_span(r.id, i) for i in range(1, 4)])
        assert [s.seq for s in spans] == [1, 2, 3]
        waiter = asyncio.create_task(store.wait_for_rollouts([r.id], timeout_s=20))
        await asyncio.sleep(0.1)
        await store.heartbeat(r.id, 1)
        await store.finish_attempt(r.id, 1, "succeeded")
        done = await asyncio.wait_for(waiter, 10)
        assert [x.status for x in done] == ["succeeded"]
        assert len(await store.query_spans(rollout_id=r.id)) == 3
        assert (await store.get_rollout(r.id)).status == "succeeded"
        assert [a.status for a in await store.get_attempts(r.id)] == ["succeeded"]
        res = await store.add_resources({"main": {"type": "llm", "base_url": "http://x/v1", "model": "m"}})
        assert (await store.get_resources()) == res
        await store.add_tasks([{"id": "t1"}])  # type: ignore[list-item]
        assert (await store.get_task("t1")).id == "t1" and len(await store.query_tasks()) == 1
        assert [x.id for x in await store.query_rollouts(status="succeeded")] == [r.id]
        with pytest.raises(NotFoundError, match="ro-missing"):
            await store.get_rollout("ro-missing")
        with pytest.raises(ConflictError):
            await store.cancel(r.id)
    with pytest.raises(ConflictError, match="closed"):
        await store.get_resources()


async def test_async_client_retries_until_the_server_comes_up(tmp_path: Path) -> None:
    port = free_port()
    server = ServerProcess(tmp_path / "s.db", port=port)
    async with AsyncHttpStore(f"http://127.0.0.1:{port}", retry_timeout_s=60) as store:
        task = asyncio.create_task(store.enqueue([NewRollout(id="ro-a")]))
        await asyncio.sleep(0.3)
        await asyncio.to_thread(server.start)
        try:
            assert (await asyncio.wait_for(task, 60))[0].id == "ro-a"
        finally:
            server.stop()


def test_both_clients_have_the_store_protocols_signatures() -> None:
    """The sync and async methods are generated from one core: each must still take exactly the
    parameters of the Store protocol (names, kinds, defaults), as callers and type checkers expect."""
    from agl.store.base import Store

    names = [n for n, v in vars(Store).items() if callable(v) and not n.startswith("_") and n != "close"]
    assert len(names) == 16
    for name in names:
        want = [
            (p.name, p.kind, p.default) for p in inspect.signature(getattr(Store, name)).parameters.values()
        ]
        for cls in (HttpStore, AsyncHttpStore):
            method = getattr(cls, name)
            got = [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()]
            assert got == want, (cls.__name__, name)
            assert method.__name__ == name
        assert inspect.iscoroutinefunction(AsyncHttpStore.claim) and not inspect.iscoroutinefunction(
            HttpStore.claim
        )


def test_a_key_that_cannot_travel_in_a_header_is_refused(served: tuple[MemoryStore, str]) -> None:
    store, url = served
    client = HttpStore(url)
    for bad in ("k\r\nx-evil: 1", "clé"):
        with pytest.raises(InvalidInputError, match="printable ASCII"):
            client.add_resources({}, idempotency_key=bad)
    assert store.get_resources() is None  # nothing was published
    assert client.add_resources({}, idempotency_key="fine-key.1").version == 1
    client.close()


@pytest.mark.parametrize("step", [1, 7, 10_000])
def test_answer_parser_reads_every_framing_whatever_the_reads(step: int) -> None:
    """The one response parser both transports feed: Content-Length, chunked (extensions, trailers),
    interim 100 answers, and bodies delimited by the end of the connection, split at any byte."""
    from agl.store._transport import _Answer, _Closed, _Malformed

    def parse(raw: bytes, method: str = "POST") -> _Answer:
        answer = _Answer(method)
        chunks = [raw[i : i + step] for i in range(0, len(raw), step)] + [b""]
        for chunk in chunks:
            if answer.feed(chunk):
                return answer
        raise AssertionError("never complete")

    a = parse(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
    assert (a.status, a.body, a.keep) == (200, b"hello", True)
    a = parse(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
    assert (a.status, a.body) == (201, b"ok")
    a = parse(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"4;ext=1\r\nwiki\r\n5\r\npedia\r\n0\r\nx-trailer: 1\r\n\r\n"
    )
    assert a.body == b"wikipedia" and a.keep
    a = parse(b"HTTP/1.0 200 OK\r\n\r\nuntil the end")
    assert (a.body, a.keep) == (b"until the end", False)
    a = parse(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    assert (a.body, a.keep) == (b"", False)
    assert parse(b"HTTP/1.1 204 No Content\r\n\r\n").body == b""
    assert parse(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", method="HEAD").body == b""
    with pytest.raises(_Closed):
        parse(b"")
    for broken in (
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nContent-Le",
        b"NOT HTTP\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
    ):
        with pytest.raises(_Malformed):
            parse(broken)
    with pytest.raises(ValueError):  # the transports report it as a malformed answer
        parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
