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
  gateway assigns it (:mod:`agl.gateway.seeds`) to every call of a seeded rollout that sets no ``seed``
  of its own, and records it on the call's span (``agl.llm.seed``, ``agl.llm.seed_source``).

The members of a group get distinct seeds (the member is part of the place), a retried attempt gets
fresh ones (so a retry is not a replay of the failure), and the hash is stable across processes,
machines and Python versions (BLAKE2b, not ``hash``). Seeds are 31-bit: every engine and hosted API
accepts them (some refuse 64-bit ones).
"""

from __future__ import annotations

import hashlib

__all__ = ["SEED_BITS", "call_seed", "derive_seed", "rollout_place", "rollout_seed"]

SEED_BITS = 31


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
