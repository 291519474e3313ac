"""Run a real gateway in a background thread: for tests, examples and the framework integrations.

    from agl.gateway.testing import serve_gateway, ScriptedBackend, reply, tool_call

    backend = ScriptedBackend([reply(None, tool_call("add", a=1, b=2)), reply("3")])
    with serve_gateway(backend, store) as base_url:          # "http://127.0.0.1:PORT/v1"
        client = openai.OpenAI(base_url=base_url, api_key="x")
        client.chat.completions.create(model="scripted", messages=[...])
        base_url.for_rollout("ro-1", 1)                       # ".../rollouts/ro-1/attempts/1/v1"
        base_url.gateway.stats                                # calls, unattributed_calls, ...

It is a real uvicorn server on 127.0.0.1 with a free port, not an in-process shortcut, so clients
exercise their real HTTP stack.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agl.gateway.app import Gateway, create_app
from agl.gateway.backends.base import Backend
from agl.gateway.backends.scripted import Reply, ScriptedBackend, ScriptedToolCall, reply, tool_call
from agl.gateway.cli import check_public_bind
from agl.http_limits import HttpLimits

__all__ = [
    "GatewayURL",
    "Reply",
    "ScriptedBackend",
    "ScriptedToolCall",
    "reply",
    "rollout_base_url",
    "serve_asgi",
    "serve_gateway",
    "tool_call",
]


def rollout_base_url(base_url: str, rollout_id: str, attempt: int) -> str:
    """The per-rollout OpenAI base URL: ``{gateway}/rollouts/{rollout_id}/attempts/{n}/v1``.

    ``base_url`` may be the gateway root or its ``/v1`` URL.
    """
    root = str(base_url).rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return f"{root}/rollouts/{rollout_id}/attempts/{int(attempt)}/v1"


class GatewayURL(str):
    """The gateway's ``/v1`` base URL (a ``str``), plus the running :class:`Gateway` and helpers."""

    gateway: Gateway
    root: str

    def for_rollout(self, rollout_id: str, attempt: int = 1) -> str:
        return rollout_base_url(self.root, rollout_id, attempt)


@contextmanager
def serve_asgi(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    startup_timeout_s: float = 30.0,
    limits: HttpLimits | None = None,
) -> Iterator[str]:
    """Run any ASGI app with uvicorn in a daemon thread; yields its root URL (``http://host:port``).
    ``limits``: read timeouts and the per-client connection cap (default :class:`HttpLimits`)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=1,
        http=(limits or HttpLimits()).protocol(),
    )
    server = uvicorn.Server(config)
    errors: list[BaseException] = []
    started = threading.Event()

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors.append(exc)
        finally:
            started.set()

    thread = threading.Thread(target=run, name=f"agl-asgi-{bound_port}", daemon=True)
    thread.start()
    try:
        waited = 0.0
        while not server.started:
            if errors or not thread.is_alive():
                raise RuntimeError(f"the server failed to start: {errors[0] if errors else 'it exited'}")
            if waited > startup_timeout_s:
                raise TimeoutError(f"the server did not start within {startup_timeout_s} s")
            started.wait(0.01)
            waited += 0.01
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextmanager
def serve_gateway(
    backend: Backend,
    store: Any = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    limits: HttpLimits | None = None,
    **gateway_kwargs: Any,
) -> Iterator[GatewayURL]:
    """Serve ``backend`` (spans into ``store``) on ``host``; yields the ``/v1`` base URL.

    Like ``agl gateway serve``, refuses a non-loopback ``host`` without an ``api_key``.
    """
    check_public_bind(host, gateway_kwargs.get("api_key"))
    app = create_app(backend, store, **gateway_kwargs)
    with serve_asgi(app, host=host, port=port, log_level=log_level, limits=limits) as root:
        url = GatewayURL(root + "/v1")
        url.gateway = app.state.gateway
        url.root = root
        yield url
