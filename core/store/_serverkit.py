"""The store server's plumbing: request bodies, error answers, the token guard and the long-poll waker.

``agl.store.server`` builds its routes on these; kept apart so each file does one job. The design of
each piece is in its docstring; the server's own docstring gives the whole picture.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import Callable
from typing import Any

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from agl.store._common import describe_validation_error
from agl.store.base import StoreError
from agl.types import AttemptError, Mode, NewRollout, Span, Task

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
    """Pure-ASGI outer layer: bearer-token check on every route but ``/health`` and the paths a mount
    declares public (``public(path)``; e.g. the dashboard page, whose ``/ui/api/`` stays guarded).

    Runs before routing, so an unauthenticated caller learns nothing about routes; the comparison is
    constant-time (``hmac.compare_digest``).
    """

    def __init__(
        self, app: Any, token: str | None, public: Callable[[str], bool] = lambda path: False
    ) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode() if token else None
        self._public = public

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            self._expected is not None
            and scope["type"] == "http"
            and scope["path"] != "/health"
            and not self._public(scope["path"])
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


# ------------------------------------------------------------------------------------------- waking


class _Waker:
    """Turns one store's change feed into an awaitable for the server's waiting long-polls.

    ``changed`` is a future shared by every waiter, resolved (and replaced) on each change the store
    announces from any thread (for PostgreSQL: a NOTIFY from any server). While anyone waits, one pump
    task calls ``store.poke()`` when a lease may run out (the only change no write announces; for
    SQLite also to notice other processes' writes) and sleeps otherwise: thousands of waiting requests
    cost a future each, not a thread each.
    """

    def __init__(self, store: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.store = store
        self.loop = loop
        self.changed: asyncio.Future[None] = loop.create_future()
        #: bumped on every change; ``empty[key]`` is the generation at which a claim with that mode filter
        #: found nothing, so the other waiting claimers skip their (equally futile) try
        self.generation = 0
        self.empty: dict[Any, int] = {}
        self._lease = asyncio.Event()
        self._waiting = 0
        self._pump: asyncio.Task[None] | None = None
        self._unsubscribe = store.changes.subscribe(self._on_change)

    def _on_change(self, topic: str) -> None:  # any thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self.loop.call_soon_threadsafe(self._fire, topic)

    def _fire(self, topic: str) -> None:
        if topic == "lease":
            self._lease.set()
            return
        if not self.changed.done():
            self.changed.set_result(None)
        self.changed = self.loop.create_future()
        self.generation += 1

    def enter(self) -> None:
        self._waiting += 1
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._run_pump())

    def leave(self) -> None:
        self._waiting -= 1
        if self._waiting == 0:
            self._lease.set()  # let the pump see it is no longer needed

    async def _run_pump(self) -> None:
        while self._waiting > 0:
            self._lease.clear()
            try:
                delay = self.store.poke()
            except StoreError:
                return  # closed
            except Exception:  # noqa: BLE001 - e.g. the database is briefly unreachable: try again soon
                delay = 1.0
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._lease.wait(), timeout=min(delay, 3600.0) + 0.001)

    def wake(self) -> None:
        """Wake every waiter now, as a change would (the server is shutting down: each re-checks, sees
        the server closing and answers with what it has)."""
        self._fire("wake")

    def close(self) -> None:
        self._unsubscribe()
        if self._pump is not None:
            self._pump.cancel()
        if not self.changed.done():
            self.changed.set_result(None)
