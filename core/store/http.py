"""HTTP client of ``agl store serve``: the Store protocol for runners and agents in other processes or hosts.

``HttpStore`` (sync) and ``AsyncHttpStore`` build the same requests (``_Requests``) and differ only in
how they send them. What a caller can rely on:

- Same behaviour as an in-process store: arguments are checked with the same helpers the stores use,
  server errors come back as the same ``StoreError`` subclasses with the server's message.
- Retries: connection errors (refused, reset, timeouts, a server restarting) are retried with capped
  exponential backoff for up to ``retry_timeout_s``, then ``StoreUnavailableError``.
- Idempotency: every write carries an idempotency key, generated once per call and reused by all of
  its retries, so a retried enqueue or span batch is stored once. Finishing or cancelling, when a retry
  meets "already ended", checks whether its own earlier try did it and then returns as if it had.
- Long-poll: ``claim``/``wait_for_rollouts`` are held by the server until work arrives; waits longer
  than the server's cap are split into consecutive long-polls, never a fixed polling interval.
  ``close()`` wakes a thread blocked in one (it gets ``ConflictError``, as with a closed local store).
- Answers are trusted: spans, rollouts and claims from the server (which validated them before storing)
  are rebuilt without running the models' validators again, several times cheaper than validating.

Plain ``http://`` requests go through small httpx transports over sockets (one keep-alive connection
per thread; an asyncio pool for the async client) that send each request in one write: httpcore and
``http.client`` write headers and body separately, and on loopback each write wakes the server, which
measured here cost a third of a small store call. ``https://`` uses httpx's own transports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import httpx
import pydantic_core
from pydantic import BaseModel, create_model

from agl.store._common import (
    check_attempt_number,
    check_error,
    check_finish_status,
    check_ids,
    check_limit,
    check_mode,
    check_modes,
    check_offset,
    check_statuses,
    check_timeout,
    coerce_many,
)
from agl.store._wire import dump_spans
from agl.store.base import ConflictError, InvalidInputError, NotFoundError, StoreError
from agl.types import (
    _ID_RE,
    Attempt,
    AttemptError,
    Claim,
    Mode,
    NewRollout,
    Resource,
    Resources,
    Rollout,
    RolloutConfig,
    Span,
    SpanEvent,
    SpanStatus,
    Task,
)

__all__ = ["AsyncHttpStore", "HttpStore", "StoreAuthError", "StoreUnavailableError"]

TOKEN_ENV = "AGL_STORE_TOKEN"
#: Longest single long-poll request; the server caps its own hold at 30 s as well.
MAX_POLL_S = 30.0
_POLL_MARGIN_S = 15.0
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 2.0
_RETRY_STATUSES = frozenset({502, 503, 504})


class StoreUnavailableError(StoreError, ConnectionError):
    """The server could not be reached (or kept failing) for the whole retry window."""

    status = 503
    code = "unavailable"


class StoreAuthError(StoreError, PermissionError):
    """The server refused the bearer token (or none was given)."""

    status = 401
    code = "unauthorized"


_ERRORS: dict[str, type[StoreError]] = {
    "invalid_input": InvalidInputError,
    "invalid_json": InvalidInputError,
    "body_too_large": InvalidInputError,
    "idempotency_key_reused": InvalidInputError,
    "not_found": NotFoundError,
    "conflict": ConflictError,
    "unauthorized": StoreAuthError,
}
_BY_STATUS: dict[int, type[StoreError]] = {400: InvalidInputError, 404: NotFoundError, 409: ConflictError}


def _error_from(status: int, body: bytes) -> StoreError:
    code, message = "", ""
    try:
        err = json.loads(body)["error"]
        code, message = str(err.get("code", "")), str(err.get("message", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        message = body[:500].decode("utf-8", "replace")
    cls = _ERRORS.get(code) or _BY_STATUS.get(status)
    if cls is None:
        exc = StoreError(f"store server answered {status}: {message or '(no message)'}")
        exc.status = status
        exc.code = code or "http_error"
        return exc
    return cls(message or f"store server answered {status}")


def _field(name: str, tp: Any) -> Callable[[bytes], Any]:
    """Parser of ``{"<name>": <tp>}`` bodies, validated in one pydantic-core pass."""
    model: type[BaseModel] = create_model(f"_{name.title()}Body", **{name: (tp, ...)})  # type: ignore[call-overload]

    def parse(body: bytes) -> Any:
        return getattr(model.model_validate_json(body), name)

    return parse


# Answers of our own server hold data it validated before storing: rebuild the hot ones (spans,
# rollouts, claims) without validating again, which costs several times the JSON parse. Rare, small
# answers (tasks, resources) are validated as usual.
_new = object.__new__
_setattr = object.__setattr__


def _trusted(cls: type[BaseModel], fields: frozenset[str], values: dict[str, Any]) -> Any:
    if values.keys() != fields:  # an older or newer server: let pydantic fill in or drop fields
        return cls.model_construct(**values)
    obj = _new(cls)
    _setattr(obj, "__dict__", values)
    _setattr(obj, "__pydantic_fields_set__", set(fields))
    _setattr(obj, "__pydantic_extra__", None)
    _setattr(obj, "__pydantic_private__", None)
    return obj


_F_SPAN, _F_STATUS, _F_EVENT = (
    frozenset(Span.model_fields),
    frozenset(SpanStatus.model_fields),
    frozenset(SpanEvent.model_fields),
)
_F_ROLLOUT, _F_CONFIG = frozenset(Rollout.model_fields), frozenset(RolloutConfig.model_fields)
_F_ATTEMPT, _F_ERROR, _F_CLAIM = (
    frozenset(Attempt.model_fields),
    frozenset(AttemptError.model_fields),
    frozenset(Claim.model_fields),
)


def _span(d: dict[str, Any]) -> Span:
    d["status"] = _trusted(SpanStatus, _F_STATUS, d["status"])
    d["events"] = tuple(_trusted(SpanEvent, _F_EVENT, e) for e in d["events"])
    return _trusted(Span, _F_SPAN, d)  # type: ignore[no-any-return]


def _attempt(d: dict[str, Any]) -> Attempt:
    if d.get("error") is not None:
        d["error"] = _trusted(AttemptError, _F_ERROR, d["error"])
    return _trusted(Attempt, _F_ATTEMPT, d)  # type: ignore[no-any-return]


def _rollout(d: dict[str, Any]) -> Rollout:
    d["config"] = _trusted(RolloutConfig, _F_CONFIG, d["config"])
    d["attempts"] = tuple(_attempt(a) for a in d["attempts"])
    return _trusted(Rollout, _F_ROLLOUT, d)  # type: ignore[no-any-return]


def _claim(d: dict[str, Any] | None) -> Claim | None:
    if d is None:
        return None
    return _trusted(Claim, _F_CLAIM, {"rollout": _rollout(d["rollout"]), "attempt": _attempt(d["attempt"])})  # type: ignore[no-any-return]


_from_json = pydantic_core.from_json
_P_SPANS: Callable[[bytes], Any] = lambda b: [_span(x) for x in _from_json(b)["spans"]]  # noqa: E731
_P_ROLLOUTS: Callable[[bytes], Any] = lambda b: [_rollout(x) for x in _from_json(b)["rollouts"]]  # noqa: E731
_P_ATTEMPTS: Callable[[bytes], Any] = lambda b: [_attempt(x) for x in _from_json(b)["attempts"]]  # noqa: E731
_P_CLAIM: Callable[[bytes], Any] = lambda b: _claim(_from_json(b)["claim"])  # noqa: E731
_P_ROLLOUT: Callable[[bytes], Any] = lambda b: _rollout(_from_json(b))  # noqa: E731
_P_ATTEMPT: Callable[[bytes], Any] = lambda b: _attempt(_from_json(b))  # noqa: E731
_P_TASKS = _field("tasks", list[Task])
_P_RESOURCES = _field("resources", Resources | None)
_P_TASK = Task.model_validate_json
_P_RESOURCE_SNAPSHOT = Resources.model_validate_json


def _to_json(value: Any) -> bytes:
    try:
        return pydantic_core.to_json(value)
    except pydantic_core.PydanticSerializationError as exc:
        raise InvalidInputError(f"cannot send this over HTTP: {exc}") from None


def _check_path_id(value: Any, what: str) -> str:
    """Ids travel in URL paths; one that cannot be a valid id cannot exist, so it is simply not found."""
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise NotFoundError(f"{what} {value!r} not found")
    return value


class _Req(NamedTuple):
    method: str
    url: httpx.URL
    body: bytes | None
    parse: Callable[[bytes], Any]
    idempotency_key: str | None = None
    read_timeout: float | None = None
    prefer_minimal: bool = False
    #: after a retried write meets ConflictError: (lookup request, check -> result or None)
    reconcile: tuple[_Req, Callable[[Any], Any]] | None = None


# ----------------------------------------------------------------------------------------- transport

_MAX_HEAD = 64 * 1024
_NO_BODY_STATUSES = frozenset({204, 304})


class _Closed(Exception):
    """The server closed the connection before sending a byte of the answer (e.g. a stale keep-alive)."""


class _Malformed(Exception):
    pass


def _request_bytes(request: httpx.Request, body: bytes) -> bytes:
    """The whole request in one buffer: one send, one wake-up of the server (not headers, then body)."""
    parts = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    parts.extend(k + b": " + v for k, v in request.headers.raw if k.lower() != b"accept-encoding")
    parts.append(b"")
    parts.append(body)
    return b"\r\n".join(parts)


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


class _SyncConn:
    __slots__ = ("reader", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = sock.makefile("rb")

    def close(self) -> None:
        try:
            self.reader.close()
        finally:
            self.sock.close()

    def _line(self) -> bytes:
        line = self.reader.readline(_MAX_HEAD + 1)
        if len(line) > _MAX_HEAD:
            raise _Malformed("response header line too long")
        return line

    def read_response(self, method: str) -> tuple[int, bool, list[tuple[bytes, bytes]], bytes]:
        while True:
            first = self._line()
            if not first:
                raise _Closed("connection closed before the answer")
            lines = [first.rstrip(b"\r\n")]
            while True:
                line = self._line()
                if not line:
                    raise _Malformed("connection closed inside the answer's headers")
                if line in (b"\r\n", b"\n"):
                    break
                lines.append(line.rstrip(b"\r\n"))
            status, keep, headers = _parse_head(lines)
            if 100 <= status < 200:
                continue  # an interim answer (100 Continue): the real one follows
            break
        kind, length = _framing(status, method, headers)
        if kind == "none":
            body = b""
        elif kind == "length":
            body = self.reader.read(length)
            if len(body) != length:
                raise _Malformed(f"answer cut short: {len(body)} of {length} bytes")
        elif kind == "chunked":
            chunks = []
            while True:
                size = int(self._line().split(b";")[0].strip() or b"x", 16)
                if size == 0:
                    while self._line() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.reader.read(size))
                self.reader.read(2)
            body = b"".join(chunks)
        else:
            body, keep = self.reader.read(), False
        return status, keep, headers, body


class _StdlibTransport(httpx.BaseTransport):
    """Plain-HTTP transport over sockets: one keep-alive connection per thread, one send per request.

    httpcore (and ``http.client``) send a request's headers and body in two writes; on loopback each
    write wakes the server, and measured here the pair cost a third of a small store call. This sends
    one buffer and parses the answer head itself (status line, headers, Content-Length or chunked).
    """

    def __init__(self, host: str, port: int) -> None:
        self._host = host
        self._port = port
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: list[_SyncConn] = []
        self._closed = False

    def _connect(self, timeout: float | None) -> _SyncConn:
        if self._closed:
            raise httpx.ConnectError("the transport is closed")
        try:
            sock = socket.create_connection((self._host, self._port), timeout)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {self._host}:{self._port} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {self._host}:{self._port}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _SyncConn(sock)
        with self._lock:
            self._conns.append(conn)
        return conn

    def _drop(self, conn: _SyncConn) -> None:
        conn.close()
        self._local.conn = None
        with self._lock:
            if conn in self._conns:
                self._conns.remove(conn)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        data = _request_bytes(request, request.read())
        for _ in range(2):
            conn: _SyncConn | None = getattr(self._local, "conn", None)
            reused = conn is not None
            if conn is None:
                conn = self._local.conn = self._connect(timeouts.get("connect"))
            try:
                conn.sock.settimeout(timeouts.get("read"))
                conn.sock.sendall(data)
                status, keep, headers, body = conn.read_response(request.method)
            except TimeoutError as exc:
                self._drop(conn)
                raise httpx.ReadTimeout(f"no answer from {self._host}:{self._port} in time") from exc
            except (_Closed, ConnectionResetError, BrokenPipeError) as exc:
                self._drop(conn)
                if reused:
                    continue  # the server closed an idle keep-alive connection: one fresh try
                raise httpx.RemoteProtocolError(
                    f"connection to {self._host}:{self._port} dropped: {exc}"
                ) from exc
            except (_Malformed, ValueError) as exc:
                self._drop(conn)
                raise httpx.RemoteProtocolError(
                    f"malformed answer from {self._host}:{self._port}: {exc}"
                ) from exc
            except OSError as exc:
                self._drop(conn)
                raise httpx.ReadError(f"talking to {self._host}:{self._port} failed: {exc!r}") from exc
            if not keep:
                self._drop(conn)
            return httpx.Response(status, headers=headers, content=body, request=request)
        raise httpx.RemoteProtocolError(f"connection to {self._host}:{self._port} dropped twice")

    def close(self) -> None:
        """Close every connection, waking threads blocked on one (a long-poll) with an error."""
        self._closed = True
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()


class _AsyncConn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()

    async def read_response(self, method: str) -> tuple[int, bool, list[tuple[bytes, bytes]], bytes]:
        reader = self.reader
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:
                    raise _Closed("connection closed before the answer") from None
                raise _Malformed("connection closed inside the answer's headers") from None
            except asyncio.LimitOverrunError:
                raise _Malformed("answer headers too long") from None
            status, keep, headers = _parse_head(head[:-4].split(b"\r\n"))
            if not 100 <= status < 200:
                break
        kind, length = _framing(status, method, headers)
        try:
            if kind == "none":
                body = b""
            elif kind == "length":
                body = await reader.readexactly(length)
            elif kind == "chunked":
                chunks = []
                while True:
                    size = int((await reader.readline()).split(b";")[0].strip() or b"x", 16)
                    if size == 0:
                        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                            pass
                        break
                    chunks.append(await reader.readexactly(size))
                    await reader.readexactly(2)
                body = b"".join(chunks)
            else:
                body, keep = await reader.read(), False
        except asyncio.IncompleteReadError:
            raise _Malformed("answer cut short") from None
        return status, keep, headers, body


class _AsyncStdlibTransport(httpx.AsyncBaseTransport):
    """The asyncio twin of ``_StdlibTransport``: a pool of keep-alive streams, one write per request."""

    def __init__(self, host: str, port: int, max_connections: int) -> None:
        self._host = host
        self._port = port
        self._max = max_connections
        self._idle: list[_AsyncConn] = []
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _connect(self, timeout: float | None) -> _AsyncConn:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(self._host, self._port), timeout)
        except asyncio.TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {self._host}:{self._port} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {self._host}:{self._port}: {exc}") from exc
        return _AsyncConn(reader, writer)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections belong to one event loop
            self._drop_idle()
            self._loop, self._sem = loop, asyncio.Semaphore(self._max)
        assert self._sem is not None
        timeouts = request.extensions.get("timeout", {})
        data = _request_bytes(request, await request.aread())
        async with self._sem:
            for _ in range(2):
                conn = self._idle.pop() if self._idle else None
                reused = conn is not None
                if conn is None:
                    conn = await self._connect(timeouts.get("connect"))
                try:
                    conn.writer.write(data)
                    await conn.writer.drain()
                    timeout = timeouts.get("read")
                    if timeout is None:
                        status, keep, headers, body = await conn.read_response(request.method)
                    elif sys.version_info >= (3, 11):  # no extra task per request, unlike wait_for
                        async with asyncio.timeout(timeout):
                            status, keep, headers, body = await conn.read_response(request.method)
                    else:  # pragma: no cover - Python 3.10
                        status, keep, headers, body = await asyncio.wait_for(
                            conn.read_response(request.method), timeout
                        )
                except asyncio.TimeoutError as exc:
                    conn.close()
                    raise httpx.ReadTimeout(f"no answer from {self._host}:{self._port} in time") from exc
                except (_Closed, ConnectionResetError, BrokenPipeError) as exc:
                    conn.close()
                    if reused:
                        continue
                    raise httpx.RemoteProtocolError(
                        f"connection to {self._host}:{self._port} dropped: {exc}"
                    ) from exc
                except (_Malformed, ValueError) as exc:
                    conn.close()
                    raise httpx.RemoteProtocolError(
                        f"malformed answer from {self._host}:{self._port}: {exc}"
                    ) from exc
                except OSError as exc:
                    conn.close()
                    raise httpx.ReadError(f"talking to {self._host}:{self._port} failed: {exc!r}") from exc
                except BaseException:
                    conn.close()  # cancelled mid-exchange: the connection's state is unknown
                    raise
                if keep:
                    self._idle.append(conn)
                else:
                    conn.close()
                return httpx.Response(status, headers=headers, content=body, request=request)
        raise httpx.RemoteProtocolError(f"connection to {self._host}:{self._port} dropped twice")

    def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            try:
                conn.close()
            except RuntimeError:  # its event loop is already closed
                pass

    async def aclose(self) -> None:
        self._drop_idle()


# ------------------------------------------------------------------------------------------ requests


class _Requests:
    """Everything but sending: argument checks (as the stores do them), URLs, bodies, parsers."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        retry_timeout_s: float = 30.0,
    ) -> None:
        if not isinstance(url, str):
            raise InvalidInputError(f"store URL must be a string, got {type(url).__name__}")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidInputError(f"store URL {url!r} is not http(s)://host[:port][/prefix]")
        self.url = url.rstrip("/")
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.retry_timeout_s = float(retry_timeout_s)
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        headers = {"content-type": "application/json", "accept": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._headers = headers
        self._url_cache: dict[str, httpx.URL] = {}
        self._closed = False
        #: requests re-sent after a connection error or 502/503/504 (for monitoring and tests)
        self.retries = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _u(self, path: str) -> httpx.URL:
        url = self._url_cache.get(path)
        if url is None:
            url = httpx.URL(self.url + path)
            if len(self._url_cache) < 4096:
                self._url_cache[path] = url
        return url

    def _timeouts(self, read: float | None) -> dict[str, float | None]:
        r = self.timeout_s if read is None else read
        return {"connect": self.connect_timeout_s, "read": r, "write": r, "pool": self.connect_timeout_s}

    def _build(self, req: _Req) -> httpx.Request:
        headers = self._headers
        if req.idempotency_key is not None or req.prefer_minimal:
            headers = dict(headers)
            if req.idempotency_key is not None:
                headers["idempotency-key"] = req.idempotency_key
            if req.prefer_minimal:
                headers["prefer"] = "return=minimal"
        return httpx.Request(
            req.method,
            req.url,
            content=req.body,
            headers=headers,
            extensions={"timeout": self._timeouts(req.read_timeout)},
        )

    def _parse(self, req: _Req, body: bytes) -> Any:
        try:
            return req.parse(body)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StoreError(
                f"unexpected answer from {self.url} to {req.method} {req.url.path}: {exc!r} in {body[:200]!r}"
            ) from None

    def _check_open(self) -> None:
        if self._closed:
            raise ConflictError("the store is closed")

    @staticmethod
    def _backoff(attempt: int) -> float:
        return min(_BACKOFF_MAX_S, _BACKOFF_MIN_S * 2**attempt) * (0.5 + random.random() / 2)

    # ---------------------------------------------------------------- tasks
    def _add_tasks(self, tasks: Sequence[Task]) -> _Req:
        items = coerce_many(Task, tasks, "task")
        return _Req("POST", self._u("/tasks"), _to_json({"tasks": items}), _P_TASKS)

    def _get_task(self, task_id: str) -> _Req:
        if not isinstance(task_id, str) or not _ID_RE.match(task_id):
            raise NotFoundError(f"task {task_id!r} not found")
        return _Req("GET", self._u(f"/tasks/{task_id}"), None, _P_TASK)

    def _query_tasks(self, mode: Mode | None, limit: int | None) -> _Req:
        check_mode(mode)
        check_limit(limit)
        return _Req("POST", self._u("/tasks/query"), _to_json({"mode": mode, "limit": limit}), _P_TASKS)

    # ------------------------------------------------------------- rollouts
    def _enqueue(self, rollouts: Sequence[NewRollout], idempotency_key: str | None) -> _Req:
        items = coerce_many(NewRollout, rollouts, "rollout")
        if idempotency_key is not None and not isinstance(idempotency_key, str):
            raise InvalidInputError(f"idempotency_key must be a string, got {idempotency_key!r}")
        key = idempotency_key or uuid.uuid4().hex
        body = _to_json({"rollouts": items, "idempotency_key": key})
        return _Req("POST", self._u("/rollouts"), body, _P_ROLLOUTS)

    def _claim(self, worker_id: str, timeout_s: float, modes: Sequence[Mode] | None) -> _Req:
        if worker_id is not None and not isinstance(worker_id, str):
            raise InvalidInputError(f"worker_id must be a string, got {worker_id!r}")
        mode_list = check_modes(modes)
        body = _to_json({"worker_id": worker_id, "timeout_s": timeout_s, "modes": mode_list})
        read = None if timeout_s <= 0 else timeout_s + _POLL_MARGIN_S
        return _Req("POST", self._u("/claim"), body, _P_CLAIM, read_timeout=read)

    def _heartbeat(self, rollout_id: str, attempt: int) -> _Req:
        check_attempt_number(attempt)
        rid = _check_path_id(rollout_id, "rollout")
        return _Req("POST", self._u(f"/rollouts/{rid}/attempts/{attempt}/heartbeat"), b"", _P_ATTEMPT)

    def _finish(self, rollout_id: str, attempt: int, status: str, error: Any) -> _Req:
        check_finish_status(status)
        check_attempt_number(attempt)
        err = check_error(error)
        rid = _check_path_id(rollout_id, "rollout")

        def done_by_us(rollout: Rollout) -> Rollout | None:
            att = rollout.attempts[attempt - 1] if len(rollout.attempts) >= attempt else None
            return rollout if att is not None and att.status == status and att.error == err else None

        return _Req(
            "POST",
            self._u(f"/rollouts/{rid}/attempts/{attempt}/finish"),
            _to_json({"status": status, "error": err}),
            _P_ROLLOUT,
            uuid.uuid4().hex,
            reconcile=(self._get_rollout(rid), done_by_us),
        )

    def _cancel(self, rollout_id: str) -> _Req:
        rid = _check_path_id(rollout_id, "rollout")

        def done_by_us(rollout: Rollout) -> Rollout | None:
            return rollout if rollout.status == "cancelled" else None

        return _Req(
            "POST",
            self._u(f"/rollouts/{rid}/cancel"),
            b"",
            _P_ROLLOUT,
            uuid.uuid4().hex,
            reconcile=(self._get_rollout(rid), done_by_us),
        )

    def _get_rollout(self, rollout_id: str) -> _Req:
        rid = _check_path_id(rollout_id, "rollout")
        return _Req("GET", self._u(f"/rollouts/{rid}"), None, _P_ROLLOUT)

    def _query_rollouts(
        self,
        status: str | Sequence[str] | None,
        mode: Mode | None,
        group_id: str | None,
        ids: Sequence[str] | None,
        limit: int | None,
        offset: int | None = None,
    ) -> _Req:
        statuses = check_statuses(status)
        check_mode(mode)
        check_limit(limit)
        skip = check_offset(offset)
        if group_id is not None and not isinstance(group_id, str):
            raise InvalidInputError(f"group_id must be a string, got {group_id!r}")
        id_list = None if ids is None else check_ids(ids)
        query: dict[str, Any] = {
            "status": None if statuses is None else list(statuses),
            "mode": mode,
            "group_id": group_id,
            "ids": id_list,
            "limit": limit,
        }
        if skip:  # sent only when used, so a query without it works against an older server too
            query["offset"] = skip
        return _Req("POST", self._u("/rollouts/query"), _to_json(query), _P_ROLLOUTS)

    def _get_attempts(self, rollout_id: str) -> _Req:
        rid = _check_path_id(rollout_id, "rollout")
        return _Req("GET", self._u(f"/rollouts/{rid}/attempts"), None, _P_ATTEMPTS)

    def _wait(self, ids: list[str], timeout_s: float) -> _Req:
        read = None if timeout_s <= 0 else timeout_s + _POLL_MARGIN_S
        body = _to_json({"ids": ids, "timeout_s": timeout_s})
        return _Req("POST", self._u("/rollouts/wait"), body, _P_ROLLOUTS, read_timeout=read)

    # ---------------------------------------------------------------- spans
    def _add_spans(self, spans: Sequence[Span], idempotency_key: str | None) -> _Req:
        items = coerce_many(Span, spans, "span")
        if idempotency_key is not None and not isinstance(idempotency_key, str):
            raise InvalidInputError(f"idempotency_key must be a string, got {idempotency_key!r}")
        key = json.dumps(idempotency_key or uuid.uuid4().hex).encode()
        body = b'{"spans":' + dump_spans(items) + b',"idempotency_key":' + key + b"}"
        if idempotency_key is not None:
            # A caller's own key may be replayed with other spans: return exactly what the store kept.
            return _Req("POST", self._u("/spans"), body, _P_SPANS)

        def merge(raw: bytes) -> list[Span]:
            answer = _from_json(raw)
            seqs, stales = answer["seq"], answer["stale"]
            if len(seqs) != len(items) or len(stales) != len(items):
                raise StoreError(f"server stored {len(seqs)} spans of a batch of {len(items)}")
            out = []
            for s, q, st in zip(items, seqs, stales, strict=True):  # model_copy, minus its overhead
                d = s.__dict__.copy()
                d["seq"], d["stale"] = q, st
                out.append(_trusted(Span, _F_SPAN, d))
            return out

        return _Req("POST", self._u("/spans"), body, merge, prefer_minimal=True)

    def _query_spans(
        self,
        rollout_id: str | None,
        attempt: int | None,
        name: str | None,
        trace_id: str | None,
        include_stale: bool,
        limit: int | None,
    ) -> _Req:
        check_limit(limit)
        if attempt is not None:
            check_attempt_number(attempt)
        for what, value in (("rollout_id", rollout_id), ("name", name), ("trace_id", trace_id)):
            if value is not None and not isinstance(value, str):
                raise InvalidInputError(f"{what} must be a string, got {value!r}")
        body = _to_json(
            {
                "rollout_id": rollout_id,
                "attempt": attempt,
                "name": name,
                "trace_id": trace_id,
                "include_stale": bool(include_stale),
                "limit": limit,
            }
        )
        return _Req("POST", self._u("/spans/query"), body, _P_SPANS)

    # ------------------------------------------------------------ resources
    def _add_resources(self, items: dict[str, Resource | dict[str, Any]]) -> _Req:
        if not isinstance(items, dict):
            raise InvalidInputError(
                f"resources must be a dict of name -> resource, got {type(items).__name__}"
            )
        return _Req(
            "POST",
            self._u("/resources"),
            _to_json({"items": items}),
            _P_RESOURCE_SNAPSHOT,
            uuid.uuid4().hex,
        )

    def _get_resources(self, version: int | None) -> _Req:
        if version is None:
            return _Req("GET", self._u("/resources/latest"), None, _P_RESOURCES)
        if isinstance(version, bool) or not isinstance(version, int):
            raise InvalidInputError(f"resources version must be an integer, got {version!r}")
        if version < 0:
            raise NotFoundError(f"resources version {version} not found")
        return _Req("GET", self._u(f"/resources/{version}"), None, _P_RESOURCES)


def _poll_chunk(deadline: float) -> float:
    return max(0.0, min(MAX_POLL_S, deadline - time.monotonic()))


# ---------------------------------------------------------------------------------------------- sync


class HttpStore(_Requests):
    """The Store protocol over HTTP (blocking). Thread-safe: each thread keeps its own connection."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        retry_timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(
            url,
            token,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            retry_timeout_s=retry_timeout_s,
        )
        if transport is None:
            if self._scheme == "http":
                transport = _StdlibTransport(self._host, self._port)
            else:
                transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        self._transport = transport

    def _send(self, req: _Req) -> Any:
        self._check_open()
        attempt = 0
        give_up_at: float | None = None
        request = self._build(req)
        while True:
            failure: str
            try:
                response = self._transport.handle_request(request)
                try:
                    body = response.read()
                finally:
                    response.close()
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            else:
                status = response.status_code
                if status < 400:
                    return self._parse(req, body)
                if status not in _RETRY_STATUSES:
                    error = _error_from(status, body)
                    if attempt and req.reconcile is not None and isinstance(error, ConflictError):
                        lookup, check = req.reconcile
                        result = check(self._send(lookup))
                        if result is not None:
                            return result
                    raise error
                failure = f"server answered {status}"
            if self._closed:
                raise ConflictError("the store is closed")
            now = time.monotonic()
            if give_up_at is None:
                give_up_at = now + self.retry_timeout_s
            if now >= give_up_at:
                raise StoreUnavailableError(
                    f"store server {self.url} unreachable for {self.retry_timeout_s:.0f}s "
                    f"({attempt + 1} tries); last error: {failure}"
                )
            time.sleep(min(self._backoff(attempt), max(0.0, give_up_at - now)))
            attempt += 1
            self.retries += 1
            request = self._build(req)

    # ---------------------------------------------------------------- tasks
    def add_tasks(self, tasks: Sequence[Task]) -> list[Task]:
        return self._send(self._add_tasks(tasks))

    def get_task(self, task_id: str) -> Task:
        return self._send(self._get_task(task_id))

    def query_tasks(self, *, mode: Mode | None = None, limit: int | None = None) -> list[Task]:
        return self._send(self._query_tasks(mode, limit))

    # ------------------------------------------------------------- rollouts
    def enqueue(self, rollouts: Sequence[NewRollout], *, idempotency_key: str | None = None) -> list[Rollout]:
        return self._send(self._enqueue(rollouts, idempotency_key))

    def claim(
        self, worker_id: str, *, timeout_s: float = 0.0, modes: Sequence[Mode] | None = None
    ) -> Claim | None:
        deadline = time.monotonic() + check_timeout(timeout_s)
        while True:
            claim = self._send(self._claim(worker_id, _poll_chunk(deadline), modes))
            if claim is not None or time.monotonic() >= deadline:
                return claim

    def heartbeat(self, rollout_id: str, attempt: int) -> Attempt:
        return self._send(self._heartbeat(rollout_id, attempt))

    def finish_attempt(self, rollout_id: str, attempt: int, status: str, *, error: Any = None) -> Rollout:
        return self._send(self._finish(rollout_id, attempt, status, error))

    def cancel(self, rollout_id: str) -> Rollout:
        return self._send(self._cancel(rollout_id))

    def get_rollout(self, rollout_id: str) -> Rollout:
        return self._send(self._get_rollout(rollout_id))

    def query_rollouts(
        self,
        *,
        status: str | Sequence[str] | None = None,
        mode: Mode | None = None,
        group_id: str | None = None,
        ids: Sequence[str] | None = None,
        limit: int | None = None,
        offset: int | None = None,
    ) -> list[Rollout]:
        return self._send(self._query_rollouts(status, mode, group_id, ids, limit, offset))

    def get_attempts(self, rollout_id: str) -> list[Attempt]:
        return self._send(self._get_attempts(rollout_id))

    def wait_for_rollouts(self, ids: Sequence[str], *, timeout_s: float) -> list[Rollout]:
        deadline = time.monotonic() + check_timeout(timeout_s)
        id_list = check_ids(ids)
        wanted = len(set(id_list))
        while True:
            done = self._send(self._wait(id_list, _poll_chunk(deadline)))
            if len(done) >= wanted or time.monotonic() >= deadline:
                return done

    # ---------------------------------------------------------------- spans
    def add_spans(self, spans: Sequence[Span], *, idempotency_key: str | None = None) -> list[Span]:
        return self._send(self._add_spans(spans, idempotency_key))

    def query_spans(
        self,
        *,
        rollout_id: str | None = None,
        attempt: int | None = None,
        name: str | None = None,
        trace_id: str | None = None,
        include_stale: bool = True,
        limit: int | None = None,
    ) -> list[Span]:
        return self._send(self._query_spans(rollout_id, attempt, name, trace_id, include_stale, limit))

    # ------------------------------------------------------------ resources
    def add_resources(self, items: dict[str, Resource | dict[str, Any]]) -> Resources:
        return self._send(self._add_resources(items))

    def get_resources(self, version: int | None = None) -> Resources | None:
        return self._send(self._get_resources(version))

    # ----------------------------------------------------------- lifecycle
    def health(self) -> bool:
        """True when the server answers ``/health`` (no retries, no token needed)."""
        try:
            response = self._transport.handle_request(
                httpx.Request("GET", self._u("/health"), extensions={"timeout": self._timeouts(2.0)})
            )
            response.read()
            return response.status_code == 200
        except httpx.TransportError:
            return False

    def close(self) -> None:
        self._closed = True
        self._transport.close()

    def __enter__(self) -> HttpStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------- async


class AsyncHttpStore(_Requests):
    """The Store protocol over HTTP for asyncio code: the same methods, as coroutines."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        retry_timeout_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 100,
    ) -> None:
        super().__init__(
            url,
            token,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            retry_timeout_s=retry_timeout_s,
        )
        if transport is None:
            if self._scheme == "http":
                transport = _AsyncStdlibTransport(self._host, self._port, max_connections)
            else:
                transport = httpx.AsyncHTTPTransport(
                    limits=httpx.Limits(
                        max_connections=max_connections, max_keepalive_connections=max_connections
                    ),
                    socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
                    retries=1,
                )
        self._transport = transport

    async def _send(self, req: _Req) -> Any:
        self._check_open()
        attempt = 0
        give_up_at: float | None = None
        request = self._build(req)
        while True:
            failure: str
            try:
                response = await self._transport.handle_async_request(request)
                try:
                    body = await response.aread()
                finally:
                    await response.aclose()
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            else:
                status = response.status_code
                if status < 400:
                    return self._parse(req, body)
                if status not in _RETRY_STATUSES:
                    error = _error_from(status, body)
                    if attempt and req.reconcile is not None and isinstance(error, ConflictError):
                        lookup, check = req.reconcile
                        result = check(await self._send(lookup))
                        if result is not None:
                            return result
                    raise error
                failure = f"server answered {status}"
            if self._closed:
                raise ConflictError("the store is closed")
            now = time.monotonic()
            if give_up_at is None:
                give_up_at = now + self.retry_timeout_s
            if now >= give_up_at:
                raise StoreUnavailableError(
                    f"store server {self.url} unreachable for {self.retry_timeout_s:.0f}s "
                    f"({attempt + 1} tries); last error: {failure}"
                )
            await asyncio.sleep(min(self._backoff(attempt), max(0.0, give_up_at - now)))
            attempt += 1
            self.retries += 1
            request = self._build(req)

    # ---------------------------------------------------------------- tasks
    async def add_tasks(self, tasks: Sequence[Task]) -> list[Task]:
        return await self._send(self._add_tasks(tasks))

    async def get_task(self, task_id: str) -> Task:
        return await self._send(self._get_task(task_id))

    async def query_tasks(self, *, mode: Mode | None = None, limit: int | None = None) -> list[Task]:
        return await self._send(self._query_tasks(mode, limit))

    # ------------------------------------------------------------- rollouts
    async def enqueue(
        self, rollouts: Sequence[NewRollout], *, idempotency_key: str | None = None
    ) -> list[Rollout]:
        return await self._send(self._enqueue(rollouts, idempotency_key))

    async def claim(
        self, worker_id: str, *, timeout_s: float = 0.0, modes: Sequence[Mode] | None = None
    ) -> Claim | None:
        deadline = time.monotonic() + check_timeout(timeout_s)
        while True:
            claim = await self._send(self._claim(worker_id, _poll_chunk(deadline), modes))
            if claim is not None or time.monotonic() >= deadline:
                return claim

    async def heartbeat(self, rollout_id: str, attempt: int) -> Attempt:
        return await self._send(self._heartbeat(rollout_id, attempt))

    async def finish_attempt(
        self, rollout_id: str, attempt: int, status: str, *, error: Any = None
    ) -> Rollout:
        return await self._send(self._finish(rollout_id, attempt, status, error))

    async def cancel(self, rollout_id: str) -> Rollout:
        return await self._send(self._cancel(rollout_id))

    async def get_rollout(self, rollout_id: str) -> Rollout:
        return await self._send(self._get_rollout(rollout_id))

    async def query_rollouts(
        self,
        *,
        status: str | Sequence[str] | None = None,
        mode: Mode | None = None,
        group_id: str | None = None,
        ids: Sequence[str] | None = None,
        limit: int | None = None,
        offset: int | None = None,
    ) -> list[Rollout]:
        return await self._send(self._query_rollouts(status, mode, group_id, ids, limit, offset))

    async def get_attempts(self, rollout_id: str) -> list[Attempt]:
        return await self._send(self._get_attempts(rollout_id))

    async def wait_for_rollouts(self, ids: Sequence[str], *, timeout_s: float) -> list[Rollout]:
        deadline = time.monotonic() + check_timeout(timeout_s)
        id_list = check_ids(ids)
        wanted = len(set(id_list))
        while True:
            done = await self._send(self._wait(id_list, _poll_chunk(deadline)))
            if len(done) >= wanted or time.monotonic() >= deadline:
                return done

    # ---------------------------------------------------------------- spans
    async def add_spans(self, spans: Sequence[Span], *, idempotency_key: str | None = None) -> list[Span]:
        return await self._send(self._add_spans(spans, idempotency_key))

    async def query_spans(
        self,
        *,
        rollout_id: str | None = None,
        attempt: int | None = None,
        name: str | None = None,
        trace_id: str | None = None,
        include_stale: bool = True,
        limit: int | None = None,
    ) -> list[Span]:
        return await self._send(self._query_spans(rollout_id, attempt, name, trace_id, include_stale, limit))

    # ------------------------------------------------------------ resources
    async def add_resources(self, items: dict[str, Resource | dict[str, Any]]) -> Resources:
        return await self._send(self._add_resources(items))

    async def get_resources(self, version: int | None = None) -> Resources | None:
        return await self._send(self._get_resources(version))

    # ----------------------------------------------------------- lifecycle
    async def aclose(self) -> None:
        self._closed = True
        await self._transport.aclose()

    async def __aenter__(self) -> AsyncHttpStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
