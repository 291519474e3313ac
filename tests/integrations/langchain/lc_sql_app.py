"""A text-to-SQL LangGraph app written the way people write them, with no agl code in it.

``writer`` turns a question into SQL; ``checker`` reviews it by calling the ``execute_sql`` tool
(run by a ``ToolNode``) — the tool fails on SQL that SQLite refuses — and gives a verdict;
``rewriter`` fixes the query when the checker says it is wrong; at most ``MAX_TURNS`` rewrites.
The same graph runs sync or async, with or without token streaming.

Also here: the database, the tasks with gold SQL, the reward (execution match), and the scripted
policy the gateway plays for the three agents (its replies depend on each agent's system prompt).
"""

from __future__ import annotations

import json
import re
import sqlite3
from typing import Annotated, Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, RemoveMessage, SystemMessage
from langchain_core.tools import ToolException, tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import REMOVE_ALL_MESSAGES, add_messages
from langgraph.prebuilt import ToolNode
from typing_extensions import TypedDict

from agl.gateway.testing import reply, tool_call

MAX_TURNS = 3
WRITER = "You are the SQL writer. Write one SQLite query that answers the question."
CHECKER = "You are the SQL checker. Run the query with execute_sql, then answer CORRECT or WRONG: <why>."
REWRITER = "You are the SQL rewriter. Fix the query given the checker's feedback."

SCHEMA = """
CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT NOT NULL, country TEXT NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, user_id INTEGER NOT NULL, amount REAL NOT NULL);
INSERT INTO users VALUES (1, 'ada', 'uk'), (2, 'linus', 'fi'), (3, 'grace', 'us'), (4, 'alan', 'uk');
INSERT INTO orders VALUES (1, 1, 10.0), (2, 1, 5.5), (3, 3, 7.25), (4, 4, 1.0);
"""

#: question -> (gold SQL, what the scripted writer first writes)
TASKS: dict[str, tuple[str, str]] = {
    "How many users are there?": ("SELECT COUNT(*) FROM users", "SELECT COUNT(*) FROM users"),
    "How many users live in the uk?": (
        "SELECT COUNT(*) FROM users WHERE country = 'uk'",
        "SELECT COUNT(*) FROM user WHERE country = 'uk'",  # no such table: the tool fails
    ),
    "What is the total order amount?": ("SELECT SUM(amount) FROM orders", "SELECT SUM(amount) FROM orders"),
}


def make_db(path: str) -> str:
    with sqlite3.connect(path) as conn:
        conn.executescript(SCHEMA)
    return path


def run_query(db: str, query: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return conn.execute(query).fetchall()


def reward(db: str, question: str, query: str) -> float:
    """Execution match against the gold query."""
    try:
        return 1.0 if run_query(db, query) == run_query(db, TASKS[question][0]) else 0.0
    except sqlite3.Error:
        return 0.0


# ------------------------------------------------------------------------------------ the app


class SQLState(TypedDict, total=False):
    question: str
    query: str
    verdict: str
    turns: int
    review: Annotated[list[BaseMessage], add_messages]  # the checker's conversation with its tool


def _sql(text: str) -> str:
    match = re.search(r"```(?:sql)?\s*(.*?)```", text, re.S)
    return (match.group(1) if match else text).strip()


def build_app(llm: ChatOpenAI, db: str, *, asynchronous: bool = False, streaming: bool = False) -> Any:
    @tool
    def execute_sql(query: str) -> str:
        """Execute a SQLite query and return its rows as JSON."""
        try:
            return json.dumps(run_query(db, query))
        except sqlite3.Error as exc:
            raise ToolException(f"SQL error: {exc}") from exc

    execute_sql.handle_tool_error = True  # the checker sees the error message and judges the query
    checker_llm = llm.bind_tools([execute_sql])

    def call(model: Any, messages: list[BaseMessage]) -> AIMessage:
        if not streaming:
            return model.invoke(messages)
        message = None
        for chunk in model.stream(messages):
            message = chunk if message is None else message + chunk
        return AIMessage(content=message.content, tool_calls=message.tool_calls)

    async def acall(model: Any, messages: list[BaseMessage]) -> AIMessage:
        if not streaming:
            return await model.ainvoke(messages)
        message = None
        async for chunk in model.astream(messages):
            message = chunk if message is None else message + chunk
        return AIMessage(content=message.content, tool_calls=message.tool_calls)

    def writer_messages(state: SQLState) -> list[BaseMessage]:
        return [SystemMessage(WRITER), HumanMessage(state["question"])]

    def checker_messages(state: SQLState) -> list[BaseMessage]:
        ask = HumanMessage(f"Question: {state['question']}\nSQL: {state['query']}")
        return [SystemMessage(CHECKER), ask, *state.get("review", [])]

    def rewriter_messages(state: SQLState) -> list[BaseMessage]:
        ask = f"Question: {state['question']}\nSQL: {state['query']}\nFeedback: {state['verdict']}"
        return [SystemMessage(REWRITER), HumanMessage(ask)]

    def after_check(message: AIMessage) -> dict[str, Any]:
        if message.tool_calls:
            return {"review": [message]}
        return {"review": [message], "verdict": str(message.content)}

    def after_rewrite(state: SQLState, message: AIMessage) -> dict[str, Any]:
        return {
            "query": _sql(str(message.content)),
            "turns": state.get("turns", 0) + 1,
            "review": [RemoveMessage(id=REMOVE_ALL_MESSAGES)],
        }

    if asynchronous:

        async def writer(state: SQLState) -> dict[str, Any]:
            return {"query": _sql(str((await acall(llm, writer_messages(state))).content)), "turns": 0}

        async def checker(state: SQLState) -> dict[str, Any]:
            return after_check(await acall(checker_llm, checker_messages(state)))

        async def rewriter(state: SQLState) -> dict[str, Any]:
            return after_rewrite(state, await acall(llm, rewriter_messages(state)))

    else:

        def writer(state: SQLState) -> dict[str, Any]:
            return {"query": _sql(str(call(llm, writer_messages(state)).content)), "turns": 0}

        def checker(state: SQLState) -> dict[str, Any]:
            return after_check(call(checker_llm, checker_messages(state)))

        def rewriter(state: SQLState) -> dict[str, Any]:
            return after_rewrite(state, call(llm, rewriter_messages(state)))

    def route(state: SQLState) -> str:
        last = state["review"][-1]
        if isinstance(last, AIMessage) and last.tool_calls:
            return "tools"
        if state["verdict"].startswith("CORRECT") or state.get("turns", 0) >= MAX_TURNS:
            return END
        return "rewriter"

    graph = StateGraph(SQLState)
    graph.add_node("writer", writer)
    graph.add_node("checker", checker)
    graph.add_node("tools", ToolNode([execute_sql], messages_key="review"))
    graph.add_node("rewriter", rewriter)
    graph.add_edge(START, "writer")
    graph.add_edge("writer", "checker")
    graph.add_conditional_edges("checker", route, ["tools", "rewriter", END])
    graph.add_edge("tools", "checker")
    graph.add_edge("rewriter", "checker")
    return graph.compile()


# ------------------------------------------------------------------------- the scripted policy


def policy(request: Any) -> Any:
    """What the model says, per agent: the writer's first try from TASKS, the checker runs the query
    and judges the tool's answer, the rewriter writes the gold query."""
    messages = request.messages
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
    ask = next(m["content"] for m in messages if m["role"] == "user")
    if system == WRITER:
        return f"```sql\n{TASKS[ask][1]}\n```"
    if system == REWRITER:
        question = ask.split("\n")[0].removeprefix("Question: ")
        return f"```sql\n{TASKS[question][0]}\n```"
    if system == CHECKER:
        last = messages[-1]
        if last["role"] != "tool":
            query = ask.split("\nSQL: ", 1)[1]
            return reply(None, tool_call("execute_sql", query=query))
        content = last["content"]
        return f"WRONG: {content}" if content.startswith("SQL error") else "CORRECT"
    raise AssertionError(f"unexpected prompt: {messages}")


def expected_agents(question: str) -> list[str]:
    """The agents of the LLM calls one rollout of ``question`` makes, in order."""
    gold, first = TASKS[question]
    calls = ["writer", "checker", "checker"]
    if first != gold:
        calls += ["rewriter", "checker", "checker"]
    return calls
