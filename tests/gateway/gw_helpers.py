"""Helpers shared by the gateway tests (imported by name: pytest puts this directory on sys.path)."""

from __future__ import annotations

from typing import Any

from agl import semconv as sc
from agl.types import NewRollout

ADD_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def start_rollout(store: Any, rollout_id: str) -> tuple[str, int]:
    """Enqueue and claim a rollout: spans can only be stored for a running attempt."""
    store.enqueue([NewRollout(id=rollout_id)])
    claim = store.claim("test-worker")
    assert claim is not None and claim.rollout.id == rollout_id
    return rollout_id, claim.attempt.number


def server_spans(store: Any, rollout_id: str) -> list[Any]:
    return [
        s for s in store.query_spans(rollout_id=rollout_id) if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER
    ]
