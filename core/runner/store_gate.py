"""Runners wait while their store is unreachable, and claim again when it answers.

Why: a store server going away is an expected event (a deployment restarting it, a shutdown script
that stops the server and the runners together). A runner whose claim finds the store unreachable
(``StoreUnavailableError``: the HTTP client's own retries ran out) says so in one line and then
probes the store with backoff (0.5 s doubling to 10 s, ``store.health()`` where the store has it:
one request, no retries, so a stop request is seen at once) until it answers, saying again every
minute that it is still waiting; any other claim failure is the caller's to log. Used on the
runner's event loop only; shared by its workers, so an outage is one line however many there are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from agl.errors import StoreUnavailableError

__all__ = ["StoreGate"]

log = logging.getLogger("agl.runner")

_FIRST_DELAY_S = 0.5
_MAX_DELAY_S = 10.0
_REMIND_S = 60.0


class StoreGate:
    """Holds a runner's claims while its store is unreachable.

    ``note(exc)`` after a failed claim: True (and the store marked down, logged once) when ``exc``
    says the store is unreachable. ``wait(stop)`` before a claim returns at once unless the store is
    down, else probes it with backoff until it answers or ``stop`` is set.
    """

    def __init__(self, store: Any, worker_id: str) -> None:
        self.store = store
        self.worker_id = worker_id
        self.down_since: float | None = None  #: loop time the outage was noticed; None: store up
        self.outages = 0  #: how many times the store was found unreachable

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def note(self, exc: BaseException) -> bool:
        if not isinstance(exc, StoreUnavailableError):
            return False
        if self.down_since is None:
            self.down_since = asyncio.get_running_loop().time()
            self.outages += 1
            log.warning(
                "agl runner %s: the store is unreachable (%s); waiting for it to return",
                self.worker_id,
                exc,
            )
        return True

    def _answers(self) -> bool:
        health = getattr(self.store, "health", None)
        try:
            if callable(health):
                return bool(health())
            self.store.get_resources(None)
            return True
        except Exception:  # noqa: BLE001 - any failure is "not yet"
            return False

    async def wait(self, stop: asyncio.Event) -> None:
        """Return once the store answers (logged), or when ``stop`` is set."""
        loop = asyncio.get_running_loop()
        delay = _FIRST_DELAY_S
        reminded = loop.time()
        while self.down_since is not None and not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            if stop.is_set():
                return
            if await loop.run_in_executor(None, self._answers):
                log.warning(
                    "agl runner %s: the store answers again after %.0f s; claiming",
                    self.worker_id,
                    loop.time() - self.down_since,
                )
                self.down_since = None
                return
            if loop.time() - reminded >= _REMIND_S:
                reminded = loop.time()
                log.warning(
                    "agl runner %s: the store is still unreachable after %.0f s; waiting",
                    self.worker_id,
                    reminded - self.down_since,
                )
            delay = min(delay * 2, _MAX_DELAY_S)
