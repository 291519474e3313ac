"""Helpers shared by the judge tests (imported by name: pytest puts this directory on sys.path)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from agl.types import NewRollout


def scores_from_answers(request: Any) -> str:
    """A judge that reads each trajectory's ``answer N`` in its prompt and scores it N/10."""
    prompt = request.messages[-1]["content"]
    blocks = re.findall(r"=== trajectory (t\d+) ===\n(.*?)(?=\n\n=== |\n\nCompare|\Z)", prompt, re.S)
    scores = []
    for label, text in blocks:
        n = int(re.findall(r"answer (\d+)", text)[-1])
        scores.append({"id": label, "score": n / 10, "reason": f"said {n}"})
    return json.dumps({"scores": scores})


def run_group(gateway: Any, ids: Sequence[str], group: str, question: str = "What is 2+5?") -> list[Any]:
    """One real rollout per id (enqueued, claimed, one chat call through the gateway, finished)."""
    import openai

    store = gateway.store
    store.enqueue(
        [NewRollout(id=i, group_id=group, input={"question": question, "answer": "7"}) for i in ids]
    )
    for _ in ids:
        claim = store.claim("test-worker")
        rid, n = claim.rollout.id, claim.attempt.number
        client = openai.OpenAI(base_url=gateway.for_rollout(rid, n), api_key="sk-agl-test")
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": question}])
        store.finish_attempt(rid, n, "succeeded")
    return store.query_rollouts(ids=list(ids))
