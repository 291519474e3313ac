"""A store of finished rollouts whose gateway calls are written span by span, as the gateway records
them (server side, call index, prompt and response ids, log-probs, seed, weights version): the input
``agl diff`` (tests/test_diff.py) and the dashboard's comparison (tests/dashboard/test_compare.py) read.
No torch: the core env runs both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import agl.store
from agl import semconv as sc
from agl.types import NewRollout, Span


def recorded_store(
    calls: dict[str, list[dict[str, Any]]],
    *,
    prefix: str | None = None,
    path: Path | None = None,
    name: str = "chat",
    distinct_seeds: bool = False,
) -> Any:
    """One finished rollout per place (its step read from the place), with that place's calls in order.

    A call is ``{"ids": [...]}`` plus optional ``prompt``, ``lp``, ``seed`` and ``v`` (weights version).
    Rollout ids are ``{prefix}-{n}`` (they differ per run: runs are matched by place) or, without a
    prefix, derived from the place. The default seed is 11, or 11 + n with ``distinct_seeds``."""
    store = agl.store.open(f"sqlite:///{path}" if path else "memory://")
    for n, (place, cs) in enumerate(calls.items()):
        rid = f"{prefix}-{n}" if prefix else f"ro-{place.replace(':', '-').replace('/', '-')}-{n}"
        step = int(place.split(":s")[1].split("/")[0])
        meta = {"step": step, sc.ROLLOUT_PLACE_KEY: place}
        store.enqueue([NewRollout(id=rid, input={"q": n}, metadata=meta)])
        claim = store.claim("w")
        assert claim is not None
        store.add_spans(
            [_call_span(rid, claim.attempt.number, n, i, c, name, distinct_seeds) for i, c in enumerate(cs)]
        )
        store.finish_attempt(rid, claim.attempt.number, "succeeded")
    return store


def _call_span(rid: str, attempt: int, n: int, i: int, c: dict[str, Any], name: str, distinct: bool) -> Span:
    return Span(
        trace_id="a" * 32,
        span_id=f"{n + 1:04x}{i + 1:012x}",
        name=name,
        start_ns=i + 1,
        end_ns=i + 2,
        rollout_id=rid,
        attempt=attempt,
        attributes={
            sc.AGL_SIDE: sc.SIDE_SERVER,
            sc.AGL_LLM_CALL_INDEX: i,
            sc.AGL_LLM_PROMPT_TOKEN_IDS: c.get("prompt", [1, 2]),
            sc.AGL_LLM_RESPONSE_TOKEN_IDS: c["ids"],
            sc.AGL_LLM_RESPONSE_LOGPROBS: c.get("lp", [-0.5] * len(c["ids"])),
            sc.AGL_LLM_SEED: c.get("seed", 11 + n if distinct else 11),
            sc.AGL_LLM_SEED_SOURCE: "run",
            sc.AGL_LLM_WEIGHT_VERSION: c.get("v", 1),
        },
    )
