"""``ChatAnthropic`` (langchain-anthropic, the real anthropic SDK) inside a LangGraph node, through agl's
gateway Messages API: the call is attributed to its node and carries the engine's exact ids."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("langgraph")
langchain_anthropic = pytest.importorskip("langchain_anthropic")

from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langgraph.graph import END, START, MessagesState, StateGraph  # noqa: E402
from lc_support import Traced  # noqa: E402

from agl import semconv as sc  # noqa: E402
from agl.adapter import Adapter  # noqa: E402


@pytest.mark.parametrize("streaming", [False, True])
def test_chat_anthropic_in_a_node_is_attributed_to_it(
    traced: Traced, agl_tracer: Any, streaming: bool
) -> None:
    agl_tracer.instrument("anthropic")
    traced.backend.policy = lambda request: "SELECT 1"
    llm = langchain_anthropic.ChatAnthropic(
        model="scripted",
        base_url=traced.gateway.base_url.root,
        api_key="x",
        max_tokens=64,
        max_retries=0,
        streaming=streaming,
    )

    def writer(state: MessagesState) -> dict[str, Any]:
        return {"messages": [llm.invoke([SystemMessage("writer: write SQL"), *state["messages"]])]}

    g = StateGraph(MessagesState)
    g.add_node("writer", writer)
    g.add_edge(START, "writer")
    g.add_edge("writer", END)
    graph = g.compile()
    with traced.rollout() as out:
        result = graph.invoke({"messages": [HumanMessage("one row please")]})
    assert result["messages"][-1].content == "SELECT 1"
    tree = out["tree"]
    (server,) = tree.server_chats()
    assert server.attributes[sc.AGL_LLM_API] == "messages"
    (agent,) = tree.agents()
    assert agent.attributes[sc.AGL_LANGGRAPH_NODE] == "writer"
    (_, engine) = out["record"][0]
    assert list(server.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS]) == engine.prompt_ids
    assert list(server.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]) == engine.choices[0].response_ids
    clients = [c for c in tree.client_chats() if c.attributes.get(sc.AGL_INTEGRATION) == "anthropic"]
    assert len(clients) == 1 and clients[0].trace_id == server.trace_id, tree.shape()
    # the anthropic SDK's own call span may sit between the two (in the global tracer provider, not
    # this store): the adapter still makes one call of them, attributed to the node
    (t,) = Adapter().transitions(out["spans"])
    assert t.agent == "writer" and t.exact
