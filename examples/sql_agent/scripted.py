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
agent, gateway and store as RL rollouts. With ``repair_every=N`` (``dev --oracle --repairs N``) every
Nth question also demonstrates a repair: the writer breaks the gold query the ways a writer does — a
wrong column, a missing join, a wrong aggregate function (:func:`break_query`) —, SQLite refuses it,
the checker reports the error and the rewriter writes the gold query. ``agl sft`` leaves the broken
call out (AIR penalised it: ``SFT.drop_penalised``) and keeps the rewriter's fix, so the warm start
covers every agent.
"""

from __future__ import annotations

import os
import re
import sqlite3
from typing import Any

from examples.sql_agent import data
from examples.sql_agent.agent import REWRITER, WRITER

__all__ = ["BEHAVIOURS", "BREAKS", "ScriptedSQL", "behaviour", "break_query"]

BEHAVIOURS = ("good", "fixed", "wrong", "broken")


def behaviour(task: dict[str, Any]) -> str:
    """The behaviour for a task, by its number: any four consecutive tasks show all four."""
    return BEHAVIOURS[int(task["id"].rsplit("-", 1)[1]) % len(BEHAVIOURS)]


def _broken(sql: str) -> str:
    """The gold query with its first table misspelt: SQLite refuses it ("no such table")."""
    return re.sub(r"\bFROM (\w+)", r"FROM \1_archive", sql, count=1)


#: the ways the oracle breaks a query for a repair demonstration, tried in turn from the task's own
BREAKS = ("column", "join", "function")
_FUNCTIONS = {"AVG": "AVERAGE", "SUM": "SUMMATION", "MAX": "MAXIMUM", "MIN": "MINIMUM", "COUNT": "NUMBER"}


def _break(kind: str, sql: str, columns: list[str]) -> str | None:
    if kind == "column":  # a column misnamed the way a model misremembers it (plural)
        for col in sorted(columns, key=len, reverse=True):
            if re.search(rf"(?<![\w.]){col}\b", sql):
                return re.sub(rf"(?<![\w.]){col}\b", f"{col}s", sql, count=1)
            if re.search(rf"\.{col}\b", sql):
                return re.sub(rf"\.{col}\b", f".{col}s", sql, count=1)
        return None
    if kind == "join":  # the join left out: the other table's columns are then unknown
        found = re.search(r"\s+JOIN\s+\w+\s+ON\s+\S+\s*=\s*\S+", sql, re.I)
        return sql[: found.start()] + sql[found.end() :] if found else None
    for fn, wrong in _FUNCTIONS.items():  # a function SQLite does not have
        if re.search(rf"\b{fn}\s*\(", sql):
            return re.sub(rf"\b{fn}\s*\(", f"{wrong}(", sql, count=1)
    return None


def break_query(task: dict[str, Any], db: str | os.PathLike[str], start: int = 0) -> tuple[str, str]:
    """``(kind, query)``: the task's gold query broken so that SQLite refuses it on ``db`` — the
    first of :data:`BREAKS` (from ``start``, round) that applies and fails, else the table misspelt."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        columns = sorted({r[1] for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
                          for r in conn.execute(f"PRAGMA table_info({t})")})  # fmt: skip
        for i in range(len(BREAKS)):
            kind = BREAKS[(start + i) % len(BREAKS)]
            sql = _break(kind, task["gold_sql"], columns)
            if sql is None:
                continue
            try:
                conn.execute(sql).fetchall()
            except sqlite3.Error:
                return kind, sql
    finally:
        conn.close()
    return "table", _broken(task["gold_sql"])


def _wrong(task: dict[str, Any]) -> str:
    """A query that runs and returns rows, but not the gold ones."""
    table = data.DOMAINS[task["db_id"]][0].name
    if task["gold_sql"] == f"SELECT COUNT(*) FROM {table}":
        table = data.DOMAINS[task["db_id"]][1].name
    return f"SELECT COUNT(*) FROM {table}"


class ScriptedSQL:
    """``script=`` for the gateway's scripted backend: ``(GenerationRequest) -> reply text``."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        oracle: bool = False,
        repair_every: int = 0,
    ) -> None:
        if isinstance(repair_every, bool) or not isinstance(repair_every, int) or repair_every < 0:
            raise ValueError(f"repair_every must be an integer >= 0, got {repair_every!r}")
        if repair_every and not oracle:
            raise ValueError("repair_every is a setting of the oracle teacher: it needs oracle=True")
        self.oracle, self.repair_every, self.data_dir = oracle, repair_every, data_dir
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
        number = int(task["id"].rsplit("-", 1)[1])
        if self.repair_every and number % self.repair_every == 0:
            if system == WRITER:
                _, sql = break_query(
                    task, data.db_path(task["db_id"], self.data_dir), number // self.repair_every
                )
                return f"```sql\n{sql}\n```"
            return f"```sql\n{gold}\n```"
        if kind == "good" or (kind == "fixed" and system == REWRITER):
            sql = gold
        elif kind == "wrong":
            sql = _wrong(task)
        else:
            sql = _broken(gold)
        return f"```sql\n{sql}\n```"
