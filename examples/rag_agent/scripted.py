"""A scripted model for ``dev --backend scripted`` and the tests: known-good and known-bad answers.

It plays the ``researcher`` (recognised by its instructions) and answers each question in one of four
ways, fixed per question by a hash so a run is reproducible:

- ``good``: searches for both hops, answers ``<answer>gold</answer>`` (reward 1.0);
- ``sloppy``: first sends an empty query, which the ``search`` tool refuses (one AIR penalty on that
  call), then behaves as ``good`` (reward 1.0);
- ``wrong``: searches for both hops, then answers another entity of the same kind in the right
  format (reward 0 when it shares no word with the gold answer: the format bonus needs F1 > 0);
- ``unformatted``: searches, then answers in a sentence without the tags (no format score, partial
  F1).

``ScriptedRAG(oracle=True)`` is the *oracle teacher*: every question is answered the ``good`` way
(both hops searched, the gold answer in tags), so ``dev --oracle`` records demonstrations for a
supervised warm start through the same agent, gateway and store as RL rollouts.
"""

from __future__ import annotations

import zlib
from typing import Any

from agl.gateway.testing import reply, tool_call
from examples.rag_agent import data
from examples.rag_agent.agent import INSTRUCTIONS

__all__ = ["BEHAVIOURS", "ScriptedRAG", "behaviour", "wrong_answer"]

BEHAVIOURS = ("good", "sloppy", "wrong", "unformatted")


def behaviour(question: str) -> str:
    return BEHAVIOURS[zlib.crc32(question.encode()) % len(BEHAVIOURS)]


def wrong_answer(task: dict[str, Any]) -> str:
    """Another answer of the same kind (a year, a person, a city, a country), never the gold one."""
    gold = task["answer"]
    if gold.isdigit():
        return str(int(gold) + 7)
    world = data.build_world(task.get("seed", data.SEED), task.get("scale", data.DEFAULT_SCALE))
    pools = (world.countries, list(world.city_country), list(world.person_info))
    pool = next(p for p in pools if gold in p)
    start = pool.index(gold)
    # the next one that shares no word with the gold answer (so its F1 is 0)
    return next(x for x in pool[start + 1 :] + pool[:start] if not set(x.split()) & set(gold.split()))


def _text(content: Any) -> str:
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


class ScriptedRAG:
    """``script=`` for the gateway's scripted backend: ``(GenerationRequest) -> reply``."""

    def __init__(
        self, scale: int = data.DEFAULT_SCALE, seed: int = data.SEED, *, oracle: bool = False
    ) -> None:
        self.oracle = oracle
        tasks = data.load_tasks("train", scale=scale, seed=seed) + data.load_tasks(
            "test", scale=scale, seed=seed
        )
        self.tasks = {t["question"]: t for t in tasks}

    def kind(self, task: dict[str, Any], request: Any) -> str:
        """How this call's rollout behaves (the same for every call of a rollout)."""
        return "good" if self.oracle else behaviour(task["question"])

    def __call__(self, request: Any) -> Any:
        messages = request.messages or []
        system = " ".join(
            _text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")
        )
        question = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
        task = self.tasks.get(question.strip())
        if task is None or INSTRUCTIONS not in system:
            return reply("I cannot help with that.")
        kind = self.kind(task, request)
        searches = sum(1 for m in messages if m.get("role") == "tool")
        plan = ([""] if kind == "sloppy" else []) + list(task["hops"])
        if searches < len(plan):
            return reply(None, tool_call("search", query=plan[searches]))
        if kind == "wrong":
            return reply(f"<answer>{wrong_answer(task)}</answer>")
        if kind == "unformatted":
            return reply(f"I found it: {task['answer']}.")
        return reply(f"<answer>{task['answer']}</answer>")
