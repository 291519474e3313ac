"""A scripted model for ``dev --backend scripted``, ``dev --oracle`` and the tests.

It recognises the case from the request's messages and answers from BFCL's possible answer (the first
accepted value of each argument; an argument whose only accepted value is "" left out):

- ``right``: the possible answer's calls (BFCL's checker accepts them: reward 1);
- ``wrong_value``: the same calls with the first argument's value changed (reward 0);
- ``prose``: a sentence and no call (reward 0, AIR's penalty on the reply);
- ``unknown_function``: a call of a function the case does not have (reward 0, AIR's penalty).

``ScriptedBFCL(oracle=True)`` is the *oracle teacher*: ``right`` on every case (and no call on an
irrelevance case), so ``dev --oracle --split train`` records demonstrations for ``agl sft`` through the
same agent, gateway and store as RL's rollouts. ``behaviour`` may also be a fixed name for every case.
Multi-turn cases are not scripted here: the multi-turn tests script their own conversation.
"""

from __future__ import annotations

import re
from typing import Any

from agl.gateway.testing import reply, tool_call
from examples.bfcl_agent import data

__all__ = ["BEHAVIOURS", "ScriptedBFCL", "answer_calls"]

BEHAVIOURS = ("right", "wrong_value", "prose", "unknown_function")


def _first(values: list[Any]) -> tuple[bool, Any]:
    """``(keep, value)``: the first accepted value that is not BFCL's "may be left out" mark (``""``);
    an argument that accepts nothing else is left out (so is an optional one that accepts ``""``)."""
    given = [v for v in values if v != "" and v is not None]
    if not given:
        return False, None
    value = given[0]
    if isinstance(value, dict):
        return True, {k: _first(v)[1] for k, v in value.items() if _first(v)[0]}
    if isinstance(value, list):
        return True, [_first([v])[1] if isinstance(v, dict) else v for v in value]
    return True, value


def answer_calls(task: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The calls of ``task``'s possible answer, as ``(tool name, arguments)``: dots in names become
    ``_`` as in the tools the agent sends (BFCL's ``convert_to_tool``)."""
    calls = []
    docs = {f["name"]: f for f in task.get("function", [])}
    for call in data.answer(task) or []:
        ((name, params),) = call.items()
        required = set(docs.get(name, {}).get("parameters", {}).get("required", []))
        args = {}
        for key, values in params.items():
            if "" in values and key not in required:
                continue  # optional, and leaving it out is accepted
            keep, value = _first(values)
            if keep:
                args[key] = value
        calls.append((re.sub(r"\.", "_", name), args))
    return calls


def _perturb(args: dict[str, Any]) -> dict[str, Any]:
    if not args:
        return {"unexpected": 1}
    key = next(iter(args))
    value = args[key]
    if isinstance(value, bool):
        changed: Any = not value
    elif isinstance(value, (int, float)):
        changed = value + 7
    elif isinstance(value, str):
        changed = value + " (changed)"
    else:
        changed = "changed"
    return {**args, key: changed}


class ScriptedBFCL:
    """``script=`` for the gateway's scripted backend: ``(GenerationRequest) -> reply``."""

    def __init__(self, *, oracle: bool = False, behaviour: str | None = None) -> None:
        if behaviour is not None and behaviour not in BEHAVIOURS:
            raise ValueError(f"behaviour must be one of {', '.join(BEHAVIOURS)}, got {behaviour!r}")
        self.oracle, self.fixed = oracle, behaviour
        self.tasks = {
            self._key(t["question"][0], [f["name"] for f in t["function"]]): t for t in data.load_tasks("all")
        }

    @staticmethod
    def _key(messages: list[dict[str, Any]], names: list[str]) -> str:
        """A case by its messages and its functions' names (one question is asked in several
        categories, with other functions)."""
        text = "\n".join(str(m.get("content")) for m in messages if m.get("role") in ("system", "user"))
        return text + "\n" + ",".join(sorted(re.sub(r"\.", "_", n) for n in names))

    def behaviour(self, task: dict[str, Any]) -> str:
        if self.oracle:
            return "right"
        if self.fixed:
            return self.fixed
        return BEHAVIOURS[int(task["id"].rsplit("_", 1)[1]) % len(BEHAVIOURS)]

    def __call__(self, request: Any) -> Any:
        names = [t.get("function", {}).get("name", "") for t in request.tools or []]
        task = self.tasks.get(self._key(request.messages or [], names))
        if task is None:
            return reply("I cannot help with that.")
        kind = self.behaviour(task)
        calls = answer_calls(task)
        if kind == "prose" or not calls:
            return reply("I am not able to call a function for that.")
        if kind == "unknown_function":
            return reply(None, tool_call("not_a_function", calls[0][1]))
        if kind == "wrong_value":
            calls = [(calls[0][0], _perturb(calls[0][1])), *calls[1:]]
        return reply(None, *(tool_call(name, args) for name, args in calls))
