"""Seeds of a reproducible run: one per rollout, one per LLM call, from the run's seed and places alone.

A run's randomness that reaches the policy comes from three places: which tasks a step takes (the
trainer's :class:`~agl.trainer.order.TaskOrder`, seeded), the tokens the engine draws, and the update's
own (data order, dropout: seeded by the trainer). The tokens are the hard part: runners claim rollouts
in whatever order they finish, so a seed taken from a shared generator in arrival order would change
with scheduling. Here every seed is a hash of the run's seed and a *place*, never of an order:

- a rollout's seed: :func:`rollout_seed` of (run seed, train or held-out, step, sampling round, the
  task's position in the step, the group member). The trainer writes it (and the place) into the rollout's metadata
  (:data:`agl.semconv.ROLLOUT_SEED_KEY`, :data:`agl.semconv.ROLLOUT_PLACE_KEY`) when it enqueues it;
- a call's seed: :func:`call_seed` of (rollout seed, attempt, the call's index within the attempt). The
  gateway assigns it (:class:`CallSeeds`) to every call of a seeded rollout that sets no ``seed``
  of its own, and records it on the call's span (``agl.llm.seed``, ``agl.llm.seed_source``).

The members of a group get distinct seeds (the member is part of the place), a retried attempt gets
fresh ones (so a retry is not a replay of the failure), and the hash is stable across processes,
machines and Python versions (BLAKE2b, not ``hash``). Seeds are 31-bit: every engine and hosted API
accepts them (some refuse 64-bit ones).

**The gateway's part** (:class:`CallSeeds`).

A rollout the trainer enqueued carries its seed in its metadata (:data:`agl.semconv.ROLLOUT_SEED_KEY`).
The gateway numbers the calls of each rollout attempt in the order the attempt makes them (0, 1, ...)
and gives call ``i`` of attempt ``a`` the seed :func:`call_seed` ``(rollout seed, a, i)``, so a
call's seed depends on the run's seed and the call's place, never on which runner served the rollout or
when. A request that sets ``seed`` itself keeps it (source ``agent``). A rollout without a seed (one a
user enqueued by hand), a call outside any rollout and a gateway without a store leave ``seed`` as the
request had it. The place, seed and source go on the call's span (:mod:`agl.gateway.spans`).

What this cannot order: calls one attempt makes *concurrently* (``asyncio.gather`` over two LLM calls)
are numbered in arrival order, which the event loop decides; a program whose calls within one rollout
follow each other (the common case) is numbered the same way every run.

**A forced temperature.** A held-out rollout the trainer decodes greedily (``LoopConfig.val_samples=0``)
carries :data:`agl.semconv.ROLLOUT_TEMPERATURE_KEY` (0.0) in its metadata; every call of that rollout is
then decoded at that temperature whatever the request asked (:func:`force_temperature`), and the span
records it (``gen_ai.request.temperature``, ``agl.llm.temperature_source: rollout``).

The rollout's seed (and temperature) is read from the store once per rollout and kept (the last ``max_rollouts``); the
call counters of the last ``max_rollouts`` attempts likewise.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from typing import Any

from agl import semconv as sc
from agl.gateway.backends.base import GenerationRequest

__all__ = [
    "SEED_BITS",
    "CallSeeds",
    "call_seed",
    "derive_seed",
    "force_temperature",
    "rollout_meta",
    "rollout_place",
    "rollout_seed",
]

SEED_BITS = 31

log = logging.getLogger("agl.gateway")


def derive_seed(*parts: int | str) -> int:
    """A stable seed in ``[0, 2**31)`` from ``parts`` (ints and strings; order matters)."""
    for p in parts:
        if isinstance(p, bool) or not isinstance(p, (int, str)):
            raise TypeError(f"seed parts are ints or strings, got {p!r}")
    key = "\x1f".join(f"{type(p).__name__[0]}{p}" for p in parts).encode()
    digest = hashlib.blake2b(key, digest_size=8, person=b"agl-seed").digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


def rollout_place(step: int, task: int, member: int, round_: str = "", mode: str = "train") -> str:
    """A rollout's place in a run: ``<mode>:s<step><round>/t<task position>/m<member>`` (``round_`` is
    the dynamic-sampling round suffix, e.g. ``"r1"``, empty for the step's first draw; ``mode`` keeps a
    held-out task apart from the training task at the same position)."""
    return f"{mode}:s{step}{round_}/t{task}/m{member}"


def rollout_seed(run_seed: int, place: str) -> int:
    """The seed of the rollout at ``place`` (see :func:`rollout_place`) in a run seeded ``run_seed``."""
    return derive_seed("rollout", int(run_seed), place)


def call_seed(rollout_seed_: int, attempt: int, index: int) -> int:
    """The seed of call ``index`` (0-based, in the order the attempt made its calls) of ``attempt``."""
    return derive_seed("call", int(rollout_seed_), int(attempt), int(index))


#: the routes whose raw body a pass-through backend forwards as it is (as in agl.gateway.sampling)
_FORWARDED = ("chat", "completions")


class CallSeeds:
    """Assigns each call of a seeded rollout its seed and its index within the attempt."""

    def __init__(self, store: Any, *, max_rollouts: int = 4096) -> None:
        self.store = store
        self.max_rollouts = max_rollouts
        self.in_loop = bool(getattr(store, "in_process", False))  # read on the event loop (no network wait)
        self._seeds: OrderedDict[str, tuple[int | None, float | None]] = OrderedDict()
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
        """Number ``gen`` within its attempt, set its seed and the rollout's forced temperature (see the
        module docstring)."""
        if gen.rollout is None or self.store is None:
            return
        gen.call_index = self.next_index(gen.rollout)
        base, temperature = await self._rollout_meta(gen.rollout[0])
        if temperature is not None:
            force_temperature(gen, temperature)
        if gen.seed is not None:
            gen.seed_source = sc.SEED_SOURCE_AGENT
            return
        if base is not None:
            gen.seed = call_seed(base, gen.rollout[1], gen.call_index)
            gen.seed_source = sc.SEED_SOURCE_RUN
            if gen.api in _FORWARDED and isinstance(gen.raw, dict):
                gen.raw["seed"] = gen.seed  # a pass-through backend (vLLM) forwards the raw body

    async def _rollout_meta(self, rollout_id: str) -> tuple[int | None, float | None]:
        """The rollout's seed and forced temperature (either None), read once and kept."""
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
            return None, None
        meta = rollout_meta(rollout.metadata)
        self._seeds[rollout_id] = meta
        while len(self._seeds) > self.max_rollouts:
            self._seeds.popitem(last=False)
        return meta


def rollout_meta(metadata: dict[str, Any]) -> tuple[int | None, float | None]:
    """A rollout's seed (:data:`agl.semconv.ROLLOUT_SEED_KEY`) and forced temperature
    (:data:`agl.semconv.ROLLOUT_TEMPERATURE_KEY`) from its metadata; a value of the wrong kind is None."""
    raw = metadata.get(sc.ROLLOUT_SEED_KEY)
    seed = raw if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0 else None
    t = metadata.get(sc.ROLLOUT_TEMPERATURE_KEY)
    ok = isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t <= 2
    return seed, float(t) if ok else None


def force_temperature(gen: GenerationRequest, temperature: float) -> None:
    """Decode ``gen`` at ``temperature`` whatever the request asked (a greedy held-out rollout: its
    score must not depend on the temperature the program passes), in the body a pass-through backend
    forwards too; the span records the source (``agl.llm.temperature_source``)."""
    gen.temperature = temperature
    gen.temperature_source = sc.TEMPERATURE_SOURCE_ROLLOUT
    if gen.api in _FORWARDED and isinstance(gen.raw, dict):
        gen.raw["temperature"] = temperature
