"""Serving the gateway in this process, and the URL and bind rules every server and client shares.

- :class:`ServedGateway`: any ASGI app (the gateway's, or a test server's) under uvicorn in a daemon
  thread with its own event loop, so the caller can run coroutines on the loop that serves requests
  (the trainer's weight swaps go through :meth:`ServedGateway.call`);
- :func:`v1_url` / :func:`root_url`: the one place a gateway URL gains or loses its ``/v1`` suffix;
- :func:`rollout_base_url`: the per-rollout base URL the runners hand to agents;
- :data:`API_KEY_ENV` / :func:`check_public_bind`: a non-loopback bind needs an API key, the rule
  ``agl gateway serve``, the trainer's in-process gateway and the test helpers all follow.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from agl.errors import UsageError
from agl.http_limits import HttpLimits, is_loopback

__all__ = ["API_KEY_ENV", "ServedGateway", "check_public_bind", "rollout_base_url", "root_url", "v1_url"]

#: where ``agl gateway serve`` and the trainer read the gateway's API key when none is given
API_KEY_ENV = "AGL_GATEWAY_API_KEY"


def check_public_bind(host: str, api_key: str | None) -> None:
    """Refuse a non-loopback address without an API key (the store server's rule): anyone who can
    reach the gateway could use the model, read its status and swap its weights."""
    if not api_key and not is_loopback(host):
        raise UsageError(
            f"refusing to listen on {host!r} without an API key: anyone who can reach it could use the "
            f"model and swap its weights. Set {API_KEY_ENV} or pass --api-key-file, or bind 127.0.0.1"
        )


def root_url(url: str) -> str:
    """A gateway's root URL from its root or ``/v1`` URL (no trailing slash)."""
    root = str(url).rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def v1_url(url: str) -> str:
    """A gateway's OpenAI ``/v1`` base URL from its root or ``/v1`` URL."""
    return root_url(url) + "/v1"


def rollout_base_url(base_url: str, rollout_id: str, attempt: int) -> str:
    """The per-rollout OpenAI base URL ``{gateway}/rollouts/{rollout_id}/attempts/{n}/v1``, from the
    gateway's root or ``/v1`` URL: the gateway attributes every call made through it to that attempt."""
    return f"{root_url(base_url)}/rollouts/{rollout_id}/attempts/{int(attempt)}/v1"


class ServedGateway:
    """``app`` under uvicorn on ``host:port`` (0: a free port) in a daemon thread with its own event
    loop. ``root`` is ``http://host:port``, ``url`` its ``/v1`` URL; ``backend`` is the gateway's
    backend when ``app`` is a gateway app. Starting waits up to ``startup_timeout_s`` for the app's
    lifespan (the transformers backend loads its model there: minutes on a first prepare)."""

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        startup_timeout_s: float = 600.0,
        limits: HttpLimits | None = None,
    ) -> None:
        import uvicorn

        self.app = app
        gateway = getattr(getattr(app, "state", None), "gateway", None)
        self.backend: Any = getattr(gateway, "backend", None)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.root = f"http://{host}:{self._sock.getsockname()[1]}"
        self.url = self.root + "/v1"
        config = uvicorn.Config(
            app,
            log_level=log_level,
            lifespan="on",
            timeout_graceful_shutdown=1,
            http=(limits or HttpLimits()).protocol(),
        )
        self._server = uvicorn.Server(config)
        self.loop = asyncio.new_event_loop()
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name=f"agl-serve-{self.root}", daemon=True)
        self._thread.start()
        try:
            self._wait_started(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    @classmethod
    def for_backend(
        cls,
        backend: Any,
        store: Any = None,
        *,
        api_key: str | None = None,
        app_options: dict[str, Any] | None = None,
        **options: Any,
    ) -> ServedGateway:
        """The gateway app for ``backend`` (spans into ``store``), served; ``app_options`` are the
        gateway's own (:class:`agl.gateway.app.Gateway`'s keywords: model names, sampling), ``options``
        as above."""
        from agl.gateway.app import create_app

        return cls(create_app(backend, store, api_key=api_key, **(app_options or {})), **options)

    def _wait_started(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._error or not self._thread.is_alive():
                gateway = getattr(getattr(self.app, "state", None), "gateway", None)
                reason = getattr(gateway, "startup_error", None)
                if isinstance(reason, UsageError):
                    raise reason  # the user's mistake, said as it is
                reason = reason or (self._error[0] if self._error else "it exited")
                raise RuntimeError(f"the gateway failed to start: {reason}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway did not start within {timeout_s} s")
            time.sleep(0.01)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
            self._error.append(exc)

    def call(self, coro_fn: Callable[[], Coroutine[Any, Any, Any]], timeout_s: float = 600.0) -> Any:
        """Run ``coro_fn()`` on the serving loop (where the backend's state lives); returns its result."""
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout_s)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
        self._sock.close()

    def __enter__(self) -> ServedGateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
