"""The store client's HTTP/1.1 transport: one keep-alive socket per thread (sync) or an asyncio pool.

``agl.store.http``'s sans-IO core hands each request over as one buffer (``_request_bytes``), and both
transports read the answer with the one parser here (``_Answer``), with no httpx request or response
objects on the way. Why it exists instead of httpx's own transport: bench/README.md "Client transport".
``https://`` and a ``transport=`` given by the caller still go through httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import httpx


class _Req(NamedTuple):
    """One HTTP request of a store call, before it is sent (no I/O, no transport objects)."""

    method: str
    path: str
    body: bytes | None
    parse: Callable[[bytes], Any]
    idempotency_key: str | None = None
    read_timeout: float | None = None
    prefer_minimal: bool = False
    #: after a retried write meets ConflictError: (build the lookup request, check -> result or None)
    reconcile: tuple[Callable[[], _Req], Callable[[Any], Any]] | None = None


_MAX_HEAD = 64 * 1024
_RECV = 256 * 1024
_NO_BODY_STATUSES = frozenset({204, 304})


class _Closed(Exception):
    """The server closed the connection before sending a byte of the answer (e.g. a stale keep-alive)."""


class _Malformed(Exception):
    pass


def _parse_head(lines: list[bytes]) -> tuple[int, bool, list[tuple[bytes, bytes]]]:
    """Status, keep-alive and headers from a response head (status line first)."""
    try:
        version, code = lines[0].split(None, 2)[:2]
        status = int(code)
    except (ValueError, IndexError):
        raise _Malformed(f"bad status line {lines[0][:100]!r}") from None
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise _Malformed(f"bad header line {line[:100]!r}")
        headers.append((name.strip(), value.strip()))
    keep = version == b"HTTP/1.1"
    for name, value in headers:
        if name.lower() == b"connection":
            keep = b"close" not in value.lower() and (keep or b"keep-alive" in value.lower())
    return status, keep, headers


def _framing(status: int, method: str, headers: list[tuple[bytes, bytes]]) -> tuple[str, int]:
    """How the body is delimited: ("none"|"length"|"chunked"|"eof", length)."""
    if method == "HEAD" or status in _NO_BODY_STATUSES or 100 <= status < 200:
        return "none", 0
    length = -1
    for name, value in headers:
        lname = name.lower()
        if lname == b"transfer-encoding" and b"chunked" in value.lower():
            return "chunked", 0
        if lname == b"content-length":
            try:
                length = int(value)
            except ValueError:
                raise _Malformed(f"bad Content-Length {value!r}") from None
    return ("length", length) if length >= 0 else ("eof", 0)


class _Answer:
    """One HTTP/1.1 response, parsed from whatever the socket delivers (sans-IO: the sync and the
    async transport both just feed it). Interim 1xx answers are skipped; bodies are delimited by
    Content-Length, chunked encoding or the end of the connection."""

    __slots__ = ("_buf", "_chunks", "_method", "_need", "_state", "body", "headers", "keep", "status")

    def __init__(self, method: str) -> None:
        self._buf = bytearray()
        self._method = method
        self._state = "head"
        self._need = 0
        self._chunks: list[bytes] = []
        self.status = 0
        self.keep = True
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""

    def feed(self, data: bytes) -> bool:
        """Add what was read (``b""`` at the end of the connection); True once the answer is whole."""
        buf = self._buf
        buf += data
        while self._state == "head":
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    raise _Malformed("answer headers too long")
                if not data:
                    if buf:
                        raise _Malformed("connection closed inside the answer's headers")
                    raise _Closed("connection closed before the answer")
                return False
            status, keep, headers = _parse_head(bytes(buf[:end]).split(b"\r\n"))
            del buf[: end + 4]
            if 100 <= status < 200:
                continue  # an interim answer (100 Continue): the real one follows
            self.status, self.keep, self.headers = status, keep, headers
            self._state, self._need = _framing(status, self._method, headers)
        state = self._state
        if state == "none":
            return True
        if state == "length":
            if len(buf) >= self._need:
                self.body = bytes(buf[: self._need])
                return True
        elif state == "eof":
            if not data:
                self.body, self.keep = bytes(buf), False
                return True
            return False
        elif self._chunked(buf):
            return True
        if not data:
            raise _Malformed("answer cut short")
        return False

    def _chunked(self, buf: bytearray) -> bool:
        while True:
            if self._state == "chunk":
                if len(buf) < self._need + 2:
                    return False
                self._chunks.append(bytes(buf[: self._need]))
                del buf[: self._need + 2]
                self._state = "chunked"
                continue
            nl = buf.find(b"\r\n")
            if nl < 0:
                return False
            line = bytes(buf[:nl])
            del buf[: nl + 2]
            if self._state == "trailer":
                if not line:
                    self.body = b"".join(self._chunks)
                    return True
                continue
            size = int(line.split(b";")[0].strip() or b"x", 16)
            self._state, self._need = ("trailer", 0) if size == 0 else ("chunk", size)


def _request_bytes(request: httpx.Request, body: bytes) -> bytes:
    """An httpx request as one buffer, for the transports' ``handle_request`` (tests, wrappers)."""
    parts = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    parts.extend(k + b": " + v for k, v in request.headers.raw if k.lower() != b"accept-encoding")
    parts.append(b"")
    parts.append(body)
    return b"\r\n".join(parts)


class _StdlibTransport(httpx.BaseTransport):
    """Plain-HTTP transport over sockets: one keep-alive connection per thread, one send per request.

    The client hands it a whole request as bytes (``exchange``), without building httpx request and
    response objects; ``handle_request`` is the same for code that wraps it as an httpx transport.
    httpcore sends a request's headers and body in two writes; on loopback each write wakes the
    server. bench/README.md has the figures against httpx's own transport.
    """

    def __init__(self, host: str, port: int) -> None:
        self._host = host
        self._port = port
        self._local = threading.local()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._closed = False

    def _connect(self, timeout: float | None) -> socket.socket:
        if self._closed:
            raise httpx.ConnectError("the transport is closed")
        try:
            sock = socket.create_connection((self._host, self._port), timeout)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {self._host}:{self._port} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {self._host}:{self._port}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._socks.append(sock)
        return sock

    def _drop(self, sock: socket.socket) -> None:
        sock.close()
        self._local.sock = None
        with self._lock:
            if sock in self._socks:
                self._socks.remove(sock)

    def exchange(self, data: bytes, method: str, connect: float | None, read: float | None) -> _Answer:
        where = f"{self._host}:{self._port}"
        for _ in range(2):
            sock: socket.socket | None = getattr(self._local, "sock", None)
            reused = sock is not None
            if sock is None:
                sock = self._local.sock = self._connect(connect)
            answer = _Answer(method)
            try:
                sock.settimeout(read)
                sock.sendall(data)
                recv = sock.recv
                while not answer.feed(recv(_RECV)):
                    pass
            except TimeoutError as exc:
                self._drop(sock)
                raise httpx.ReadTimeout(f"no answer from {where} in time") from exc
            except (_Closed, ConnectionResetError, BrokenPipeError) as exc:
                self._drop(sock)
                if reused:
                    continue  # the server closed an idle keep-alive connection: one fresh try
                raise httpx.RemoteProtocolError(f"connection to {where} dropped: {exc}") from exc
            except (_Malformed, ValueError) as exc:
                self._drop(sock)
                raise httpx.RemoteProtocolError(f"malformed answer from {where}: {exc}") from exc
            except OSError as exc:
                self._drop(sock)
                raise httpx.ReadError(f"talking to {where} failed: {exc!r}") from exc
            if not answer.keep:
                self._drop(sock)
            return answer
        raise httpx.RemoteProtocolError(f"connection to {where} dropped twice")

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        t = request.extensions.get("timeout", {})
        a = self.exchange(
            _request_bytes(request, request.read()), request.method, t.get("connect"), t.get("read")
        )
        return httpx.Response(a.status, headers=a.headers, content=a.body, request=request)

    def close(self) -> None:
        """Close every connection, waking threads blocked on one (a long-poll) with an error."""
        self._closed = True
        with self._lock:
            socks, self._socks = self._socks, []
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


async def _read_answer(reader: asyncio.StreamReader, answer: _Answer, timeout: float | None) -> None:
    if timeout is None:
        while not answer.feed(await reader.read(_RECV)):
            pass
    elif sys.version_info >= (3, 11):  # no extra task per request, unlike wait_for
        async with asyncio.timeout(timeout):
            while not answer.feed(await reader.read(_RECV)):
                pass
    else:  # pragma: no cover - Python 3.10
        await asyncio.wait_for(_read_answer(reader, answer, None), timeout)


class _AsyncStdlibTransport(httpx.AsyncBaseTransport):
    """The asyncio twin of ``_StdlibTransport``: a pool of keep-alive streams, one write per request."""

    def __init__(self, host: str, port: int, max_connections: int) -> None:
        self._host = host
        self._port = port
        self._max = max_connections
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _connect(self, timeout: float | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.wait_for(asyncio.open_connection(self._host, self._port), timeout)
        except asyncio.TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {self._host}:{self._port} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {self._host}:{self._port}: {exc}") from exc

    async def exchange(self, data: bytes, method: str, connect: float | None, read: float | None) -> _Answer:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections belong to one event loop
            self._drop_idle()
            self._loop, self._sem = loop, asyncio.Semaphore(self._max)
        assert self._sem is not None
        where = f"{self._host}:{self._port}"
        async with self._sem:
            for _ in range(2):
                conn = self._idle.pop() if self._idle else None
                reused = conn is not None
                if conn is None:
                    conn = await self._connect(connect)
                reader, writer = conn
                answer = _Answer(method)
                try:
                    writer.write(data)
                    await writer.drain()
                    await _read_answer(reader, answer, read)
                except asyncio.TimeoutError as exc:
                    writer.close()
                    raise httpx.ReadTimeout(f"no answer from {where} in time") from exc
                except (_Closed, ConnectionResetError, BrokenPipeError) as exc:
                    writer.close()
                    if reused:
                        continue
                    raise httpx.RemoteProtocolError(f"connection to {where} dropped: {exc}") from exc
                except (_Malformed, ValueError) as exc:
                    writer.close()
                    raise httpx.RemoteProtocolError(f"malformed answer from {where}: {exc}") from exc
                except OSError as exc:
                    writer.close()
                    raise httpx.ReadError(f"talking to {where} failed: {exc!r}") from exc
                except BaseException:
                    writer.close()  # cancelled mid-exchange: the connection's state is unknown
                    raise
                if answer.keep:
                    self._idle.append(conn)
                else:
                    writer.close()
                return answer
        raise httpx.RemoteProtocolError(f"connection to {where} dropped twice")

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        t = request.extensions.get("timeout", {})
        data = _request_bytes(request, await request.aread())
        a = await self.exchange(data, request.method, t.get("connect"), t.get("read"))
        return httpx.Response(a.status, headers=a.headers, content=a.body, request=request)

    def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            try:
                writer.close()
            except RuntimeError:  # its event loop is already closed
                pass

    async def aclose(self) -> None:
        self._drop_idle()
