"""Helpers shared by the CrewAI test modules: running rollouts and walking span trees."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from agl import semconv as sc
from agl.types import LLM, NewRollout


def run_rollouts(agent: Any, store: Any, base_url: str, inputs: list[Any]) -> list[str]:
    """Enqueue one rollout per input and let agl's Runner run them all; returns the rollout ids."""
    from agl.runner.runner import Runner

    store.add_resources({"main": LLM(base_url=base_url, model="scripted")})
    ids = [r.id for r in store.enqueue([NewRollout(input=x) for x in inputs])]
    stats = Runner(agent, store, concurrency=2, timeout_s=60).run(max_rollouts=len(ids))
    done = store.wait_for_rollouts(ids, timeout_s=30)
    assert [r.status for r in done] == ["succeeded"] * len(ids), stats.errors
    assert stats.rewards == [1.0] * len(ids)
    return ids


def parent_of(span: Any) -> str | int | None:
    """The parent span id of a stored span (``parent_id``) or of an OTel SDK span (``parent``)."""
    if hasattr(span, "parent_id"):
        return span.parent_id
    return span.parent.span_id if span.parent is not None else None


def span_id(span: Any) -> str | int:
    return span.span_id if hasattr(span, "span_id") else span.context.span_id


def index_of(spans: Iterable[Any]) -> dict[Any, Any]:
    return {span_id(s): s for s in spans}


def ancestors(span: Any, index: dict[Any, Any]) -> list[Any]:
    out = []
    while parent_of(span) is not None and parent_of(span) in index:
        span = index[parent_of(span)]
        out.append(span)
    return out


def agent_above(span: Any, index: dict[Any, Any]) -> str | None:
    for a in ancestors(span, index):
        if a.name == sc.SPAN_INVOKE_AGENT:
            return a.attributes[sc.GEN_AI_AGENT_NAME]
    return None


def start_of(span: Any) -> int:
    return span.start_ns if hasattr(span, "start_ns") else span.start_time


def by_time(spans: Iterable[Any]) -> list[Any]:
    return sorted(spans, key=start_of)


def named(spans: Iterable[Any], name: str) -> list[Any]:
    return by_time(s for s in spans if s.name == name)
