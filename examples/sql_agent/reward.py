"""The reward: execution match, as Spider's execution accuracy — the predicted query is right when it
returns the same rows as the gold query on the task's database.

Rows are compared as a multiset (row order ignored) unless the gold query orders them; values are
normalised so ``3``, ``3.0`` and ``2.9999999999`` are one answer. A query that does not execute, runs
too long, or writes is simply wrong (0.0): the agent gets no partial credit for the attempt, and the
separate AIR penalty for the failed execution is read off the trace, not computed here.

A count is only an answer to a counting question: when the predicted query answers with ``COUNT(...)``
and the gold query does not, the reward is 0.0 even if the numbers happen to coincide (a table's row
count often equals some other small number in these databases). ``SELECT COUNT(*) FROM t`` runs on
every database and never fails, which made it the cheapest way to dodge AIR's failed-query penalty;
it must never also be a way to score.
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections import Counter
from typing import Any

__all__ = ["answers_with_count", "execute", "execution_match", "extract_sql"]

#: SQLite VM steps a query may take before it is aborted (the databases are tiny: a correct query
#: needs well under 10k; a runaway cross join is stopped instead of hanging the rollout)
MAX_STEPS = 2_000_000

_FENCE = re.compile(r"```(?:sql|sqlite)?\s*(.*?)(?:```|\Z)", re.S | re.I)
_START = re.compile(r"\b(SELECT|WITH)\b", re.I)


def extract_sql(text: str) -> str:
    """The query in a model's reply: the first fenced code block, else the text from the first
    ``SELECT``/``WITH`` on, up to the first ``;``; else the reply itself (which then fails to run)."""
    text = text or ""
    found = _FENCE.search(text)
    sql = found.group(1) if found else text
    start = _START.search(sql)
    if start is not None:
        sql = sql[start.start() :]
    return sql.split(";", 1)[0].strip()


def execute(db: str | os.PathLike[str], sql: str) -> list[tuple[Any, ...]]:
    """Run ``sql`` read-only on ``db``; raises ``sqlite3.Error`` on any failure (bad SQL, a write,
    an empty query, a query that runs past ``MAX_STEPS``)."""
    if not sql or not sql.strip():
        raise sqlite3.OperationalError("empty query")
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    steps = 0

    def budget() -> int:
        nonlocal steps
        steps += 1
        return 1 if steps * 1000 > MAX_STEPS else 0

    conn.set_progress_handler(budget, 1000)
    try:
        return conn.execute(sql).fetchall()
    except sqlite3.Warning as exc:  # e.g. "You can only execute one statement at a time."
        raise sqlite3.OperationalError(str(exc)) from exc
    finally:
        conn.close()


def _norm(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        return round(value, 6) + 0.0  # +0.0 turns -0.0 into 0.0
    if isinstance(value, int):
        return float(value)
    return value


def _rows(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [tuple(_norm(v) for v in row) for row in rows]


def _ordered(sql: str) -> bool:
    return re.search(r"\bORDER\s+BY\b", sql, re.I) is not None


_SELECT_LIST = re.compile(r"\bSELECT\s+(?:DISTINCT\s+)?(.*?)(?:\bFROM\b|\Z)", re.S | re.I)
_BARE_COUNT = re.compile(r"COUNT\s*\([^()]*\)(?:\s+(?:AS\s+)?\w+)?", re.I)


def _columns(select_list: str) -> list[str]:
    """The select list's items, split at top-level commas."""
    out, depth, cur = [], 0, []
    for ch in select_list:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur).strip())
    return out


def answers_with_count(sql: str) -> bool:
    """Whether a column of the query's answer is a bare ``COUNT(...)`` (the outermost ``SELECT``:
    the last one after a ``WITH``, else the first)."""
    lists = _SELECT_LIST.findall(sql or "")
    if not lists:
        return False
    outer = lists[-1] if (sql or "").lstrip()[:4].upper() == "WITH" else lists[0]
    return any(_BARE_COUNT.fullmatch(col) for col in _columns(outer))


def execution_match(db: str | os.PathLike[str], predicted: str, gold: str) -> float:
    """1.0 when ``predicted`` returns the same rows as ``gold`` on ``db``, else 0.0 (and 0.0 for a
    count where the gold answer is not one)."""
    if answers_with_count(predicted) and not answers_with_count(gold):
        return 0.0
    expected = _rows(execute(db, gold))  # a broken gold query is a bug in the data: let it raise
    try:
        got = _rows(execute(db, predicted))
    except sqlite3.Error:
        return 0.0
    if _ordered(gold):
        return 1.0 if got == expected else 0.0
    return 1.0 if Counter(got) == Counter(expected) else 0.0
