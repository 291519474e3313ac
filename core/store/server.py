"""The store server (``agl store serve``): the whole Store protocol over HTTP/JSON, plus OTLP/HTTP.

Runners on other hosts, agents in other processes or languages, and any OpenTelemetry exporter meet
the trainer here. Design choices, and why:

- Bodies are the pydantic models of ``agl.types`` (validated with ``model_validate_json``, written with
  ``dump_json``): one schema, parsed and checked in one pass in pydantic-core.
- Short store calls run inline on the event loop: they are microseconds of work on a thread-safe store,
  and a thread hop would cost more than the call. (So a database that other processes write to as
  well can stall the loop while SQLite waits for their lock: let the server own its database.) Blocking calls (``claim`` and ``wait_for_rollouts``
  with a timeout) first try without waiting inline, then wait in a worker thread (own limiter, so many
  long-polling runners never starve other requests) in slices, checking between slices whether the
  client is still there.
- Every bad request is answered 4xx with ``{"error": {"code", "message"}}`` naming the problem, before
  the store is touched (or the store refuses it without changing state); never a 500 for bad input.
- Writes carry an ``Idempotency-Key``. Enqueue and span batches pass it to the store (durable with
  SQLite); other writes are de-duplicated here, in memory, so a client retry after a lost answer is
  applied once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import math
import os
import socket
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import anyio
import anyio.to_thread
import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from agl.dashboard.mount import UI_PREFIX, LazyUI, is_public_ui_path
from agl.store._common import describe_validation_error
from agl.store._wire import dump_spans
from agl.store.base import InvalidInputError, Store, StoreError
from agl.types import AttemptError, Claim, Mode, NewRollout, Rollout, Span, Task

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "LONG_POLL_CAP_S",
    "ServerProcess",
    "StoreServer",
    "create_app",
    "is_loopback",
    "serve",
    "serve_in_thread",
]

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
#: Longest a single claim/wait request is held; clients split longer waits into several requests.
LONG_POLL_CAP_S = 30.0
#: How often a held request checks that its client is still connected.
_POLL_SLICE_S = 1.0
_IDEM_CACHE = 10_000

_JSON = "application/json"
_MAX_INT = 2**63 - 1


# ------------------------------------------------------------------------------------ wire envelopes


class _Body(BaseModel):
    # built on first use, not at import: the server answers /health sooner after start
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


class _TasksIn(_Body):
    tasks: list[Task]


class _TaskQuery(_Body):
    mode: Mode | None = None
    limit: int | None = Field(default=None, ge=0, le=_MAX_INT)


class _EnqueueIn(_Body):
    rollouts: list[NewRollout]
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256)


class _ClaimIn(_Body):
    worker_id: str | None = None
    timeout_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    modes: list[Mode] | None = None


class _FinishIn(_Body):
    status: str
    error: AttemptError | None = None


class _RolloutQuery(_Body):
    status: str | list[str] | None = None
    mode: Mode | None = None
    group_id: str | None = None
    ids: list[str] | None = None
    limit: int | None = Field(default=None, ge=0, le=_MAX_INT)
    offset: int | None = Field(default=None, ge=0, le=_MAX_INT)


class _WaitIn(_Body):
    ids: list[str]
    timeout_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class _SpansIn(_Body):
    spans: list[Span]
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256)


class _SpanQuery(_Body):
    rollout_id: str | None = None
    attempt: int | None = Field(default=None, ge=1, le=_MAX_INT)
    name: str | None = None
    trace_id: str | None = None
    include_stale: bool = True
    limit: int | None = Field(default=None, ge=0, le=_MAX_INT)


class _ResourcesIn(_Body):
    items: dict[str, Any]


#: Lists and optionals of agl.types models are written by the models' own serializers (as fast as a
#: TypeAdapter, without building one at import: start-up time is part of the contract).
_dump = pydantic_core.to_json


# ------------------------------------------------------------------------------------------- errors


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    return Response(body, status_code=status, media_type=_JSON, headers=headers)


class _BodyTooLarge(Exception):
    pass


_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "no_route",
    405: "method_not_allowed",
    413: "body_too_large",
    422: "idempotency_key_reused",
    415: "unsupported_media_type",
}


async def _on_store_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StoreError)
    return _error(exc.status, exc.code, str(exc))


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ValidationError)
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return _error(400, "invalid_json", f"request body is not valid JSON: {errors[0].get('msg', '')}")
    return _error(400, "invalid_input", f"invalid request body: {describe_validation_error(exc)}")


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    message = exc.detail
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow", "")
        message = f"method {request.method} not allowed on {request.url.path} (allowed: {allow})"
    return _error(exc.status_code, code, message, headers=exc.headers)


async def _on_overflow(request: Request, exc: Exception) -> Response:
    # A store backed by SQLite refuses integers beyond 64 bits this way; it is the caller's number.
    return _error(400, "invalid_input", f"a number in the request is out of range (64-bit integers): {exc}")


async def _on_too_large(request: Request, exc: Exception) -> Response:
    return _error(413, "body_too_large", str(exc))


async def _on_disconnect(request: Request, exc: Exception) -> Response:
    return _error(400, "client_disconnected", "the client went away while sending the body")


# -------------------------------------------------------------------------------------------- guard


class _Guard:
    """Pure-ASGI outer layer: bearer-token check on every route but ``/health``.

    Runs before routing, so an unauthenticated caller learns nothing about routes; the comparison is
    constant-time (``hmac.compare_digest``).
    """

    def __init__(self, app: Any, token: str | None) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            self._expected is not None
            and scope["type"] == "http"
            and scope["path"] != "/health"
            and not is_public_ui_path(scope["path"])  # the dashboard page; its /ui/api/ is guarded
        ):
            got = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    got = value
                    break
            if not hmac.compare_digest(got, self._expected):
                message = "missing bearer token" if not got else "invalid bearer token"
                response = _error(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ------------------------------------------------------------------------------------------- server


class StoreServer:
    """The request handlers over one store."""

    def __init__(
        self,
        store: Store,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        long_poll_cap_s: float = LONG_POLL_CAP_S,
    ) -> None:
        self.store = store
        self.max_body_bytes = max_body_bytes
        self.long_poll_cap_s = long_poll_cap_s
        #: Idempotency-Key -> (request fingerprint, status, body) of its first answer
        self._idem: OrderedDict[str, tuple[str, int, bytes]] = OrderedDict()
        self._inflight: dict[str, tuple[str, asyncio.Future[tuple[int, bytes]]]] = {}
        self._closing = False
        #: requests held right now (claim / wait long-polls), for tests and monitoring
        self.active_polls = 0
        self._poll_limiter: anyio.CapacityLimiter | None = None
        #: the dashboard under /ui (built on its first request)
        self.ui = LazyUI(store)

    # ------------------------------------------------------------ plumbing
    def _store(self, request: Request) -> Store:
        return self.store

    async def _body(self, request: Request) -> bytes:
        cached = request.scope.get("agl.body")
        if cached is not None:
            return cached  # type: ignore[no-any-return]
        body = await self._read_body(request)
        request.scope["agl.body"] = body
        return body

    async def _read_body(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise InvalidInputError(f"Content-Length {declared!r} is not a number") from None
            if size > limit:
                raise _BodyTooLarge(f"request body of {size} bytes is over the limit of {limit} bytes")
        # Straight from ASGI receive (Starlette's stream() adds an async generator per request);
        # counted as it arrives, so a chunked body without Content-Length is limited too.
        chunks: list[bytes] = []
        total = 0
        receive = request.receive
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                raise _BodyTooLarge(f"request body is over the limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _json_body(self, request: Request, model: type[_Body]) -> Any:
        body = await self._body(request)
        if not body.strip():
            raise InvalidInputError("empty request body; expected a JSON object")
        return model.model_validate_json(body)

    def _idem_key(self, request: Request, body_key: str | None = None) -> str | None:
        key = body_key or request.headers.get("idempotency-key")
        if key is not None and not 0 < len(key) <= 256:
            raise InvalidInputError("Idempotency-Key must be 1-256 characters")
        return key

    async def _deduplicated(
        self, request: Request, scope: str, run: Callable[[], Awaitable[Response]]
    ) -> Response:
        """Apply a write once per Idempotency-Key; a retry gets the first answer (or waits for it).

        A key reused for a different request (other path or body) is refused with 422, as the IETF
        Idempotency-Key draft asks, rather than answered with another request's result.
        """
        key = self._idem_key(request)
        if key is None:
            return await run()
        body = await self._body(request)
        fingerprint = f"{request.url.path}\x00{hashlib.sha256(body).hexdigest()}"
        full = f"{request.path_params.get('ns', '')}\x00{scope}\x00{key}"
        cached = self._idem.get(full)
        if cached is None and full in self._inflight:
            cached = (self._inflight[full][0], *await asyncio.shield(self._inflight[full][1]))
        if cached is not None:
            if cached[0] != fingerprint:
                return _error(
                    422, "idempotency_key_reused", f"Idempotency-Key {key!r} was used for another request"
                )
            return Response(cached[2], status_code=cached[1], media_type=_JSON)
        fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self._inflight[full] = (fingerprint, fut)
        try:
            try:
                response = await run()
            except StoreError as exc:
                response = _error(exc.status, exc.code, str(exc))
            result = (response.status_code, bytes(response.body))
            if response.status_code < 500:
                self._idem[full] = (fingerprint, *result)
                if len(self._idem) > _IDEM_CACHE:
                    self._idem.popitem(last=False)
            fut.set_result(result)
            return response
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved
            raise
        finally:
            del self._inflight[full]

    async def _long_poll(
        self,
        request: Request,
        call: Callable[[float], Any],
        timeout_s: float,
        done: Callable[[Any], bool],
        orphaned: Callable[[Any], None] | None = None,
    ) -> Any:
        """Run ``call(0)`` inline; if not ``done``, hold the request until done or timeout.

        The wait runs in a worker thread in slices of ``_POLL_SLICE_S`` while a task watches the
        connection; once the client is gone no new slice starts. A result that arrives for a client
        that already left is handed to ``orphaned`` (a claim is given back rather than left to expire).
        """
        result = call(0.0)
        if done(result) or timeout_s <= 0:
            return result
        deadline = time.monotonic() + min(timeout_s, self.long_poll_cap_s)
        if self._poll_limiter is None:
            self._poll_limiter = anyio.CapacityLimiter(1024)
        gone = asyncio.Event()

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        self.active_polls += 1
        try:
            while not done(result) and not self._closing and not gone.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                result = await anyio.to_thread.run_sync(
                    call, min(remaining, _POLL_SLICE_S), limiter=self._poll_limiter
                )
            if done(result) and orphaned is not None:
                for _ in range(3):  # let a disconnect the loop already saw reach the watcher
                    await asyncio.sleep(0)
                if gone.is_set():
                    orphaned(result)
        finally:
            self.active_polls -= 1
            watcher.cancel()
        return result

    @staticmethod
    def _ok(body: bytes) -> Response:
        return Response(body, media_type=_JSON)

    # -------------------------------------------------------------- routes
    async def health(self, request: Request) -> Response:
        return self._ok(b'{"status":"ok"}')

    async def add_tasks(self, request: Request) -> Response:
        req = await self._json_body(request, _TasksIn)
        tasks = self._store(request).add_tasks(req.tasks)
        return self._ok(b'{"tasks":' + _dump(tasks) + b"}")

    async def query_tasks(self, request: Request) -> Response:
        req = await self._json_body(request, _TaskQuery)
        tasks = self._store(request).query_tasks(mode=req.mode, limit=req.limit)
        return self._ok(b'{"tasks":' + _dump(tasks) + b"}")

    async def get_task(self, request: Request) -> Response:
        task = self._store(request).get_task(request.path_params["task_id"])
        return self._ok(task.model_dump_json().encode())

    async def enqueue(self, request: Request) -> Response:
        req = await self._json_body(request, _EnqueueIn)
        key = self._idem_key(request, req.idempotency_key)
        rollouts = self._store(request).enqueue(req.rollouts, idempotency_key=key)
        return self._ok(b'{"rollouts":' + _dump(rollouts) + b"}")

    async def claim(self, request: Request) -> Response:
        req = await self._json_body(request, _ClaimIn)
        store = self._store(request)
        modes = req.modes

        def call(timeout_s: float) -> Claim | None:
            return store.claim(req.worker_id, timeout_s=timeout_s, modes=modes)  # type: ignore[arg-type]

        def give_back(claim: Claim) -> None:
            # Nobody will run it: end the attempt now so the rollout is requeued (or fails when out of
            # attempts) at once, instead of after its lease expires.
            with contextlib.suppress(StoreError):
                store.finish_attempt(
                    claim.rollout.id,
                    claim.attempt.number,
                    "failed",
                    error=AttemptError(
                        type="client_disconnected",
                        message=f"worker {req.worker_id!r} disconnected before the claim reached it",
                    ),
                )

        claim = await self._long_poll(request, call, req.timeout_s, lambda c: c is not None, give_back)
        return self._ok(b'{"claim":' + _dump(claim) + b"}")

    async def heartbeat(self, request: Request) -> Response:
        p = request.path_params
        attempt = self._store(request).heartbeat(p["rollout_id"], p["attempt"])
        return self._ok(attempt.model_dump_json().encode())

    async def finish(self, request: Request) -> Response:
        async def run() -> Response:
            req = await self._json_body(request, _FinishIn)
            p = request.path_params
            rollout = self._store(request).finish_attempt(
                p["rollout_id"], p["attempt"], req.status, error=req.error
            )
            return self._ok(rollout.model_dump_json().encode())

        return await self._deduplicated(request, "finish", run)

    async def cancel(self, request: Request) -> Response:
        async def run() -> Response:
            rollout = self._store(request).cancel(request.path_params["rollout_id"])
            return self._ok(rollout.model_dump_json().encode())

        return await self._deduplicated(request, "cancel", run)

    async def get_rollout(self, request: Request) -> Response:
        rollout = self._store(request).get_rollout(request.path_params["rollout_id"])
        return self._ok(rollout.model_dump_json().encode())

    async def get_attempts(self, request: Request) -> Response:
        attempts = self._store(request).get_attempts(request.path_params["rollout_id"])
        return self._ok(b'{"attempts":' + _dump(attempts) + b"}")

    async def query_rollouts(self, request: Request) -> Response:
        q = await self._json_body(request, _RolloutQuery)
        rollouts = self._store(request).query_rollouts(
            status=q.status, mode=q.mode, group_id=q.group_id, ids=q.ids, limit=q.limit, offset=q.offset
        )
        return self._ok(b'{"rollouts":' + _dump(rollouts) + b"}")

    async def wait(self, request: Request) -> Response:
        req = await self._json_body(request, _WaitIn)
        store = self._store(request)
        wanted = len(set(req.ids))

        def call(timeout_s: float) -> list[Rollout]:
            return store.wait_for_rollouts(req.ids, timeout_s=timeout_s)

        rollouts = await self._long_poll(request, call, req.timeout_s, lambda rs: len(rs) >= wanted)
        return self._ok(b'{"rollouts":' + _dump(rollouts) + b"}")

    async def add_spans(self, request: Request) -> Response:
        req = await self._json_body(request, _SpansIn)
        key = self._idem_key(request, req.idempotency_key)
        spans = self._store(request).add_spans(req.spans, idempotency_key=key)
        if "return=minimal" in request.headers.get("prefer", ""):
            # RFC 7240: the client already holds the spans; send back only what the store assigned.
            body = json.dumps({"seq": [s.seq for s in spans], "stale": [s.stale for s in spans]})
            return self._ok(body.encode())
        return self._ok(b'{"spans":' + dump_spans(spans) + b"}")

    async def query_spans(self, request: Request) -> Response:
        q = await self._json_body(request, _SpanQuery)
        spans = self._store(request).query_spans(
            rollout_id=q.rollout_id,
            attempt=q.attempt,
            name=q.name,
            trace_id=q.trace_id,
            include_stale=q.include_stale,
            limit=q.limit,
        )
        return self._ok(b'{"spans":' + dump_spans(spans) + b"}")

    async def add_resources(self, request: Request) -> Response:
        async def run() -> Response:
            req = await self._json_body(request, _ResourcesIn)
            res = self._store(request).add_resources(req.items)
            return self._ok(res.model_dump_json().encode())

        return await self._deduplicated(request, "resources", run)

    async def get_resources(self, request: Request) -> Response:
        raw = request.path_params.get("version")
        version = None if raw is None else int(raw)
        res = self._store(request).get_resources(version)
        return self._ok(b'{"resources":' + _dump(res) + b"}")

    async def otlp_traces(self, request: Request) -> Response:
        from agl.store import otlp

        body = await self._body(request)
        answer = otlp.ingest(
            self._store(request),
            body,
            content_type=request.headers.get("content-type", ""),
            content_encoding=request.headers.get("content-encoding", ""),
            max_bytes=self.max_body_bytes,
        )
        return Response(answer.body, status_code=answer.status, media_type=answer.media_type)

    # ------------------------------------------------------------ routing
    def routes(self) -> list[Any]:
        table: list[tuple[str, Callable[[Request], Awaitable[Response]], Sequence[str]]] = [
            # the hot paths of a runner first: Starlette tries routes in order
            ("/claim", self.claim, ["POST"]),
            ("/spans", self.add_spans, ["POST"]),
            ("/rollouts/{rollout_id}/attempts/{attempt:int}/finish", self.finish, ["POST"]),
            ("/rollouts/{rollout_id}/attempts/{attempt:int}/heartbeat", self.heartbeat, ["POST"]),
            ("/v1/traces", self.otlp_traces, ["POST"]),
            ("/rollouts", self.enqueue, ["POST"]),
            ("/rollouts/wait", self.wait, ["POST"]),
            ("/spans/query", self.query_spans, ["POST"]),
            ("/rollouts/query", self.query_rollouts, ["POST"]),
            ("/rollouts/{rollout_id}", self.get_rollout, ["GET"]),
            ("/rollouts/{rollout_id}/attempts", self.get_attempts, ["GET"]),
            ("/rollouts/{rollout_id}/cancel", self.cancel, ["POST"]),
            ("/resources/latest", self.get_resources, ["GET"]),
            ("/resources/{version:int}", self.get_resources, ["GET"]),
            ("/resources", self.add_resources, ["POST"]),
            ("/tasks", self.add_tasks, ["POST"]),
            ("/tasks/query", self.query_tasks, ["POST"]),
            ("/tasks/{task_id}", self.get_task, ["GET"]),
        ]
        routes: list[Any] = [Route("/health", self.health, methods=["GET"])]
        routes += [Route(path, fn, methods=list(methods)) for path, fn, methods in table]
        routes.append(Mount(UI_PREFIX, app=self.ui))
        return routes

    def close(self) -> None:
        self._closing = True
        self.ui.close()


def create_app(
    store: Store,
    *,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    long_poll_cap_s: float = LONG_POLL_CAP_S,
    close_store: bool = True,
) -> Any:
    """The ASGI app serving ``store`` (test-only routes live in ``agl.testing.store_server``)."""
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    if not math.isfinite(long_poll_cap_s) or long_poll_cap_s <= 0:
        raise ValueError(f"long_poll_cap_s must be a positive number, got {long_poll_cap_s}")
    server = StoreServer(
        store,
        max_body_bytes=max_body_bytes,
        long_poll_cap_s=long_poll_cap_s,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        try:
            yield
        finally:
            server.close()
            if close_store:
                store.close()

    app = Starlette(
        routes=server.routes(),
        exception_handlers={
            StoreError: _on_store_error,
            ValidationError: _on_validation_error,
            HTTPException: _on_http_exception,
            _BodyTooLarge: _on_too_large,
            OverflowError: _on_overflow,
            ClientDisconnect: _on_disconnect,
        },
        lifespan=lifespan,
    )
    app.state.server = server
    guarded = _Guard(app, token)
    guarded.server = server  # type: ignore[attr-defined]
    return guarded


# ----------------------------------------------------------------------------------------- running


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class ServerProcess:
    """``agl store serve`` in a child process: for tests, benchmarks and crash drills.

    ``start()`` returns once the server prints its ready line (with the real port when ``port=0``);
    ``kill()`` sends SIGKILL, as a crash would; ``start()`` again restarts it on the same database.
    """

    def __init__(
        self,
        db: str | os.PathLike[str] | None = None,
        *,
        store_url: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        env: dict[str, str] | None = None,
        args: Sequence[str] = (),
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        if (db is None) == (store_url is None):
            raise ValueError("give exactly one of db= or store_url=")
        self.db = db
        self.store_url = store_url
        self.host = host
        self.port = port
        self.token = token
        self.env = env or {}
        self.args = list(args)
        self.log_path = log_path
        self.url: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        where = ["--db", os.fspath(self.db)] if self.db is not None else ["--store", str(self.store_url)]
        port = self.port
        if self.url is not None and port == 0:
            port = int(self.url.rsplit(":", 1)[1])  # a restart keeps the address clients know
        cmd = [
            sys.executable,
            "-m",
            "agl.cli",
            "store",
            "serve",
            *where,
            "--host",
            self.host,
            "--port",
            str(port),
        ]
        return cmd + self.args

    def start(self, timeout_s: float = 30.0) -> str:
        import selectors

        env = {**os.environ, **self.env}
        if self.token is not None:
            env["AGL_STORE_TOKEN"] = self.token
        log = open(self.log_path, "ab") if self.log_path is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=log, env=env)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # type: ignore[union-attr]
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(remaining):
                self.kill()
                raise TimeoutError(f"store server did not start within {timeout_s}s: {self.command()}")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                code = self.proc.wait()
                raise RuntimeError(f"store server exited with {code} before it was ready: {self.command()}")
            line += chunk
        sel.close()
        self.url = line.decode().split()[-1]
        return self.url

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, exactly like a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """One plain request (stdlib client) with the token, for test plumbing."""
        import http.client
        from urllib.parse import urlsplit

        assert self.url is not None, "start() first"
        parts = urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname or self.host, parts.port, timeout=30)
        headers = {"content-type": "application/json"}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serve_in_thread(
    store: Store | Any,
    *,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    long_poll_cap_s: float = LONG_POLL_CAP_S,
    close_store: bool = False,
) -> Iterator[str]:
    """Serve ``store`` (or an app from ``create_app``) with uvicorn in a background thread on a free
    127.0.0.1 port; yields the URL. For tests and notebooks."""
    import threading

    import uvicorn

    if isinstance(store, _Guard):  # an app from create_app(): serve it as it is
        app: Any = store
    else:
        app = create_app(
            store,
            token=token,
            max_body_bytes=max_body_bytes,
            long_poll_cap_s=long_poll_cap_s,
            close_store=close_store,
        )
    sock = _bind("127.0.0.1", 0)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="agl-store-server"
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("store server thread failed to start")
        time.sleep(0.005)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def serve(
    store: Store,
    *,
    host: str = "127.0.0.1",
    port: int = 4747,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ready_message: str = "agl store: serving",
    log_level: str = "warning",
    wrap: Callable[[Any], Any] | None = None,
) -> None:
    """Serve ``store`` until SIGINT/SIGTERM; prints ``<ready_message> http://host:port`` once listening.

    Refuses a non-loopback address without a token: the store holds prompts, rewards and model endpoints.
    """
    if not token and not is_loopback(host):
        raise ValueError(
            f"refusing to listen on non-loopback address {host!r} without a token: "
            "pass --token or set AGL_STORE_TOKEN"
        )
    import uvicorn

    app = create_app(store, token=token, max_body_bytes=max_body_bytes)
    if wrap is not None:  # agl.testing.store_server adds its test-only routes this way
        app = wrap(app)
    sock = _bind(host, port)
    bound_port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{bound_port}"

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(f"{ready_message} {url}", flush=True)

    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=2,
        timeout_keep_alive=60,  # runners idle between rollouts keep their connection
        lifespan="on",
        server_header=False,
    )
    server = _Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
