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
- Writes carry an ``Idempotency-Key``. Enqueue, span batches and resources pass it to the store
  (durable with SQLite and PostgreSQL); other writes are de-duplicated here, in memory, so a client
  retry after a lost answer is applied once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import anyio
import anyio.to_thread
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from agl.errors import UsageError
from agl.http_limits import HttpLimits, is_loopback
from agl.store._process import ServerProcess
from agl.store._serverkit import (
    _JSON,
    _Body,
    _BodyTooLarge,
    _ClaimIn,
    _dump,
    _EnqueueIn,
    _error,
    _FinishIn,
    _Guard,
    _on_disconnect,
    _on_http_exception,
    _on_overflow,
    _on_store_error,
    _on_too_large,
    _on_validation_error,
    _ResourcesIn,
    _RolloutQuery,
    _SpanQuery,
    _SpansIn,
    _TaskQuery,
    _TasksIn,
    _WaitIn,
    _Waker,
)
from agl.store._wire import dump_spans
from agl.store.base import STORE_TOKEN_ENV, InvalidInputError, Store, StoreError
from agl.types import AttemptError, Claim, Rollout

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
#: How long a shutting-down server lets the requests in flight finish (held long-polls end at once).
GRACEFUL_SHUTDOWN_S = 2.0
#: How often a held request checks that its client is still connected.
_POLL_SLICE_S = 1.0
_IDEM_CACHE = 10_000


# ------------------------------------------------------------------------------------------- server


class StoreServer:
    """The request handlers over one store, plus any extra ASGI apps mounted beside them.

    ``mounts`` maps a path prefix (``"/ui"``) to an ASGI app served under it, after the store's routes
    and behind the same token guard. An app may say which of its paths need no token
    (``is_public(path_within_the_mount) -> bool``) and may have a ``close()``, called when the server
    closes. ``agl store serve`` mounts the dashboard this way (``agl.dashboard.mount.ui_mounts``); the
    store layer itself knows nothing of it.
    """

    def __init__(
        self,
        store: Store,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        long_poll_cap_s: float = LONG_POLL_CAP_S,
        mounts: Mapping[str, Any] | None = None,
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
        self._wakers: dict[int, _Waker] = {}
        #: extra ASGI apps by path prefix (e.g. the dashboard under /ui)
        self.mounts = _check_mounts(mounts)

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
        # strict: {"limit": "10"} or {"attempt": true} is the client's bug, refused naming the field
        return model.model_validate_json(body, strict=True)

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
            if response.status_code < 400:  # a refused request does not consume its key
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
        empty_key: Any = None,
    ) -> Any:
        """Run ``call(0)`` inline; if not ``done``, hold the request until done or timeout.

        The wait runs in a worker thread in slices of ``_POLL_SLICE_S`` while a task watches the
        connection; once the client is gone no new slice starts. A result that arrives for a client
        that already left is handed to ``orphaned`` (a claim is given back rather than left to expire).
        """
        result = call(0.0)
        if done(result) or timeout_s <= 0 or self._closing:
            return result
        deadline = time.monotonic() + min(timeout_s, self.long_poll_cap_s)
        store = self._store(request)
        if getattr(store, "changes", None) is not None and hasattr(store, "poke"):
            return await self._wait_async(request, store, call, deadline, done, orphaned, result, empty_key)
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

    def _waker(self, store: Any) -> _Waker:
        waker = self._wakers.get(id(store))
        if waker is None or waker.store is not store:
            waker = _Waker(store, asyncio.get_running_loop())
            self._wakers[id(store)] = waker
        return waker

    async def _wait_async(
        self,
        request: Request,
        store: Any,
        call: Callable[[float], Any],
        deadline: float,
        done: Callable[[Any], bool],
        orphaned: Callable[[Any], None] | None,
        result: Any,
        empty_key: Any,
    ) -> Any:
        """Hold the request on the event loop, no thread: re-try ``call(0)`` after each change the
        store announces (``store.changes``) until done, the deadline, or the client leaves."""

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        waker = self._waker(store)
        watcher = asyncio.ensure_future(watch())
        self.active_polls += 1
        waker.enter()
        try:
            while not self._closing and not watcher.done():
                changed = waker.changed  # taken before the re-check: no change slips between them
                generation = waker.generation
                if empty_key is None or waker.empty.get(empty_key) != generation:
                    result = call(0.0)
                    if done(result):
                        break
                    if empty_key is not None:
                        waker.empty[empty_key] = generation
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                await asyncio.wait((changed, watcher), timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if done(result) and orphaned is not None:
                for _ in range(3):  # let a disconnect the loop already saw reach the watcher
                    await asyncio.sleep(0)
                if watcher.done():
                    orphaned(result)
        finally:
            waker.leave()
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

        claim = await self._long_poll(
            request, call, req.timeout_s, lambda c: c is not None, give_back, ("claim", tuple(modes or ()))
        )
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
            # the key goes to the store too: it keeps it with the version, so a retry after a restart of
            # this server (which forgets its in-memory answers) still publishes one version
            key = self._idem_key(request)
            res = self._store(request).add_resources(req.items, idempotency_key=key)
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
        routes += [Mount(prefix, app=app) for prefix, app in self.mounts.items()]
        return routes

    def is_public(self, path: str) -> bool:
        """Whether ``path`` falls in a mount that serves it without a token."""
        for prefix, app in self.mounts.items():
            if path == prefix or path.startswith(prefix + "/"):
                public = getattr(app, "is_public", None)
                return public is not None and bool(public(path[len(prefix) :]))
        return False

    def begin_shutdown(self) -> None:
        """Hold no request any longer: every waiting long-poll answers now with what it has (an empty
        claim; the rollouts finished so far) and later ones answer at once, while every other request
        (a write in flight) runs to its end. Called when the server starts shutting down, before it
        waits for its connections: a held claim would otherwise outlast the graceful timeout and be
        cancelled, a traceback in the log and a 500 to its runner."""
        self._closing = True
        for waker in self._wakers.values():
            waker.wake()

    def close(self) -> None:
        self.begin_shutdown()
        for waker in self._wakers.values():
            waker.close()
        self._wakers.clear()
        for app in self.mounts.values():
            close = getattr(app, "close", None)
            if callable(close):
                close()


def _check_mounts(mounts: Mapping[str, Any] | None) -> dict[str, Any]:
    """The mounts as a dict, each prefix a path like ``/ui`` (a leading ``/``, no trailing one)."""
    if mounts is None:
        return {}
    if not isinstance(mounts, Mapping):
        raise ValueError(f"mounts must map a path prefix to an ASGI app, got {type(mounts).__name__}")
    for prefix, app in mounts.items():
        if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.endswith("/"):
            raise ValueError(f"a mount prefix must look like '/ui' (no trailing slash), got {prefix!r}")
        if not callable(app):
            raise ValueError(f"the app mounted at {prefix} is not an ASGI callable: {app!r}")
    return dict(mounts)


def create_app(
    store: Store,
    *,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    long_poll_cap_s: float = LONG_POLL_CAP_S,
    close_store: bool = True,
    mounts: Mapping[str, Any] | None = None,
) -> Any:
    """The ASGI app serving ``store`` (test-only routes live in ``agl.testing.store_server``);
    ``mounts``: extra ASGI apps by path prefix (see :class:`StoreServer`)."""
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    if not math.isfinite(long_poll_cap_s) or long_poll_cap_s <= 0:
        raise ValueError(f"long_poll_cap_s must be a positive number, got {long_poll_cap_s}")
    server = StoreServer(
        store,
        max_body_bytes=max_body_bytes,
        long_poll_cap_s=long_poll_cap_s,
        mounts=mounts,
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
    guarded = _Guard(app, token, server.is_public)
    guarded.server = server  # type: ignore[attr-defined]
    return guarded


# ----------------------------------------------------------------------------------------- running


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(config: Any, store_server: StoreServer, *, ready: str | None = None) -> Any:
    """uvicorn's server, shutting down as a store should: on SIGINT/SIGTERM it stops accepting, ends
    the held long-polls at once (:meth:`StoreServer.begin_shutdown`), lets the requests in flight
    finish within ``GRACEFUL_SHUTDOWN_S``, and returns, so ``agl store serve`` exits 0 (uvicorn would
    re-raise the signal after a clean shutdown, and the process would read as killed by it).
    ``ready``: a line printed once listening (``agl store serve``'s ready line, which clients wait for)."""
    import signal
    import threading

    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and ready is not None:
                print(ready, flush=True)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            store_server.begin_shutdown()  # before uvicorn waits for the connections to close
            await super().shutdown(sockets=sockets)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield  # signals reach the main thread only (serve_in_thread)
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return _Server(config)


@contextlib.contextmanager
def serve_in_thread(
    store: Store | Any,
    *,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    long_poll_cap_s: float = LONG_POLL_CAP_S,
    close_store: bool = False,
    limits: HttpLimits | None = None,
    mounts: Mapping[str, Any] | None = None,
) -> Iterator[str]:
    """Serve ``store`` (or an app from ``create_app``) with uvicorn in a background thread on a free
    127.0.0.1 port; yields the URL. For tests and notebooks. ``limits``: read timeouts and the
    per-client connection cap (default :class:`~agl.http_limits.HttpLimits`)."""
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
            mounts=mounts,
        )
    sock = _bind("127.0.0.1", 0)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        http=(limits or HttpLimits()).protocol(),
    )
    server = _uvicorn_server(config, app.server)
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
    limits: HttpLimits | None = None,
    mounts: Mapping[str, Any] | None = None,
) -> None:
    """Serve ``store`` until SIGINT/SIGTERM; prints ``<ready_message> http://host:port`` once listening.

    Refuses a non-loopback address without a token: the store holds prompts, rewards and model endpoints.
    ``limits``: header/body read timeouts and the per-client connection cap (default
    :class:`~agl.http_limits.HttpLimits`). ``mounts``: extra ASGI apps by path prefix (``agl store
    serve`` mounts the dashboard at ``/ui``).
    """
    if not token and not is_loopback(host):
        raise UsageError(
            f"refusing to listen on non-loopback address {host!r} without a token: "
            f"set {STORE_TOKEN_ENV} or pass --token-file"
        )
    import uvicorn

    app = create_app(store, token=token, max_body_bytes=max_body_bytes, mounts=mounts)
    store_server = app.server
    if wrap is not None:  # agl.testing.store_server adds its test-only routes this way
        app = wrap(app)
    sock = _bind(host, port)
    bound_port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{bound_port}"

    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=60,  # runners idle between rollouts keep their connection
        lifespan="on",
        server_header=False,
        http=(limits or HttpLimits()).protocol(),  # slow or greedy clients cannot hold the server
    )
    server = _uvicorn_server(config, store_server, ready=f"{ready_message} {url}")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
