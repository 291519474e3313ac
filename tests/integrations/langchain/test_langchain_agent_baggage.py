"""Each LangGraph node's LLM calls reach the gateway naming that node as the calling agent.

The integration puts the agent's name in the W3C baggage (``agl.agent``) while the node runs, the
openai integration sends it with each request, and the gateway records it on its server span
(``agl.llm.agent``): the name a backend with an adapter per agent serves the call by. Real LangGraph,
real ``ChatOpenAI``, agl's gateway with the scripted backend on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

import openai  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.graph import START, MessagesState, StateGraph  # noqa: E402
from lc_support import MODEL, Traced, Tree  # noqa: E402
from test_langchain_spans import INPUT, by_role, llm_for, two_node_graph  # noqa: E402

from agl import semconv as sc  # noqa: E402


def served_agents(tree: Tree) -> list[tuple[str | None, str | None]]:
    """(agent the span tree attributes the call to, agent the gateway saw in the baggage) per call."""
    return [(tree.agent_of(s), s.attributes.get(sc.AGL_LLM_AGENT)) for s in tree.server_chats()]


@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
def test_each_node_calls_as_its_own_agent(traced: Traced, mode: str) -> None:
    traced.backend.policy = by_role
    graph = two_node_graph(llm_for(traced), mode, name="sql_app")
    with traced.rollout() as out:
        if mode == "invoke":
            graph.invoke(INPUT)
        else:
            asyncio.run(graph.ainvoke(INPUT))
    tree: Tree = out["tree"]
    # the nearest agent names the call: the node, not the named graph around it
    assert served_agents(tree) == [("writer", "writer"), ("checker", "checker")], tree.shape()
    assert [r.agent for r, _ in out["record"]] == ["writer", "checker"]  # what the backend was given


def test_instrument_twice_is_once_and_uninstrument_names_no_agent(traced: Traced) -> None:
    """Instrumenting again changes nothing; once LangChain is uninstrumented (openai still is), the
    nodes' calls carry the rollout but no agent: nothing of the agent baggage is left behind."""
    import agl

    traced.backend.policy = by_role
    graph = two_node_graph(llm_for(traced), "invoke")
    assert agl.instrument("langchain", tracer_provider=traced.provider) == ["langchain"]
    with traced.rollout() as out:
        graph.invoke(INPUT)
    assert served_agents(out["tree"]) == [("writer", "writer"), ("checker", "checker")]
    assert agl.uninstrument("langchain") == ["langchain"]
    with traced.rollout() as out:
        graph.invoke(INPUT)
    assert [agent for _, agent in served_agents(out["tree"])] == [None, None]
    assert len(out["tree"].server_chats()) == 2  # still in the rollout: the openai integration's baggage


def test_calls_after_the_graph_name_no_agent(traced: Traced) -> None:
    """A call the application makes after an (async) graph run is nobody's: no agent in its baggage,
    even where LangChain ended the run in a copy of the caller's context."""
    traced.backend.policy = by_role
    graph = two_node_graph(llm_for(traced), "ainvoke")
    client = openai.AsyncOpenAI(base_url=traced.gateway.base_url, api_key="sk-test", max_retries=0)

    async def run() -> Any:
        await graph.ainvoke(INPUT)
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "judge: score it"}]
        )

    with traced.rollout() as out:
        asyncio.run(run())
    tree: Tree = out["tree"]
    assert served_agents(tree) == [("writer", "writer"), ("checker", "checker"), (None, None)], tree.shape()


@pytest.mark.parametrize("adapter_gateway", [["writer", "rewriter"]], indirect=True)
def test_each_node_is_served_by_its_own_adapter(adapter_gateway: Any, agl_tracer: Any) -> None:
    """The whole way: a tiny random Llama with a LoRA adapter per trained agent behind the gateway;
    each LangGraph node's calls are served by its own adapter, an untrained node's by the base model."""
    assert agl_tracer.instrument("openai", "langchain") == ["openai", "langchain"]
    llm = ChatOpenAI(
        model=adapter_gateway.MODEL,
        base_url=adapter_gateway.url,
        api_key="sk-test",
        max_retries=0,
        max_tokens=3,
    )

    def node(role: str) -> Any:
        def run(state: Any) -> dict[str, Any]:
            return {"messages": [llm.invoke([("system", f"{role}: go"), *state["messages"]])]}

        return run

    g = StateGraph(MessagesState)
    for role in ("writer", "rewriter", "checker"):  # checker is not trained: no adapter of its own
        g.add_node(role, node(role))
    g.add_edge(START, "writer")
    g.add_edge("writer", "rewriter")
    g.add_edge("rewriter", "checker")
    graph = g.compile()
    rid = adapter_gateway.run(lambda: graph.invoke(INPUT))
    assert adapter_gateway.served(rid) == [
        ("writer", "writer"),
        ("rewriter", "rewriter"),
        ("checker", sc.BASE_ADAPTER),
    ]
