"""Helpers shared by the AutoGen tests: run rollouts through agl's Runner, walk a stored span tree."""

from __future__ import annotations

from typing import Any

from agl import semconv as sc
from agl.types import LLM, NewRollout


def run_rollouts(agent: Any, store: Any, base_url: str, inputs: list[Any]) -> list[str]:
    """Enqueue one rollout per input and let agl's Runner run them all; returns the rollout ids."""
    from agl.runner.runner import Runner

    store.add_resources({"main": LLM(base_url=base_url, model="scripted")})
    ids = [r.id for r in store.enqueue([NewRollout(input=x) for x in inputs])]
    stats = Runner(agent, store, concurrency=2, timeout_s=60).run(max_rollouts=len(ids))
    assert stats.succeeded == len(ids), stats.errors
    return ids


def tree(spans: list[Any]) -> tuple[dict[str, Any], Any, Any]:
    """(span by id, ancestors(span) nearest first, agent_above(span): the nearest invoke_agent's name)."""
    index = {s.span_id: s for s in spans}

    def ancestors(s: Any) -> list[Any]:
        out = []
        while s.parent_id is not None and s.parent_id in index:
            s = index[s.parent_id]
            out.append(s)
        return out

    def agent_above(s: Any) -> str | None:
        return next(
            (a.attributes[sc.GEN_AI_AGENT_NAME] for a in ancestors(s) if a.name == sc.SPAN_INVOKE_AGENT), None
        )

    return index, ancestors, agent_above
