"""Span trees of real LangChain/LangGraph runs against agl's gateway: agents, tools, LLM calls nested.

Every test runs the real framework with ``ChatOpenAI`` pointed at the gateway's scripted backend on
127.0.0.1 and reads the rollout's spans back from the SQLite store: agl's ``invoke_agent`` /
``execute_tool`` spans, the openai integration's client ``chat`` spans and the gateway's server
``chat`` spans (joined through ``traceparent``).
"""

from __future__ import annotations

import asyncio
import json
import warnings
from collections import Counter
from typing import Any

import httpx
import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

from langchain_core.messages import AIMessage, AIMessageChunk  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.tools import StructuredTool, ToolException, tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.graph import END, START, MessagesState, StateGraph  # noqa: E402
from langgraph.prebuilt import ToolNode  # noqa: E402
from lc_support import MODEL, Traced, Tree, system_prompt  # noqa: E402
from opentelemetry import trace  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from agl import semconv as sc  # noqa: E402
from agl.gateway.testing import reply, tool_call  # noqa: E402

INPUT = {"messages": [("user", "How many users are there?")]}


def llm_for(traced: Traced, **kw: Any) -> ChatOpenAI:
    # a fresh async HTTP client per model: langchain-openai caches one per base URL, and a cached one
    # stays bound to the (closed) event loop of the previous test's asyncio.run
    return ChatOpenAI(
        model=MODEL,
        base_url=traced.gateway.base_url,
        api_key="sk-test",
        max_retries=0,
        http_async_client=httpx.AsyncClient(),
        **kw,
    )


def by_role(request: Any) -> Any:
    """The scripted policy of the writer/checker graphs: the reply depends on the agent's prompt."""
    prompt = system_prompt(request)
    if prompt.startswith("writer"):
        return "SELECT COUNT(*) FROM users"
    if prompt.startswith("checker"):
        return "the query is correct"
    return f"reply to {prompt or 'no prompt'}"


def two_node_graph(llm: ChatOpenAI, mode: str, name: str | None = None) -> Any:
    """writer -> checker, each node one LLM call made the way ``mode`` says."""

    def make(role: str) -> Any:
        def sync_node(state: MessagesState) -> dict[str, Any]:
            messages = [("system", f"{role}: do your job"), *state["messages"]]
            if mode == "stream":
                chunks = list(llm.stream(messages))
                assert all(isinstance(c, AIMessageChunk) for c in chunks)
                message = chunks[0]
                for c in chunks[1:]:
                    message = message + c
                return {"messages": [AIMessage(content=message.content)]}
            return {"messages": [llm.invoke(messages)]}

        async def async_node(state: MessagesState) -> dict[str, Any]:
            messages = [("system", f"{role}: do your job"), *state["messages"]]
            if mode == "astream":
                text = ""
                async for chunk in llm.astream(messages):
                    text += chunk.content
                return {"messages": [AIMessage(content=text)]}
            return {"messages": [await llm.ainvoke(messages)]}

        return async_node if mode.startswith("a") else sync_node

    g = StateGraph(MessagesState)
    g.add_node("writer", make("writer"))
    g.add_node("checker", make("checker"))
    g.add_edge(START, "writer")
    g.add_edge("writer", "checker")
    g.add_edge("checker", END)
    return g.compile(name=name) if name else g.compile()


def assert_llm_calls_nested(tree: Tree, record: list[Any], expected: Counter[str]) -> None:
    """Every LLM call: one client chat span under the agent whose prompt it carries, one server span
    under it with exactly the ids the backend produced."""
    seen: Counter[str] = Counter()
    for client in tree.client_chats():
        agent = tree.agent_of(client)
        assert agent is not None, tree.shape()
        assert tree.parent(client).name == sc.SPAN_INVOKE_AGENT, tree.shape()
        messages = json.loads(client.attributes[sc.GEN_AI_INPUT_MESSAGES])
        assert messages[0]["role"] == "system" and messages[0]["content"].startswith(agent), (agent, messages)
        servers = tree.children(client, sc.SPAN_CHAT)
        assert len(servers) == 1 and servers[0].attributes[sc.AGL_SIDE] == sc.SIDE_SERVER, tree.shape()
        # the request's baggage named the same agent (the gateway serves it with that agent's adapter)
        assert servers[0].attributes.get(sc.AGL_LLM_AGENT) == agent, tree.shape()
        seen[agent] += 1
    assert seen == expected, tree.shape()
    engine = Counter(
        (tuple(result.prompt_ids), tuple(result.choices[0].response_ids)) for _, result in record
    )
    spans = Counter(
        (tuple(s.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS]), tuple(s.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]))
        for s in tree.server_chats()
    )
    assert spans == engine and sum(engine.values()) == sum(expected.values())


MODES = ["invoke", "stream", "batch", "ainvoke", "astream", "astream_events", "abatch"]


@pytest.mark.parametrize("mode", MODES)
def test_graph_nodes_are_agents_and_llm_calls_nest_under_them(traced: Traced, mode: str) -> None:
    traced.backend.policy = by_role
    graph = two_node_graph(llm_for(traced), mode)
    runs = 2 if mode.endswith("batch") else 1
    events: list[str] = []

    async def run_async() -> None:
        if mode == "ainvoke":
            await graph.ainvoke(INPUT)
        elif mode == "astream":
            async for _ in graph.astream(INPUT, stream_mode=["messages", "updates"]):
                pass
        elif mode == "astream_events":
            async for event in graph.astream_events(INPUT, version="v2"):
                events.append(event["event"])
        else:
            await graph.abatch([INPUT] * runs)

    with traced.rollout() as out:
        if mode == "invoke":
            result = graph.invoke(INPUT)
            assert result["messages"][-1].content == "the query is correct"
        elif mode == "stream":
            chunks = list(graph.stream(INPUT, stream_mode="messages"))
            assert chunks, "stream_mode=messages yields the LLM's tokens"
        elif mode == "batch":
            graph.batch([INPUT] * runs)
        else:
            asyncio.run(run_async())
    tree: Tree = out["tree"]
    agents = Counter(s.attributes[sc.GEN_AI_AGENT_NAME] for s in tree.agents())
    assert agents == Counter({"writer": runs, "checker": runs}), tree.shape()
    for agent in tree.agents():
        assert agent.attributes[sc.GEN_AI_OPERATION_NAME] == sc.OP_INVOKE_AGENT
        assert agent.attributes[sc.AGL_LANGGRAPH_NODE] == agent.attributes[sc.GEN_AI_AGENT_NAME]
        assert agent.status.code != "ERROR"
    assert_llm_calls_nested(tree, out["record"], Counter({"writer": runs, "checker": runs}))
    if mode == "astream_events":
        assert "on_chat_model_end" in events  # the framework's own event stream still works


def test_named_graph_is_an_agent_around_its_nodes(traced: Traced) -> None:
    traced.backend.policy = by_role
    with traced.rollout() as out:
        two_node_graph(llm_for(traced), "invoke", name="sql_app").invoke(INPUT)
    tree: Tree = out["tree"]
    (app,) = tree.agents("sql_app")
    assert [s.attributes[sc.GEN_AI_AGENT_NAME] for s in tree.children(app)] == ["writer", "checker"]
    assert tree.parent(app).name == sc.SPAN_ROLLOUT  # nested under the rollout's span
    assert_llm_calls_nested(tree, out["record"], Counter({"writer": 1, "checker": 1}))


def test_structured_output_and_batch_inside_nodes(traced: Traced) -> None:
    class Query(BaseModel):
        sql: str
        safe: bool

    def policy(request: Any) -> Any:
        prompt = system_prompt(request)
        if prompt.startswith("writer"):
            assert request.response_format is not None  # with_structured_output asked for JSON
            return json.dumps({"sql": "SELECT 1", "safe": True})
        return "fine"

    traced.backend.policy = policy
    llm = llm_for(traced)

    def writer(state: MessagesState) -> dict[str, Any]:
        query = llm.with_structured_output(Query).invoke(
            [("system", "writer: json please"), *state["messages"]]
        )
        assert query == Query(sql="SELECT 1", safe=True)
        return {"messages": [AIMessage(content=query.sql)]}

    def checker(state: MessagesState) -> dict[str, Any]:
        replies = llm.batch([[("system", "checker: one")], [("system", "checker: two")]])
        return {"messages": replies}

    g = StateGraph(MessagesState)
    g.add_node("writer", writer)
    g.add_node("checker", checker)
    g.add_edge(START, "writer")
    g.add_edge("writer", "checker")
    with traced.rollout() as out:
        g.compile().invoke(INPUT)
    assert_llm_calls_nested(out["tree"], out["record"], Counter({"writer": 1, "checker": 2}))


# ------------------------------------------------------------------------------------- tools


def sql_tool() -> Any:
    @tool
    def run_sql(query: str) -> str:
        """Run a SQL query against the database."""
        if "DROP" in query:
            raise ToolException("refusing to drop tables")
        return "42"

    run_sql.handle_tool_error = True  # the model gets the error text; the call still failed
    return run_sql


def tool_policy(request: Any) -> Any:
    """One parallel batch of tool calls (good, failing, unknown tool), then an answer."""
    if request.messages[-1]["role"] != "tool":
        return reply(
            None,
            tool_call("run_sql", query="SELECT COUNT(*) FROM users", id="call_good"),
            tool_call("run_sql", query="DROP TABLE users", id="call_bad"),
            tool_call("no_such_tool", query="x", id="call_unknown"),
        )
    return "there are 42 users"


def assert_tool_spans(tree: Tree, agent: str) -> None:
    tools = {s.attributes[sc.GEN_AI_TOOL_CALL_ID]: s for s in tree.tools()}
    assert set(tools) == {"call_good", "call_bad", "call_unknown"}, tree.shape()
    good, bad, unknown = tools["call_good"], tools["call_bad"], tools["call_unknown"]
    assert good.status.code != "ERROR" and good.attributes[sc.GEN_AI_TOOL_CALL_RESULT] == "42"
    assert json.loads(good.attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS]) == {
        "query": "SELECT COUNT(*) FROM users"
    }
    assert bad.status.code == "ERROR" and "refusing to drop" in bad.status.message
    assert bad.attributes[sc.GEN_AI_TOOL_NAME] == "run_sql"
    assert unknown.status.code == "ERROR" and unknown.attributes[sc.GEN_AI_TOOL_NAME] == "no_such_tool"
    for span in tools.values():
        assert span.attributes[sc.GEN_AI_OPERATION_NAME] == sc.OP_EXECUTE_TOOL
        assert tree.agent_of(span) == agent, tree.shape()
    # the ids are the ones the model issued: the first LLM call's output carries all three
    first = tree.client_chats()[0]
    issued = {tc["id"] for tc in json.loads(first.attributes[sc.GEN_AI_OUTPUT_MESSAGES])[0]["tool_calls"]}
    assert issued == set(tools)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_create_agent_parallel_tool_calls(traced: Traced, asynchronous: bool) -> None:
    from langchain.agents import create_agent

    traced.backend.policy = tool_policy
    agent = create_agent(
        llm_for(traced), [sql_tool()], system_prompt="helper: answer with SQL", name="helper"
    )
    with traced.rollout() as out:
        if asynchronous:
            result = asyncio.run(agent.ainvoke(INPUT))
        else:
            result = agent.invoke(INPUT)
    assert result["messages"][-1].content == "there are 42 users"
    tree: Tree = out["tree"]
    (helper,) = tree.agents()  # the prebuilt loop's nodes are turns of "helper", not agents
    assert helper.attributes[sc.GEN_AI_AGENT_NAME] == "helper"
    assert_tool_spans(tree, "helper")
    assert_llm_calls_nested(tree, out["record"], Counter({"helper": 2}))


def test_create_react_agent_named_and_as_subgraph(traced: Traced) -> None:
    with warnings.catch_warnings():  # deprecated in LangGraph 1.x in favour of create_agent; still used
        warnings.simplefilter("ignore", DeprecationWarning)
        from langgraph.prebuilt import create_react_agent

        researcher = create_react_agent(
            llm_for(traced), [sql_tool()], prompt="researcher: look it up", name="researcher"
        )
    traced.backend.policy = tool_policy

    def supervisor(state: MessagesState) -> dict[str, Any]:  # an agent invoked inside a node
        return {"messages": researcher.invoke(state)["messages"][-1:]}

    g = StateGraph(MessagesState)
    g.add_node("supervisor", supervisor)
    g.add_edge(START, "supervisor")
    with traced.rollout() as out:
        g.compile().invoke(INPUT)
    tree: Tree = out["tree"]
    # one agent span per turn: the node that only runs the prebuilt agent is that agent's turn, named
    # by the agent (the node stays on the span)
    assert tree.agents("supervisor") == []
    (res,) = tree.agents("researcher")
    assert res.attributes[sc.AGL_LANGGRAPH_NODE] == "supervisor"
    assert_tool_spans(tree, "researcher")
    assert_llm_calls_nested(tree, out["record"], Counter({"researcher": 2}))


def test_unnamed_prebuilt_agent_as_a_node_takes_the_node_name(traced: Traced) -> None:
    from langchain.agents import create_agent

    traced.backend.policy = by_role
    g = StateGraph(MessagesState)
    g.add_node("writer", create_agent(llm_for(traced), [], system_prompt="writer: write"))
    g.add_node("checker", create_agent(llm_for(traced), [], system_prompt="checker: check", name="checker"))
    g.add_edge(START, "writer")
    g.add_edge("writer", "checker")
    with traced.rollout() as out:
        g.compile().invoke(INPUT)
    tree: Tree = out["tree"]
    # writer: the node (its subgraph is unnamed, its "model" node a turn); checker: the node and its
    # same-named agent are one agent turn, one span
    assert Counter(s.attributes[sc.GEN_AI_AGENT_NAME] for s in tree.agents()) == Counter(
        {"writer": 1, "checker": 1}
    ), tree.shape()
    assert_llm_calls_nested(tree, out["record"], Counter({"writer": 1, "checker": 1}))


def test_run_name_names_a_top_level_chain(traced: Traced) -> None:
    traced.backend.policy = by_role
    chain = ChatPromptTemplate.from_messages([("system", "writer: {task}"), ("user", "{q}")]) | llm_for(
        traced
    )
    with traced.rollout() as out:
        chain.invoke({"task": "sql", "q": "count users"}, config={"run_name": "writer"})
        chain.invoke({"task": "sql", "q": "count users"})  # unnamed: no agent span
    tree: Tree = out["tree"]
    assert [s.attributes[sc.GEN_AI_AGENT_NAME] for s in tree.agents()] == ["writer"], tree.shape()
    chats = tree.client_chats()
    assert len(chats) == 2
    assert tree.agent_of(chats[0]) == "writer" and tree.agent_of(chats[1]) is None


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_tool_errors(traced: Traced, asynchronous: bool) -> None:
    def lookup(key: str) -> str:
        """Look a key up."""
        if key == "boom":
            raise ValueError("no such key")
        if key == "handled":
            raise ToolException("handled failure")
        return key.upper()

    raising = StructuredTool.from_function(lookup, name="lookup")
    handled = StructuredTool.from_function(lookup, name="lookup_handled", handle_tool_error=True)
    node = ToolNode([raising], handle_tool_errors=True, name="run_tools")  # catches anything, reports it
    g = StateGraph(MessagesState)
    g.add_node("run_tools", node)
    g.add_edge(START, "run_tools")
    graph = g.compile()
    calls = AIMessage(
        content="",
        tool_calls=[
            {"name": "lookup", "args": {"key": "boom"}, "id": "c_raise"},
            {"name": "lookup", "args": {"key": "ok"}, "id": "c_ok"},
            {"name": "lookup", "args": {}, "id": "c_invalid"},
        ],
    )

    async def run_async() -> Any:
        out = await graph.ainvoke({"messages": [calls]})
        with pytest.raises(ValueError, match="no such key"):
            await raising.ainvoke({"key": "boom"})
        await handled.ainvoke(
            {"type": "tool_call", "name": "lookup_handled", "args": {"key": "handled"}, "id": "c_handled"}
        )
        return out

    with traced.rollout() as out:
        if asynchronous:
            result = asyncio.run(run_async())
        else:
            result = graph.invoke({"messages": [calls]})
            with pytest.raises(ValueError, match="no such key"):
                raising.invoke({"key": "boom"})
            handled.invoke(
                {"type": "tool_call", "name": "lookup_handled", "args": {"key": "handled"}, "id": "c_handled"}
            )
    statuses = {m.tool_call_id: m.status for m in result["messages"][1:]}
    assert statuses == {"c_raise": "error", "c_ok": "success", "c_invalid": "error"}
    tree: Tree = out["tree"]
    tools = tree.tools()
    assert len(tools) == 5, tree.shape()
    by_id = {s.attributes.get(sc.GEN_AI_TOOL_CALL_ID): s for s in tools}
    assert (
        by_id["c_ok"].status.code != "ERROR" and by_id["c_ok"].attributes[sc.GEN_AI_TOOL_CALL_RESULT] == "OK"
    )
    raised = by_id["c_raise"]
    assert raised.status.code == "ERROR" and "no such key" in raised.status.message
    assert [e.name for e in raised.events] == [sc.EVENT_EXCEPTION]
    assert raised.attributes[sc.ERROR_TYPE] == "ValueError"
    assert by_id["c_invalid"].status.code == "ERROR"  # argument validation failed
    assert (
        by_id["c_handled"].status.code == "ERROR" and by_id["c_handled"].status.message == "handled failure"
    )
    direct = by_id[None]  # a plain tool.invoke that raised: no call id, still an ERROR span
    assert direct.status.code == "ERROR" and direct.attributes[sc.GEN_AI_TOOL_NAME] == "lookup"
    (node_span,) = tree.agents("run_tools")
    assert node_span.status.code != "ERROR"  # ToolNode handled the errors: the node itself succeeded
    for tid in ("c_raise", "c_ok", "c_invalid"):
        assert tree.agent_of(by_id[tid]) == "run_tools"


def test_failing_node_marks_its_agent_span(traced: Traced) -> None:
    traced.backend.policy = by_role
    llm = llm_for(traced)

    def writer(state: MessagesState) -> dict[str, Any]:
        llm.invoke([("system", "writer: go")])
        raise RuntimeError("node bug")

    g = StateGraph(MessagesState)
    g.add_node("writer", writer)
    g.add_edge(START, "writer")
    with traced.rollout() as out:
        with pytest.raises(RuntimeError, match="node bug"):
            g.compile(name="app").invoke(INPUT)
    tree: Tree = out["tree"]
    (writer_span,) = tree.agents("writer")
    assert writer_span.status.code == "ERROR" and "node bug" in writer_span.status.message
    assert tree.agent_of(tree.client_chats()[0]) == "writer"


# --------------------------------------------------------------------------- context hygiene


def test_context_is_restored_after_runs(traced: Traced) -> None:
    """After a run the caller's span is current again: sync exactly, async (where LangChain ends runs
    in a copied context) at least in meaning — later spans never nest under a finished agent."""
    traced.backend.policy = by_role
    graph = two_node_graph(llm_for(traced), "ainvoke", name="app")
    sync_graph = two_node_graph(llm_for(traced), "invoke", name="app")
    tracer = traced.provider.get_tracer("test")

    async def twice() -> None:
        with tracer.start_as_current_span("caller") as caller:
            await graph.ainvoke(INPUT)
            assert trace.get_current_span().get_span_context() == caller.get_span_context()
            await graph.ainvoke(INPUT)
            with tracer.start_as_current_span("after"):
                pass

    with traced.rollout() as out:
        asyncio.run(twice())
        with tracer.start_as_current_span("sync_caller") as caller:
            sync_graph.invoke(INPUT)
            assert trace.get_current_span() is caller
    tree: Tree = out["tree"]
    (caller_span,) = tree.named("caller")
    apps = tree.agents("app")
    assert len(apps) == 3
    assert [tree.parent(a).name for a in apps] == ["caller", "caller", "sync_caller"], tree.shape()
    (after,) = tree.named("after")
    assert after.parent_id == caller_span.span_id
    assert_llm_calls_nested(tree, out["record"], Counter({"writer": 3, "checker": 3}))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "tasks"])
def test_parallel_nodes_keep_their_own_context(traced: Traced, asynchronous: bool) -> None:
    """Nodes of one super-step run at once (threads for sync graphs, tasks for async ones): each LLM
    call still nests under its own node."""
    traced.backend.policy = by_role
    llm = llm_for(traced)
    roles = ["writer", "checker", "rewriter"]

    def node(role: str) -> Any:
        def run(state: MessagesState) -> dict[str, Any]:
            return {"messages": [llm.invoke([("system", f"{role}: go"), *state["messages"]])]}

        async def arun(state: MessagesState) -> dict[str, Any]:
            return {"messages": [await llm.ainvoke([("system", f"{role}: go"), *state["messages"]])]}

        return arun if asynchronous else run

    g = StateGraph(MessagesState)
    for role in roles:
        g.add_node(role, node(role))
        g.add_edge(START, role)
    graph = g.compile()
    with traced.rollout() as out:
        if asynchronous:
            asyncio.run(graph.ainvoke(INPUT))
        else:
            graph.invoke(INPUT)
    assert_llm_calls_nested(out["tree"], out["record"], Counter(dict.fromkeys(roles, 1)))


def test_responses_api_calls_nest_too(traced: Traced) -> None:
    traced.backend.policy = by_role
    graph = two_node_graph(llm_for(traced, use_responses_api=True), "invoke")
    with traced.rollout() as out:
        graph.invoke(INPUT)
    assert_llm_calls_nested(out["tree"], out["record"], Counter({"writer": 1, "checker": 1}))


def test_agl_agent_metadata_names_a_nested_chain(traced: Traced) -> None:
    traced.backend.policy = by_role
    llm = llm_for(traced)
    critic = ChatPromptTemplate.from_messages([("system", "checker: criticise"), ("user", "{draft}")]) | llm

    def writer(state: MessagesState) -> dict[str, Any]:
        draft = llm.invoke([("system", "writer: draft"), *state["messages"]])
        critic.invoke({"draft": draft.content}, config={"metadata": {"agl_agent": "checker"}})
        return {"messages": [draft]}

    g = StateGraph(MessagesState)
    g.add_node("writer", writer)
    g.add_edge(START, "writer")
    with traced.rollout() as out:
        g.compile().invoke(INPUT)
    tree: Tree = out["tree"]
    (writer_span,) = tree.agents("writer")
    (checker_span,) = tree.agents("checker")  # one span, though its children inherit the metadata
    assert checker_span.parent_id == writer_span.span_id
    assert_llm_calls_nested(tree, out["record"], Counter({"writer": 1, "checker": 1}))


def test_hand_written_tool_node_reporting_errors(traced: Traced) -> None:
    """A node that runs tools itself and reports failures as error ToolMessages: one ERROR span per
    failed call, carrying the call id the node reported (also what older langchain-core needs, which
    does not tell callbacks the id of a tool that raised), and a synthetic one for a call it refused."""
    from langchain_core.messages import ToolMessage

    @tool
    def lookup(key: str) -> str:
        """Look a key up."""
        raise ValueError(f"no such key: {key}")

    def run_tools(state: MessagesState) -> dict[str, Any]:
        replies = []
        try:
            lookup.invoke({"key": "k1"})  # called with plain arguments: LangChain knows no call id
        except ValueError as exc:
            replies.append(ToolMessage(str(exc), tool_call_id="c_1", name="lookup", status="error"))
        replies.append(ToolMessage("unknown tool", tool_call_id="c_2", name="search", status="error"))
        return {"messages": replies}

    g = StateGraph(MessagesState)
    g.add_node("run_tools", run_tools)
    g.add_edge(START, "run_tools")
    with traced.rollout() as out:
        g.compile().invoke(INPUT)
    tree: Tree = out["tree"]
    spans = {s.attributes.get(sc.GEN_AI_TOOL_CALL_ID): s for s in tree.tools()}
    assert set(spans) == {"c_1", "c_2"}, tree.shape()
    assert spans["c_1"].attributes[sc.GEN_AI_TOOL_NAME] == "lookup" and spans["c_1"].status.code == "ERROR"
    assert [e.name for e in spans["c_1"].events] == [sc.EVENT_EXCEPTION]
    assert spans["c_2"].attributes[sc.GEN_AI_TOOL_NAME] == "search" and spans["c_2"].status.code == "ERROR"
    assert all(tree.agent_of(s) == "run_tools" for s in spans.values())
    assert spans["c_1"].end_ns <= spans["c_2"].start_ns  # the deferred span keeps its own end time


def test_llm_call_from_a_thread_that_lost_the_context(traced: Traced) -> None:
    """A node hands its config to a plain thread (no context copied): the run tree still knows the
    node, so the tool's span and the LLM call (whose start puts the node's span and the rollout's
    baggage back into that thread's context) still nest under it, in the rollout."""
    import threading

    from langchain_core.runnables import RunnableConfig

    traced.backend.policy = by_role
    llm = llm_for(traced)

    run_sql = sql_tool()

    def work(box: list[Any], config: RunnableConfig) -> None:
        box.append(llm.invoke([("system", "writer: go")], config))
        run_sql.invoke({"query": "SELECT 1"}, config)

    def writer(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        box: list[Any] = []
        thread = threading.Thread(target=work, args=(box, config))
        thread.start()
        thread.join()
        return {"messages": box}

    g = StateGraph(MessagesState)
    g.add_node("writer", writer)
    g.add_edge(START, "writer")
    with traced.rollout() as out:
        g.compile().invoke(INPUT)
    assert_llm_calls_nested(out["tree"], out["record"], Counter({"writer": 1}))
    (tool_span,) = out["tree"].tools()  # stored with the rollout, under the node
    assert out["tree"].agent_of(tool_span) == "writer"
