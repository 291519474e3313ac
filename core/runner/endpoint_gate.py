"""Runners stop claiming while the agents' LLM endpoint is down, and go on when it answers again.

Why: a gateway served inside the trainer (``Serving(gateway_bind=...)``, reached by runners on other
hosts) is gone while the trainer restarts after a crash. Without this gate every runner would go on
claiming queued rollouts, each would fail at its first LLM call within milliseconds, and the queue
would burn through its ``max_attempts`` in seconds: rollouts failed for good, groups lost. With it, only
the attempts already in flight when the endpoint went away fail (one attempt each; the store requeues
them while attempts remain); the next claim waits until a TCP connection to the endpoint succeeds, or
until the store's latest resources name another endpoint (a trainer restarted on a new port: waiting
for the old one would be forever).
A runner started with ``until_idle`` (drain the queue, then exit) is not held: it fails fast as before,
so a wrong URL ends such a run instead of hanging it; a long-lived runner says again every minute
that it is waiting.

What counts as "down": the agent's exception, or any exception in its ``__cause__``/``__context__``
chain, is a refused or dropped connection (``ConnectionRefusedError``, httpx's ``ConnectError`` /
``ConnectTimeout`` / ``RemoteProtocolError``, openai's and anthropic's ``APIConnectionError``). A
framework that wraps the client's error keeps it in the chain, so LangChain, the Agents SDK, AutoGen
and CrewAI agents are covered without knowing them. Any other failure is the agent's own and changes
nothing here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

from agl.types import Resources

__all__ = ["EndpointGate", "connection_failure"]

log = logging.getLogger("agl.runner")

_CONNECTION_ERRORS = frozenset(
    {"ConnectError", "ConnectTimeout", "RemoteProtocolError", "APIConnectionError"}
)
_MAX_DELAY_S = 5.0
_REMIND_S = 60.0


def connection_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from or during) is a failed connection."""
    stack: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, ConnectionRefusedError) or type(err).__name__ in _CONNECTION_ERRORS:
            return True
        stack += [err.__cause__, err.__context__]
    return False


def _address(base_url: str) -> tuple[str, int] | None:
    parts = urlsplit(base_url)
    if not parts.hostname:
        return None
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def _moved(address: tuple[str, int], latest: Callable[[], Resources | None]) -> bool:
    """Whether the latest resources' LLM endpoint is another address than ``address``."""
    try:
        resources = latest()
    except Exception:  # noqa: BLE001 - the store may be restarting too: keep waiting
        return False
    llm = resources.llm if resources is not None else None
    return llm is not None and _address(llm.base_url) not in (None, address)


def _reachable(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=1.0):
            return True
    except OSError:
        return False


class EndpointGate:
    """Holds the runner's claims while the LLM endpoint of a failed attempt refuses connections.

    ``note`` is called with a failed attempt's exception and resources; ``wait`` before each claim
    returns at once unless an endpoint was noted down, else probes it with backoff (0.25 s doubling
    to 5 s) until it accepts a connection or ``stop`` is set. Used on the runner's event loop only.
    """

    def __init__(self) -> None:
        self.down: tuple[str, int] | None = None
        self.waits = 0  #: how many times claiming paused for a down endpoint

    def note(self, exc: BaseException, resources: Resources | None) -> bool:
        """Record the endpoint down when ``exc`` is a failed connection to ``resources.llm``."""
        llm = resources.llm if resources is not None else None
        address = _address(llm.base_url) if llm is not None else None
        if address is None or not connection_failure(exc):
            return False
        if self.down is None:
            self.waits += 1
            log.warning(
                "agl runner: the LLM endpoint %s:%d is unreachable (%s); claiming paused until it "
                "answers again (a gateway inside a restarting trainer comes back on the same address)",
                *address,
                type(exc).__name__,
            )
        self.down = address
        return True

    async def wait(self, stop: asyncio.Event, latest: Callable[[], Resources | None]) -> None:
        """Return when no endpoint is down (probing the noted one), when the latest resources name
        another endpoint (``latest()``, called in a thread: a restarted trainer may serve elsewhere),
        or when ``stop`` is set; while it stays down, say so again every minute (a wrong URL must not
        look like an idle runner)."""
        delay, loop = 0.25, asyncio.get_running_loop()
        started = reminded = loop.time()
        while self.down is not None and not stop.is_set():
            address = self.down
            if await loop.run_in_executor(None, _reachable, address):
                if self.down == address:
                    log.warning("agl runner: the LLM endpoint %s:%d answers again; claiming", *address)
                    self.down = None
                return
            if await loop.run_in_executor(None, _moved, address, latest):
                log.warning("agl runner: the latest resources name another LLM endpoint; claiming")
                self.down = None
                return
            if loop.time() - reminded >= _REMIND_S:
                reminded = loop.time()
                log.warning(
                    "agl runner: the LLM endpoint %s:%d is still unreachable after %.0f s; not claiming",
                    *address,
                    reminded - started,
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, _MAX_DELAY_S)
