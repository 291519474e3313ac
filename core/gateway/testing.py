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

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agl.gateway.app import Gateway, create_app
from agl.gateway.backends.base import Backend
from agl.gateway.backends.scripted import Reply, ScriptedBackend, ScriptedToolCall, reply, tool_call
from agl.gateway.serve import ServedGateway, check_public_bind, rollout_base_url
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
    startup_timeout_s: float = 600.0,
    limits: HttpLimits | None = None,
) -> Iterator[str]:
    """Run any ASGI app with uvicorn in a daemon thread; yields its root URL (``http://host:port``).
    ``limits``: read timeouts and the per-client connection cap (default :class:`HttpLimits`).
    ``startup_timeout_s`` is :class:`ServedGateway`'s: a transformers backend loads its model in the
    app's startup, and the first load on a machine (or for a new user) prepares SmolLM2 from its GGUF,
    which took over 30 s on a loaded 2-core box."""
    served = ServedGateway(
        app, host=host, port=port, log_level=log_level, startup_timeout_s=startup_timeout_s, limits=limits
    )
    try:
        yield served.root
    finally:
        served.close()


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
