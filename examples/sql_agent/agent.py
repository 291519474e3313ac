"""The text-to-SQL agent: a LangGraph app, written the way a LangGraph user writes one.

    writer ──► checker ──► END            (the query ran and returned rows, or 3 turns are used up)
                 ▲   │
                 │   ▼
               rewriter                   (the query failed or returned nothing)

``writer`` (an LLM) turns the question and the schema into a query; ``checker`` runs it on the
database with the ``execute_sql`` tool and reports what went wrong — the SQLite error, or an empty
result; ``rewriter`` (an LLM) fixes the query from that report. At most ``MAX_TURNS`` queries are
tried. The checker's verdict comes from SQLite itself, not from a model, so a small model's guesses
never send a correct query back for rewriting.

The only agl code is in :func:`make_rollout`: ``agl.instrument()`` and the rollout function that
builds the graph on the endpoint the trainer hands it and returns the execution-match reward. It is
declared ``replayable``: given the same LLM replies it makes the same calls with the same messages (the
checker's verdict comes from SQLite), so ``train --branches K`` can sample the rewriter K times from
one failed query's prompt.
When ``execute_sql`` fails its ``execute_tool`` span is ERROR, and AIR penalises the LLM call that
wrote the failing query (the latest call before the tool ran: the writer's or the rewriter's).
"""

from __future__ import annotations

import json
import os
import sqlite3
from typing import Any

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import ToolException, tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

from examples.sql_agent import data
from examples.sql_agent.reward import execute, execution_match, extract_sql

__all__ = ["MAX_TURNS", "REWRITER", "WRITER", "TRAINED_AGENTS", "build_graph", "make_rollout"]

MAX_TURNS = 3
#: the agents whose LLM calls are trained (the checker makes none, but a selection says so explicitly)
TRAINED_AGENTS = ["writer", "rewriter"]

WRITER = (
    "You are an expert SQLite developer. Given a database schema and a question, write one SQLite "
    "query that answers the question. Reply with the query only, in a ```sql code block. Example:\n"
    "Question: How many employees work in 'Sales'?\n"
    "```sql\nSELECT COUNT(*) FROM employees WHERE department = 'Sales'\n```"
)
REWRITER = (
    "You are an expert SQLite developer. A query written for the question below has a problem. "
    "Write a corrected SQLite query. Reply with the query only, in a ```sql code block."
)


class SQLState(TypedDict, total=False):
    question: str
    schema: str
    query: str
    result: str
    feedback: str
    turns: int


def build_graph(llm: ChatOpenAI, db: str | os.PathLike[str]) -> Any:
    @tool
    def execute_sql(query: str) -> str:
        """Execute a SQLite query on the database and return the rows it returns, as JSON."""
        try:
            rows = execute(db, query)
        except sqlite3.Error as exc:
            raise ToolException(f"{type(exc).__name__}: {exc}") from exc
        return json.dumps(rows[:20])

    def writer(state: SQLState) -> SQLState:
        ask = f"Schema:\n{state['schema']}\n\nQuestion: {state['question']}"
        answer = llm.invoke([SystemMessage(WRITER), HumanMessage(ask)])
        return {"query": extract_sql(str(answer.content)), "turns": 1}

    def checker(state: SQLState) -> SQLState:
        try:
            result = execute_sql.invoke({"query": state["query"]})
        except ToolException as exc:
            return {"result": "", "feedback": f"The query failed: {exc}"}
        if result == "[]":
            return {"result": result, "feedback": "The query ran but returned no rows."}
        return {"result": result, "feedback": ""}

    def rewriter(state: SQLState) -> SQLState:
        ask = (
            f"Schema:\n{state['schema']}\n\nQuestion: {state['question']}\n\n"
            f"Query:\n```sql\n{state['query']}\n```\n\nProblem: {state['feedback']}"
        )
        answer = llm.invoke([SystemMessage(REWRITER), HumanMessage(ask)])
        return {"query": extract_sql(str(answer.content)), "turns": state["turns"] + 1}

    def after_check(state: SQLState) -> str:
        return "rewriter" if state["feedback"] and state["turns"] < MAX_TURNS else END

    graph = StateGraph(SQLState)
    graph.add_node("writer", writer)
    graph.add_node("checker", checker)
    graph.add_node("rewriter", rewriter)
    graph.add_edge(START, "writer")
    graph.add_edge("writer", "checker")
    graph.add_conditional_edges("checker", after_check, ["rewriter", END])
    graph.add_edge("rewriter", "checker")
    return graph.compile()


def make_rollout(data_dir: str | os.PathLike[str] | None = None) -> Any:
    """The rollout function the trainer runs: ``(task, resources) -> reward``."""
    import agl

    agl.instrument("openai", "langchain")

    # deterministic given the LLM's replies (SQLite decides the checker's verdict): the trainer may
    # branch it at the rewriter's call (train --branches K, agl.trainer.branching)
    @agl.rollout(replayable=True)
    def sql_agent(task: dict[str, Any], resources: agl.Resources) -> float:
        llm = resources.llm
        sampling = llm.sampling
        model = ChatOpenAI(
            model=llm.model,
            base_url=llm.base_url,
            api_key=llm.api_key or "agl",
            # held-out tasks carry temperature 0: they are decoded greedily (see cli.py)
            temperature=task.get("temperature", sampling.get("temperature", 0.0)),
            max_tokens=sampling.get("max_tokens", 256),
            max_retries=0,
        )
        db = data.db_path(task["db_id"], data_dir)
        final = build_graph(model, db).invoke({"question": task["question"], "schema": data.schema_of(db)})
        return execution_match(db, final["query"], task["gold_sql"])

    return sql_agent


#: for ``agl runner --agent examples.sql_agent.agent:sql_agent`` (data in the default data dir)
def sql_agent(task: dict[str, Any], resources: Any) -> float:
    global _default
    if _default is None:
        _default = make_rollout()
    return _default(task, resources)


_default: Any = None
