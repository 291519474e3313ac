"""The seed of each call the gateway serves for a seeded rollout (see :mod:`agl.seeds`).

A rollout the trainer enqueued carries its seed in its metadata (:data:`agl.semconv.ROLLOUT_SEED_KEY`).
The gateway numbers the calls of each rollout attempt in the order the attempt makes them (0, 1, ...)
and gives call ``i`` of attempt ``a`` the seed :func:`agl.seeds.call_seed` ``(rollout seed, a, i)``, so a
call's seed depends on the run's seed and the call's place, never on which runner served the rollout or
when. A request that sets ``seed`` itself keeps it (source ``agent``). A rollout without a seed (one a
user enqueued by hand), a call outside any rollout and a gateway without a store leave ``seed`` as the
request had it. The place, seed and source go on the call's span (:mod:`agl.gateway.spans`).

What this cannot order: calls one attempt makes *concurrently* (``asyncio.gather`` over two LLM calls)
are numbered in arrival order, which the event loop decides; a program whose calls within one rollout
follow each other (the common case) is numbered the same way every run.

The rollout's seed is read from the store once per rollout and kept (the last ``max_rollouts``); the
call counters of the last ``max_rollouts`` attempts likewise.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from agl import semconv as sc
from agl.gateway.backends.base import GenerationRequest
from agl.seeds import call_seed

__all__ = ["CallSeeds"]

log = logging.getLogger("agl.gateway")

_LOCAL_STORES = frozenset({"MemoryStore", "SQLiteStore"})  # read on the event loop (no network wait)


class CallSeeds:
    """Assigns each call of a seeded rollout its seed and its index within the attempt."""

    def __init__(self, store: Any, *, max_rollouts: int = 4096) -> None:
        self.store = store
        self.max_rollouts = max_rollouts
        self.in_loop = type(store).__name__ in _LOCAL_STORES
        self._seeds: OrderedDict[str, int | None] = OrderedDict()
        self._calls: OrderedDict[tuple[str, int], int] = OrderedDict()

    def next_index(self, rollout: tuple[str, int]) -> int:
        """The index of the attempt's next call (0 for its first); taken when the request arrives, before
        any wait, so two calls an attempt makes one after the other are numbered in that order."""
        n = self._calls.pop(rollout, 0)
        self._calls[rollout] = n + 1
        while len(self._calls) > self.max_rollouts:
            self._calls.popitem(last=False)
        return n

    async def assign(self, gen: GenerationRequest) -> None:
        """Number ``gen`` within its attempt and set its seed (see the module docstring)."""
        if gen.rollout is None or self.store is None:
            return
        gen.call_index = self.next_index(gen.rollout)
        if gen.seed is not None:
            gen.seed_source = sc.SEED_SOURCE_AGENT
            return
        base = await self._rollout_seed(gen.rollout[0])
        if base is not None:
            gen.seed = call_seed(base, gen.rollout[1], gen.call_index)
            gen.seed_source = sc.SEED_SOURCE_RUN

    async def _rollout_seed(self, rollout_id: str) -> int | None:
        if rollout_id in self._seeds:
            self._seeds.move_to_end(rollout_id)
            return self._seeds[rollout_id]
        try:
            if self.in_loop:
                rollout = self.store.get_rollout(rollout_id)
            else:
                rollout = await asyncio.to_thread(self.store.get_rollout, rollout_id)
        except Exception as exc:  # noqa: BLE001 - an unknown rollout is served unseeded, as before
            log.debug("agl gateway: no seed for rollout %s: %s", rollout_id, exc)
            return None
        raw = rollout.metadata.get(sc.ROLLOUT_SEED_KEY)
        seed = raw if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0 else None
        self._seeds[rollout_id] = seed
        while len(self._seeds) > self.max_rollouts:
            self._seeds.popitem(last=False)
        return seed
