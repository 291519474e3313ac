"""HTTP client of ``agl store serve``: the Store protocol for runners and agents in other processes or hosts.

``HttpStore`` (sync) and ``AsyncHttpStore`` share one sans-IO core (``_Core``): every store call is
written once, as a generator that yields the requests to send (bytes, no I/O) and the backoff sleeps
of its retries; each client drives it with its own sockets and sleeps. What a caller can rely on:

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
  A server that shuts down answers its held claims at once with no claim; when the claim's next
  long-poll then finds it gone, the claim returns None rather than retrying (a runner told to stop
  with its store stops at once, and the caller's next claim meets the retry policy as usual).
- Answers are trusted: spans, rollouts and claims from the server (which validated them before storing)
  are rebuilt without running the models' validators again, several times cheaper than validating.

Plain ``http://`` requests go through a small HTTP/1.1 transport over sockets (one keep-alive
connection per thread; an asyncio pool for the async client): the core hands it each request as one
buffer and it parses the answer with one shared parser (``_Answer``), with no httpx request or response
objects on the way. It halves the client's CPU per store call against httpx's transport (figures in
bench/README.md). ``https://``, and a ``transport=`` passed in, use httpx.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, Concatenate, ParamSpec, TypeAlias, TypeVar
from urllib.parse import quote, urlsplit

import httpx
import pydantic_core

from agl.errors import StoreAuthError, StoreUnavailableError
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
from agl.store._transport import _AsyncStdlibTransport, _Req, _StdlibTransport
from agl.store._wire import (
    _F_SPAN,
    _P_ATTEMPT,
    _P_ATTEMPTS,
    _P_CLAIM,
    _P_RESOURCE_SNAPSHOT,
    _P_RESOURCES,
    _P_ROLLOUT,
    _P_ROLLOUTS,
    _P_SPANS,
    _P_TASK,
    _P_TASKS,
    _from_json,
    _trusted,
    dump_spans,
)
from agl.store.base import STORE_TOKEN_ENV, ConflictError, InvalidInputError, NotFoundError, StoreError
from agl.types import (
    _ID_RE,
    Attempt,
    Claim,
    Mode,
    NewRollout,
    Resource,
    Resources,
    Rollout,
    Span,
    Task,
)

__all__ = ["AsyncHttpStore", "HttpStore", "StoreAuthError", "StoreUnavailableError"]

TOKEN_ENV = STORE_TOKEN_ENV
#: Longest single long-poll request; the server caps its own hold at 30 s as well.
MAX_POLL_S = 30.0
_POLL_MARGIN_S = 15.0
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 2.0
_RETRY_STATUSES = frozenset({502, 503, 504})
#: ``_Core._call``'s default: a request that finds the server gone is retried
_RETRY: Any = object()
_GONE: Any = object()


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


def _check_key(key: Any, header: bool = False) -> str | None:
    """A caller's idempotency key; one sent in a header must be printable ASCII (no CR/LF)."""
    if key is None:
        return None
    if not isinstance(key, str):
        raise InvalidInputError(f"idempotency_key must be a string, got {key!r}")
    if header and key and not (key.isascii() and key.isprintable()):
        raise InvalidInputError(f"idempotency_key must be printable ASCII, got {key!r}")
    return key


R = TypeVar("R")
P = ParamSpec("P")
#: A store call without I/O: yields a ``_Req`` to send (answered with ``(status, body)`` or a string
#: naming the transport failure) or a float of seconds to sleep (answered with None); returns the result.
_Op: TypeAlias = Generator["_Req | float", Any, R]


# ---------------------------------------------------------------------------------------------- core


def _poll_chunk(deadline: float) -> float:
    return max(0.0, min(MAX_POLL_S, deadline - time.monotonic()))


class _Core:
    """Everything but I/O, for both clients: argument checks (as the stores do them), request bytes,
    parsers, the retry policy, and each store call as an ``_Op`` generator that ``HttpStore`` and
    ``AsyncHttpStore`` drive with their own sockets and sleeps (so each call is written once)."""

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
        self._prefix = quote(parts.path.rstrip("/"), safe="/%:@!$&'()*+,;=-._~").encode()
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.retry_timeout_s = float(retry_timeout_s)
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        headers = {"content-type": "application/json", "accept": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._headers = headers
        netloc = parts.netloc.rpartition("@")[2]
        self._head = b"".join(
            b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in {"host": netloc, **headers}.items()
        )
        self._closed = False
        #: requests re-sent after a connection error or 502/503/504 (for monitoring and tests)
        self.retries = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _wire(self, req: _Req) -> bytes:
        """The whole request as one buffer: one send, one wake-up of the server."""
        body = req.body or b""
        extra = b""
        if req.idempotency_key is not None:
            extra = b"idempotency-key: " + req.idempotency_key.encode() + b"\r\n"
        if req.prefer_minimal:
            extra += b"prefer: return=minimal\r\n"
        return b"%s %s%s HTTP/1.1\r\n%s%scontent-length: %d\r\n\r\n%s" % (
            req.method.encode(),
            self._prefix,
            req.path.encode(),
            self._head,
            extra,
            len(body),
            body,
        )

    def _timeouts(self, read: float | None) -> dict[str, float | None]:
        r = self.timeout_s if read is None else read
        return {"connect": self.connect_timeout_s, "read": r, "write": r, "pool": self.connect_timeout_s}

    def _build(self, req: _Req) -> httpx.Request:
        """The request for an httpx transport (https, or one passed in)."""
        headers = self._headers
        if req.idempotency_key is not None or req.prefer_minimal:
            headers = dict(headers)
            if req.idempotency_key is not None:
                headers["idempotency-key"] = req.idempotency_key
            if req.prefer_minimal:
                headers["prefer"] = "return=minimal"
        return httpx.Request(
            req.method,
            self.url + req.path,
            content=req.body,
            headers=headers,
            extensions={"timeout": self._timeouts(req.read_timeout)},
        )

    def _parse(self, req: _Req, body: bytes) -> Any:
        try:
            return req.parse(body)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StoreError(
                f"unexpected answer from {self.url} to {req.method} {req.path}: {exc!r} in {body[:200]!r}"
            ) from None

    def _check_open(self) -> None:
        if self._closed:
            raise ConflictError("the store is closed")

    @staticmethod
    def _backoff(attempt: int) -> float:
        return min(_BACKOFF_MAX_S, _BACKOFF_MIN_S * 2**attempt) * (0.5 + random.random() / 2)

    def _call(self, req: _Req, *, if_gone: Any = _RETRY) -> _Op[Any]:
        """One request under the retry policy: connection errors and 502/503/504 are re-sent with
        capped exponential backoff for up to ``retry_timeout_s``; a retried write that meets
        ConflictError asks the server whether its own earlier try did it (``reconcile``). With
        ``if_gone`` given, such a failure returns it at once instead (no retry)."""
        attempt = 0
        give_up_at: float | None = None
        while True:
            outcome = yield req
            if isinstance(outcome, tuple):
                status, body = outcome
                if status < 400:
                    return self._parse(req, body)
                if status not in _RETRY_STATUSES:
                    error = _error_from(status, body)
                    if attempt and req.reconcile is not None and isinstance(error, ConflictError):
                        lookup, check = req.reconcile
                        result = check((yield from self._call(lookup())))
                        if result is not None:
                            return result
                    raise error
                failure = f"server answered {status}"
            else:
                failure = outcome
            if if_gone is not _RETRY:
                return if_gone
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
            yield min(self._backoff(attempt), max(0.0, give_up_at - now))
            attempt += 1
            self.retries += 1

    # ---------------------------------------------------------------- tasks
    def _add_tasks(self, tasks: Sequence[Task]) -> _Op[list[Task]]:
        items = coerce_many(Task, tasks, "task")
        return (yield from self._call(_Req("POST", "/tasks", _to_json({"tasks": items}), _P_TASKS)))

    def _get_task(self, task_id: str) -> _Op[Task]:
        if not isinstance(task_id, str) or not _ID_RE.match(task_id):
            raise NotFoundError(f"task {task_id!r} not found")
        return (yield from self._call(_Req("GET", f"/tasks/{task_id}", None, _P_TASK)))

    def _query_tasks(self, *, mode: Mode | None = None, limit: int | None = None) -> _Op[list[Task]]:
        check_mode(mode)
        check_limit(limit)
        body = _to_json({"mode": mode, "limit": limit})
        return (yield from self._call(_Req("POST", "/tasks/query", body, _P_TASKS)))

    # ------------------------------------------------------------- rollouts
    def _enqueue(
        self, rollouts: Sequence[NewRollout], *, idempotency_key: str | None = None
    ) -> _Op[list[Rollout]]:
        items = coerce_many(NewRollout, rollouts, "rollout")
        key = _check_key(idempotency_key) or uuid.uuid4().hex
        body = _to_json({"rollouts": items, "idempotency_key": key})
        return (yield from self._call(_Req("POST", "/rollouts", body, _P_ROLLOUTS)))

    def _claim(
        self, worker_id: str, *, timeout_s: float = 0.0, modes: Sequence[Mode] | None = None
    ) -> _Op[Claim | None]:
        """Waits longer than the server's cap are consecutive long-polls, never a polling interval."""
        deadline = time.monotonic() + check_timeout(timeout_s)
        if worker_id is not None and not isinstance(worker_id, str):
            raise InvalidInputError(f"worker_id must be a string, got {worker_id!r}")
        mode_list = check_modes(modes)
        gone: Any = _RETRY  # after the first answer: a server gone since is shutting down, no claim
        while True:
            wait = _poll_chunk(deadline)
            body = _to_json({"worker_id": worker_id, "timeout_s": wait, "modes": mode_list})
            read = None if wait <= 0 else wait + _POLL_MARGIN_S
            req = _Req("POST", "/claim", body, _P_CLAIM, read_timeout=read)
            claim = yield from self._call(req, if_gone=gone)
            if claim is _GONE:
                return None
            if claim is not None or time.monotonic() >= deadline:
                return claim  # type: ignore[no-any-return]
            gone = _GONE

    def _heartbeat(self, rollout_id: str, attempt: int) -> _Op[Attempt]:
        check_attempt_number(attempt)
        rid = _check_path_id(rollout_id, "rollout")
        path = f"/rollouts/{rid}/attempts/{attempt}/heartbeat"
        return (yield from self._call(_Req("POST", path, b"", _P_ATTEMPT)))

    def _finish_attempt(
        self, rollout_id: str, attempt: int, status: str, *, error: Any = None
    ) -> _Op[Rollout]:
        check_finish_status(status)
        check_attempt_number(attempt)
        err = check_error(error)
        rid = _check_path_id(rollout_id, "rollout")

        def done_by_us(rollout: Rollout) -> Rollout | None:
            att = rollout.attempts[attempt - 1] if len(rollout.attempts) >= attempt else None
            return rollout if att is not None and att.status == status and att.error == err else None

        return (
            yield from self._call(
                _Req(
                    "POST",
                    f"/rollouts/{rid}/attempts/{attempt}/finish",
                    _to_json({"status": status, "error": err}),
                    _P_ROLLOUT,
                    uuid.uuid4().hex,
                    reconcile=(lambda: self._rollout_req(rid), done_by_us),
                )
            )
        )

    def _cancel(self, rollout_id: str) -> _Op[Rollout]:
        rid = _check_path_id(rollout_id, "rollout")

        def done_by_us(rollout: Rollout) -> Rollout | None:
            return rollout if rollout.status == "cancelled" else None

        req = _Req(
            "POST",
            f"/rollouts/{rid}/cancel",
            b"",
            _P_ROLLOUT,
            uuid.uuid4().hex,
            reconcile=(lambda: self._rollout_req(rid), done_by_us),
        )
        return (yield from self._call(req))

    def _rollout_req(self, rid: str) -> _Req:
        return _Req("GET", f"/rollouts/{rid}", None, _P_ROLLOUT)

    def _get_rollout(self, rollout_id: str) -> _Op[Rollout]:
        return (yield from self._call(self._rollout_req(_check_path_id(rollout_id, "rollout"))))

    def _query_rollouts(
        self,
        *,
        status: str | Sequence[str] | None = None,
        mode: Mode | None = None,
        group_id: str | None = None,
        ids: Sequence[str] | None = None,
        limit: int | None = None,
        offset: int | None = None,
    ) -> _Op[list[Rollout]]:
        statuses = check_statuses(status)
        check_mode(mode)
        check_limit(limit)
        skip = check_offset(offset)
        if group_id is not None and not isinstance(group_id, str):
            raise InvalidInputError(f"group_id must be a string, got {group_id!r}")
        query: dict[str, Any] = {
            "status": None if statuses is None else list(statuses),
            "mode": mode,
            "group_id": group_id,
            "ids": None if ids is None else check_ids(ids),
            "limit": limit,
        }
        if skip:  # sent only when used, so a query without it works against an older server too
            query["offset"] = skip
        return (yield from self._call(_Req("POST", "/rollouts/query", _to_json(query), _P_ROLLOUTS)))

    def _get_attempts(self, rollout_id: str) -> _Op[list[Attempt]]:
        rid = _check_path_id(rollout_id, "rollout")
        return (yield from self._call(_Req("GET", f"/rollouts/{rid}/attempts", None, _P_ATTEMPTS)))

    def _wait_for_rollouts(self, ids: Sequence[str], *, timeout_s: float) -> _Op[list[Rollout]]:
        deadline = time.monotonic() + check_timeout(timeout_s)
        id_list = check_ids(ids)
        wanted = len(set(id_list))
        while True:
            wait = _poll_chunk(deadline)
            read = None if wait <= 0 else wait + _POLL_MARGIN_S
            body = _to_json({"ids": id_list, "timeout_s": wait})
            done = yield from self._call(_Req("POST", "/rollouts/wait", body, _P_ROLLOUTS, read_timeout=read))
            if len(done) >= wanted or time.monotonic() >= deadline:
                return done  # type: ignore[no-any-return]

    # ---------------------------------------------------------------- spans
    def _add_spans(self, spans: Sequence[Span], *, idempotency_key: str | None = None) -> _Op[list[Span]]:
        items = coerce_many(Span, spans, "span")
        key = json.dumps(_check_key(idempotency_key) or uuid.uuid4().hex).encode()
        body = b'{"spans":' + dump_spans(items) + b',"idempotency_key":' + key + b"}"
        if idempotency_key is not None:
            # A caller's own key may be replayed with other spans: return exactly what the store kept.
            return (yield from self._call(_Req("POST", "/spans", body, _P_SPANS)))

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

        return (yield from self._call(_Req("POST", "/spans", body, merge, prefer_minimal=True)))

    def _query_spans(
        self,
        *,
        rollout_id: str | None = None,
        attempt: int | None = None,
        name: str | None = None,
        trace_id: str | None = None,
        include_stale: bool = True,
        limit: int | None = None,
    ) -> _Op[list[Span]]:
        check_limit(limit)
        if attempt is not None:
            check_attempt_number(attempt)
        for what, value in (("rollout_id", rollout_id), ("name", name), ("trace_id", trace_id)):
            if value is not None and not isinstance(value, str):
                raise InvalidInputError(f"{what} must be a string, got {value!r}")
        query = {
            "rollout_id": rollout_id,
            "attempt": attempt,
            "name": name,
            "trace_id": trace_id,
            "include_stale": bool(include_stale),
            "limit": limit,
        }
        return (yield from self._call(_Req("POST", "/spans/query", _to_json(query), _P_SPANS)))

    # ------------------------------------------------------------ resources
    def _add_resources(
        self, items: dict[str, Resource | dict[str, Any]], *, idempotency_key: str | None = None
    ) -> _Op[Resources]:
        key = _check_key(idempotency_key, header=True) or uuid.uuid4().hex
        if not isinstance(items, dict):
            raise InvalidInputError(
                f"resources must be a dict of name -> resource, got {type(items).__name__}"
            )
        req = _Req("POST", "/resources", _to_json({"items": items}), _P_RESOURCE_SNAPSHOT, key)
        return (yield from self._call(req))

    def _get_resources(self, version: int | None = None) -> _Op[Resources | None]:
        if version is None:
            return (yield from self._call(_Req("GET", "/resources/latest", None, _P_RESOURCES)))
        if isinstance(version, bool) or not isinstance(version, int):
            raise InvalidInputError(f"resources version must be an integer, got {version!r}")
        if version < 0:
            raise NotFoundError(f"resources version {version} not found")
        return (yield from self._call(_Req("GET", f"/resources/{version}", None, _P_RESOURCES)))


def _named(method: Any, op: Callable[..., Any]) -> Any:
    """Name, docstring and signature (for ``help()`` and ``inspect``) of ``op``, under its public name
    and with the result its ``_Op`` yields as the return annotation."""
    functools.update_wrapper(method, op)
    del method.__wrapped__  # the signature below is the one to show, not the generator's
    method.__name__ = op.__name__.lstrip("_")
    method.__qualname__ = method.__name__
    sig = inspect.signature(op)
    ret = sig.return_annotation
    if isinstance(ret, str) and ret.startswith("_Op[") and ret.endswith("]"):
        sig = sig.replace(return_annotation=ret[4:-1])
    method.__signature__ = sig
    return method


def _sync(op: Callable[Concatenate[_Core, P], _Op[R]]) -> Callable[Concatenate[HttpStore, P], R]:
    """The blocking store method for one ``_Core`` operation."""

    def method(self: HttpStore, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._run(op(self, *args, **kwargs))

    return _named(method, op)


def _async(
    op: Callable[Concatenate[_Core, P], _Op[R]],
) -> Callable[Concatenate[AsyncHttpStore, P], Awaitable[R]]:
    """The coroutine store method for one ``_Core`` operation."""

    async def method(self: AsyncHttpStore, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self._run(op(self, *args, **kwargs))

    return _named(method, op)


# ---------------------------------------------------------------------------------------------- sync


class HttpStore(_Core):
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
        self._raw: _StdlibTransport | None = None
        if transport is None:
            if self._scheme == "http":
                transport = self._raw = _StdlibTransport(self._host, self._port)
            else:
                transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        self._transport = transport

    def _send(self, req: _Req) -> tuple[int, bytes] | str:
        try:
            if self._transport is self._raw:
                r = self.timeout_s if req.read_timeout is None else req.read_timeout
                a = self._raw.exchange(self._wire(req), req.method, self.connect_timeout_s, r)
                return a.status, a.body
            response = self._transport.handle_request(self._build(req))
            try:
                return response.status_code, response.read()
            finally:
                response.close()
        except httpx.TransportError as exc:
            return f"{type(exc).__name__}: {exc}"

    def _run(self, op: _Op[R]) -> R:
        self._check_open()
        value: Any = None
        while True:
            try:
                step = op.send(value)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if isinstance(step, float):
                time.sleep(step)
                value = None
            else:
                value = self._send(step)

    add_tasks = _sync(_Core._add_tasks)
    get_task = _sync(_Core._get_task)
    query_tasks = _sync(_Core._query_tasks)
    enqueue = _sync(_Core._enqueue)
    claim = _sync(_Core._claim)
    heartbeat = _sync(_Core._heartbeat)
    finish_attempt = _sync(_Core._finish_attempt)
    cancel = _sync(_Core._cancel)
    get_rollout = _sync(_Core._get_rollout)
    query_rollouts = _sync(_Core._query_rollouts)
    get_attempts = _sync(_Core._get_attempts)
    wait_for_rollouts = _sync(_Core._wait_for_rollouts)
    add_spans = _sync(_Core._add_spans)
    query_spans = _sync(_Core._query_spans)
    add_resources = _sync(_Core._add_resources)
    get_resources = _sync(_Core._get_resources)

    def health(self) -> bool:
        """True when the server answers ``/health`` (no retries, no token needed)."""
        req = _Req("GET", "/health", None, bytes, read_timeout=2.0)
        outcome = self._send(req)
        return isinstance(outcome, tuple) and outcome[0] == 200

    def close(self) -> None:
        self._closed = True
        self._transport.close()

    def __enter__(self) -> HttpStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------- async


class AsyncHttpStore(_Core):
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
        self._raw: _AsyncStdlibTransport | None = None
        if transport is None:
            if self._scheme == "http":
                transport = self._raw = _AsyncStdlibTransport(self._host, self._port, max_connections)
            else:
                transport = httpx.AsyncHTTPTransport(
                    limits=httpx.Limits(
                        max_connections=max_connections, max_keepalive_connections=max_connections
                    ),
                    socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
                    retries=1,
                )
        self._transport = transport

    async def _send(self, req: _Req) -> tuple[int, bytes] | str:
        try:
            if self._transport is self._raw:
                r = self.timeout_s if req.read_timeout is None else req.read_timeout
                a = await self._raw.exchange(self._wire(req), req.method, self.connect_timeout_s, r)
                return a.status, a.body
            response = await self._transport.handle_async_request(self._build(req))
            try:
                return response.status_code, await response.aread()
            finally:
                await response.aclose()
        except httpx.TransportError as exc:
            return f"{type(exc).__name__}: {exc}"

    async def _run(self, op: _Op[R]) -> R:
        self._check_open()
        value: Any = None
        while True:
            try:
                step = op.send(value)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if isinstance(step, float):
                await asyncio.sleep(step)
                value = None
            else:
                value = await self._send(step)

    add_tasks = _async(_Core._add_tasks)
    get_task = _async(_Core._get_task)
    query_tasks = _async(_Core._query_tasks)
    enqueue = _async(_Core._enqueue)
    claim = _async(_Core._claim)
    heartbeat = _async(_Core._heartbeat)
    finish_attempt = _async(_Core._finish_attempt)
    cancel = _async(_Core._cancel)
    get_rollout = _async(_Core._get_rollout)
    query_rollouts = _async(_Core._query_rollouts)
    get_attempts = _async(_Core._get_attempts)
    wait_for_rollouts = _async(_Core._wait_for_rollouts)
    add_spans = _async(_Core._add_spans)
    query_spans = _async(_Core._query_spans)
    add_resources = _async(_Core._add_resources)
    get_resources = _async(_Core._get_resources)

    async def aclose(self) -> None:
        self._closed = True
        await self._transport.aclose()

    async def __aenter__(self) -> AsyncHttpStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
