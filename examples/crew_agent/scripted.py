"""A scripted model for ``dev --backend scripted`` and the tests: known-good and known-bad writers.

It plays both agents, recognised by the system prompt CrewAI builds from the role ("You are
{role}."), and behaves per company in one of four ways, fixed by a hash so a run is reproducible:

- ``good``: the researcher looks the company up and reports the facts; the writer states every
  asked-for fact (coverage 1.0);
- ``sloppy``: the researcher first looks up a misspelt key, which the tool refuses (an AIR penalty
  on the researcher's call), then the right one; the writer is good (coverage 1.0);
- ``partial``: the writer states only the first asked-for fact (coverage 1/2 or 1/3);
- ``vague``: the writer states none of them (coverage 0.0).
"""

from __future__ import annotations

import re
import zlib
from typing import Any

from agl.gateway.testing import reply, tool_call
from examples.crew_agent import data

__all__ = ["BEHAVIOURS", "ScriptedCrew", "agent_of", "behaviour", "misspelt"]

BEHAVIOURS = ("good", "sloppy", "partial", "vague")


def behaviour(company: str) -> str:
    return BEHAVIOURS[zlib.crc32(company.encode()) % len(BEHAVIOURS)]


def misspelt(company: str) -> str:
    """A key the fact base does not have (its last letter doubled)."""
    return company + company[-1]


def agent_of(messages: list[dict[str, Any]]) -> str | None:
    """Which agent is asking: CrewAI's system prompt starts with "You are {role}."."""
    for m in messages:
        if m.get("role") == "system":
            found = re.match(r"\s*You are (.+?)\.", str(m.get("content") or ""))
            if found:
                return found.group(1)
    return None


def _sentence(fact: str, value: str) -> str:
    return f"Its {data.FACTS[fact]} is {value}."


class ScriptedCrew:
    """``script=`` for the gateway's scripted backend: ``(GenerationRequest) -> reply``."""

    def __init__(
        self, size: int = data.DEFAULT_SIZE, seed: int = data.SEED, *, only: str | None = None
    ) -> None:
        """``only`` fixes one behaviour for every company (``"good"``: a reliable researcher)."""
        if only is not None and only not in BEHAVIOURS:
            raise ValueError(f"only must be one of {', '.join(BEHAVIOURS)}, got {only!r}")
        self.only = only
        tasks = data.load_tasks("train", size=size, seed=seed) + data.load_tasks("test", size=size, seed=seed)
        self.tasks = {t["company"]: t for t in tasks}
        self.directory = data.build_directory(seed, size)

    def _task(self, messages: list[dict[str, Any]]) -> dict[str, Any] | None:
        asks = "\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "user")
        found = re.search(r"the company (.+?) (?:in two|with the lookup)", asks) or re.search(
            r"about the company (.+?)\. Report", asks
        )
        return self.tasks.get(found.group(1)) if found else None

    def kind(self, task: dict[str, Any], request: Any) -> str:
        """How this call's rollout behaves (the same for every call of a rollout)."""
        return self.only or behaviour(task["company"])

    def __call__(self, request: Any) -> Any:
        messages = request.messages or []
        agent, task = agent_of(messages), self._task(messages)
        if task is None:
            return reply("Thought: I am lost.\nFinal Answer: I do not know.")
        company = task["company"]
        kind = self.kind(task, request)
        if agent == "researcher":
            keys = ([misspelt(company)] if kind == "sloppy" else []) + [company]
            looked_up = sum(1 for m in messages if m.get("role") == "tool")
            if looked_up < len(keys):
                return reply(None, tool_call("lookup", key=keys[looked_up]))
            entry = self.directory[data.lookup_key(company)]
            facts = "\n".join(f"{data.FACTS[f]}: {entry[f]}" for f in task["facts"])
            return reply(f"Thought: I have the facts.\nFinal Answer: {facts}")
        if agent == "writer":
            if kind == "vague":
                text = f"{company} is a company with a long history and many customers."
            else:
                asked = task["facts"][:1] if kind == "partial" else task["facts"]
                text = f"{company} is a company. " + " ".join(_sentence(f, task["gold"][f]) for f in asked)
            return reply(f"Thought: I can write it.\nFinal Answer: {text}")
        return reply("Thought: I am lost.\nFinal Answer: I do not know.")
