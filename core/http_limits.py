"""Connection limits for agl's HTTP servers (store, gateway): a slow or greedy client cannot hold them.

uvicorn bounds the idle time between two requests of a kept-alive connection
(``timeout_keep_alive``), but not how long a client may take to send a request's headers or body, nor
how many connections one client may hold: 200 connections that had sent headers and half a body were
all still held after 85 s. :class:`HttpLimits` adds those bounds to uvicorn's httptools protocol
(``uvicorn.Config(app, http=HttpLimits().protocol())``):

- a request's headers must arrive within ``header_timeout_s`` of its first byte (for a connection's
  first request: of the connection's opening, so an idle new connection is closed too);
- its body within ``body_timeout_s`` of its headers;
- one client address holds at most ``max_connections_per_client`` connections at once. Loopback
  clients are exempt by default: every runner and agent on the server's own host shares 127.0.0.1.

A request that runs out of time is answered ``408`` (a JSON error body, ``connection: close``) and its
connection is closed; a handler waiting for that body sees the client disconnect. A connection over
the per-client cap has its first request answered ``429`` and is then closed.

The bounds are timers on the event loop (armed and cancelled by the HTTP parser's callbacks), so a
request costs no extra task or wrapper on its path.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
from dataclasses import dataclass
from typing import Any

from agl.errors import UsageError

__all__ = ["HttpLimits", "is_loopback"]


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _error_body(status: int, code: str, message: str) -> bytes:
    # both servers' error shapes in one: the store reads code/message, OpenAI clients all four
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return json.dumps({"error": error}).encode()


def _raw_response(status: int, reason: str, code: str, message: str) -> bytes:
    body = _error_body(status, code, message)
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


@dataclass(frozen=True)
class HttpLimits:
    """Bounds on how long a request may take to arrive and how many connections a client may hold
    (None: unbounded). See the module docstring."""

    header_timeout_s: float | None = 15.0
    body_timeout_s: float | None = 30.0
    max_connections_per_client: int | None = 256
    exempt_loopback: bool = True

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise UsageError(f"{name} must be a positive number of seconds or None, got {value!r}")
        cap = self.max_connections_per_client
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise UsageError(f"max_connections_per_client must be an integer >= 1 or None, got {cap!r}")

    @staticmethod
    def add_arguments(parser: Any) -> None:
        """The server command-line options for these limits (``agl store serve``, ``agl gateway serve``)."""
        d = HttpLimits()
        parser.add_argument(
            "--header-timeout",
            type=float,
            default=d.header_timeout_s,
            metavar="S",
            help=f"seconds a client has to send a request's headers; then 408 and close "
            f"(default: {d.header_timeout_s:g})",
        )
        parser.add_argument(
            "--body-timeout",
            type=float,
            default=d.body_timeout_s,
            metavar="S",
            help=f"seconds a client has to send a request's body after its headers; then 408 and close "
            f"(default: {d.body_timeout_s:g})",
        )
        parser.add_argument(
            "--max-connections-per-client",
            type=int,
            default=d.max_connections_per_client,
            metavar="N",
            help=f"connections one client address may hold at once; more get 429 (default: "
            f"{d.max_connections_per_client}; loopback clients are not counted)",
        )

    @classmethod
    def from_args(cls, args: Any) -> HttpLimits:
        return cls(
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            max_connections_per_client=args.max_connections_per_client,
        )

    def protocol(self) -> type[asyncio.Protocol]:
        """A uvicorn HTTP protocol class enforcing these limits (one per server: it counts that
        server's connections per client)."""
        return _limited_protocol(self)


def _limited_protocol(limits: HttpLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with :class:`_LimitsMixin` in front, bound to ``limits`` and to a
    connection count of its own (uvicorn is imported here, when a server starts)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    namespace = {"_agl_limits": limits, "_agl_open_by_host": {}}
    return type("LimitedHttpToolsProtocol", (_LimitsMixin, HttpToolsProtocol), namespace)


class _LimitsMixin:
    """The limits, as overrides of uvicorn's ``HttpToolsProtocol`` connection and parser callbacks. The
    class :func:`_limited_protocol` builds sets ``_agl_limits`` and ``_agl_open_by_host`` (that server's
    connections per client address); the protocol's own state (``client``, ``loop``, ``transport``,
    ``cycle``, ``app``) comes from uvicorn."""

    _agl_limits: HttpLimits
    _agl_open_by_host: dict[str, int]
    _agl_timer: asyncio.TimerHandle | None = None
    _agl_host: str | None = None  # the address this connection is counted against
    client: Any
    loop: Any
    transport: Any
    cycle: Any
    app: Any

    # ------------------------------------------------------------------ connection
    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        limits, counts = self._agl_limits, self._agl_open_by_host
        cap = limits.max_connections_per_client
        host = self.client[0] if self.client else None
        if cap is not None and host and not (limits.exempt_loopback and is_loopback(host)):
            if counts.get(host, 0) >= cap:
                self.app = self._agl_too_many_connections  # its first request gets the 429, then close
            else:
                counts[host] = counts.get(host, 0) + 1
                self._agl_host = host
        self._agl_arm(limits.header_timeout_s, self._agl_headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._agl_disarm()
        host, self._agl_host = self._agl_host, None
        if host is not None:
            left = self._agl_open_by_host.get(host, 1) - 1
            if left > 0:
                self._agl_open_by_host[host] = left
            else:
                self._agl_open_by_host.pop(host, None)
        super().connection_lost(exc)  # type: ignore[misc]

    async def _agl_too_many_connections(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI app of a connection over the per-client cap: 429 with ``retry-after``."""
        cap = self._agl_limits.max_connections_per_client
        body = _error_body(
            429,
            "too_many_connections",
            f"this client already holds {cap} connections to this server; reuse them (keep-alive)",
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            (b"retry-after", b"1"),
        ]
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    # ---------------------------------------------------------- parser callbacks
    def on_message_begin(self) -> None:  # the first byte of a request
        super().on_message_begin()  # type: ignore[misc]
        self._agl_arm(self._agl_limits.header_timeout_s, self._agl_headers_late)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()  # type: ignore[misc]
        self._agl_arm(self._agl_limits.body_timeout_s, self._agl_body_late)

    def on_message_complete(self) -> None:
        super().on_message_complete()  # type: ignore[misc]
        self._agl_disarm()

    # ---------------------------------------------------------------------- timers
    def _agl_arm(self, seconds: float | None, callback: Any) -> None:
        self._agl_disarm()
        if seconds is not None:
            self._agl_timer = self.loop.call_later(seconds, callback)

    def _agl_disarm(self) -> None:
        if self._agl_timer is not None:
            self._agl_timer.cancel()
            self._agl_timer = None

    def _agl_close(self, message: str) -> None:
        self._agl_timer = None
        if self.transport is None or self.transport.is_closing():
            return
        cycle = self.cycle
        answered = cycle is not None and cycle.response_started and not cycle.response_complete
        if not answered:
            self.transport.write(_raw_response(408, "Request Timeout", "request_timeout", message))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the handler's receive() answers http.disconnect
            cycle.message_event.set()
        self.transport.close()

    def _agl_headers_late(self) -> None:
        self._agl_close(f"the request headers did not arrive within {self._agl_limits.header_timeout_s:g} s")

    def _agl_body_late(self) -> None:
        self._agl_close(f"the request body did not arrive within {self._agl_limits.body_timeout_s:g} s")
