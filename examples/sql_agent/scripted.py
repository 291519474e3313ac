"""A scripted model for ``dev --backend scripted`` and the tests: known-good and known-bad answers.

It plays the writer and the rewriter (recognised by their system prompts) and answers each question
in one of four ways, fixed per task by its number so a run is reproducible:

- ``good``: the writer writes the gold query (reward 1, no AIR penalty);
- ``fixed``: the writer's query names a table that does not exist, so it fails; the rewriter writes
  the gold query (reward 1, one AIR penalty on the writer's call);
- ``wrong``: the writer's query runs but answers something else (reward 0, no penalty);
- ``broken``: every query fails, three turns in a row (reward 0, a penalty on each of the 3 calls).

``ScriptedSQL(oracle=True)`` is the *oracle teacher*: the writer writes the gold query for every
question, so ``dev --oracle`` records demonstrations for a supervised warm start through the same
agent, gateway and store as RL rollouts.
"""

from __future__ import annotations

import os
import re
from typing import Any

from examples.sql_agent import data
from examples.sql_agent.agent import REWRITER, WRITER

__all__ = ["BEHAVIOURS", "ScriptedSQL", "behaviour"]

BEHAVIOURS = ("good", "fixed", "wrong", "broken")


def behaviour(task: dict[str, Any]) -> str:
    """The behaviour for a task, by its number: any four consecutive tasks show all four."""
    return BEHAVIOURS[int(task["id"].rsplit("-", 1)[1]) % len(BEHAVIOURS)]


def _broken(sql: str) -> str:
    """The gold query with its first table misspelt: SQLite refuses it ("no such table")."""
    return re.sub(r"\bFROM (\w+)", r"FROM \1_archive", sql, count=1)


def _wrong(task: dict[str, Any]) -> str:
    """A query that runs and returns rows, but not the gold ones."""
    table = data.DOMAINS[task["db_id"]][0].name
    if task["gold_sql"] == f"SELECT COUNT(*) FROM {table}":
        table = data.DOMAINS[task["db_id"]][1].name
    return f"SELECT COUNT(*) FROM {table}"


class ScriptedSQL:
    """``script=`` for the gateway's scripted backend: ``(GenerationRequest) -> reply text``."""

    def __init__(self, data_dir: str | os.PathLike[str] | None = None, *, oracle: bool = False) -> None:
        self.oracle = oracle
        tasks = data.load_tasks("train", data_dir) + data.load_tasks("test", data_dir)
        self.tasks = {t["question"]: t for t in tasks}

    def __call__(self, request: Any) -> str:
        messages = request.messages or []
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        ask = next((m["content"] for m in messages if m["role"] == "user"), "")
        found = re.search(r"^Question: (.*)$", ask, re.M)
        task = self.tasks.get(found.group(1).strip()) if found else None
        if task is None or system not in (WRITER, REWRITER):
            return "I cannot help with that."
        kind, gold = ("good" if self.oracle else behaviour(task)), task["gold_sql"]
        if kind == "good" or (kind == "fixed" and system == REWRITER):
            sql = gold
        elif kind == "wrong":
            sql = _wrong(task)
        else:
            sql = _broken(gold)
        return f"```sql\n{sql}\n```"
