"""A scripted model for ``dev --backend scripted`` and the tests: known-good and known-bad answers.

It plays the solver and answers each problem in one of four ways, fixed per task by its number:

- ``good``: calls ``calculator`` with the right expression, then answers the result (reward 1);
- ``sloppy``: first sends a malformed expression (an unbalanced parenthesis), which the calculator
  refuses, then the right one, then answers (reward 1, one AIR penalty on the malformed call);
- ``wrong``: answers at once, off by one, without the tool (reward 0);
- ``direct``: answers at once, correctly, without the tool (reward 1).

``ScriptedCalc(oracle=True)`` is the *oracle teacher*: every problem is solved the ``good`` way (the
gold expression through the calculator, then its result), so ``dev --oracle`` records demonstrations
for a supervised warm start through the same agent, gateway and store as RL rollouts.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from agl.gateway.testing import reply, tool_call
from examples.calc_agent import data
from examples.calc_agent.agent import SYSTEM

__all__ = ["BEHAVIOURS", "ScriptedCalc", "behaviour", "expected_calls"]

BEHAVIOURS = ("good", "sloppy", "wrong", "direct")


def behaviour(task: dict[str, Any]) -> str:
    """The behaviour for a task, by its number: any four consecutive tasks show all four."""
    return BEHAVIOURS[int(task["id"].rsplit("-", 1)[1]) % len(BEHAVIOURS)]


def expected_calls(task: dict[str, Any]) -> int:
    """How many LLM calls the agent makes on ``task`` under this script."""
    return {"good": 2, "sloppy": 3, "wrong": 1, "direct": 1}[behaviour(task)]


def _text(content: Any) -> str:
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


class ScriptedCalc:
    """``script=`` for the gateway's scripted backend: ``(GenerationRequest) -> reply``."""

    def __init__(self, *, oracle: bool = False) -> None:
        self.oracle = oracle
        self.tasks = {t["question"]: t for t in data.load_tasks("train") + data.load_tasks("test")}

    def __call__(self, request: Any) -> Any:
        messages = request.messages or []
        system = next((_text(m.get("content")) for m in messages if m.get("role") == "system"), "")
        question = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
        task = self.tasks.get(question.strip())
        if task is None or SYSTEM not in system:
            return reply("I cannot help with that.")
        kind, expression = ("good" if self.oracle else behaviour(task)), task["expression"]
        results = [_text(m.get("content")) for m in messages if m.get("role") == "tool"]
        if kind == "direct":
            return reply(f"ANSWER: {task['answer']}")
        if kind == "wrong":
            return reply(f"ANSWER: {data.answer_text(Fraction(task['answer']) + 1)}")
        good = [r for r in results if re.fullmatch(r"-?\d+(?:\.\d+)?", r.strip())]
        if good:
            return reply(f"ANSWER: {good[-1].strip()}")
        if kind == "sloppy" and not results:
            return reply(None, tool_call("calculator", expression=f"({expression}"))
        return reply(None, tool_call("calculator", expression=expression))
