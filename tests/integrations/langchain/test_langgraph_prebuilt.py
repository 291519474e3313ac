"""LangGraph's prebuilt multi-agent graphs, as their READMEs write them, run unchanged through agl: one
``invoke_agent`` span per agent turn (the swarm's and the supervisor's agents are a node and a subgraph
of the same name; a node often just runs one ``create_react_agent``), every LLM call exact and
attributed, selectable by the agent names people see.

The programs hard-code ``ChatOpenAI(model="gpt-4o")`` and reach agl's real gateway (scripted engine)
through ``OPENAI_BASE_URL`` alone.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

from langchain_openai import ChatOpenAI  # noqa: E402
from lc_support import Traced, Tree  # noqa: E402

from agl import semconv as sc  # noqa: E402
from agl.adapter import Adapter  # noqa: E402
from agl.gateway.testing import reply, tool_call  # noqa: E402


@pytest.fixture
def env_model(traced: Traced, monkeypatch: pytest.MonkeyPatch) -> ChatOpenAI:
    """The README's ``ChatOpenAI(model="gpt-4o")``, pointed at the gateway by the environment only."""
    monkeypatch.setenv("OPENAI_BASE_URL", str(traced.gateway.base_url))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-agl-test")
    return ChatOpenAI(model="gpt-4o")


def _react_agent(*args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():  # deprecated in LangGraph 1.x for create_agent; the READMEs use it
        warnings.simplefilter("ignore")
        from langgraph.prebuilt import create_react_agent

        return create_react_agent(*args, **kwargs)


def _scripted(traced: Traced, replies: list[Any]) -> None:
    queue = iter(replies)
    traced.backend.policy = lambda request: next(queue)


def assert_one_span_per_turn(out: dict[str, Any], turns: list[str]) -> None:
    """The agent spans, in order, are ``turns``; none sits directly inside another; every LLM call is
    exact and attributed the same way by the span tree and by the baggage the gateway saw."""
    tree: Tree = out["tree"]
    agents = tree.agents()
    assert [s.attributes[sc.GEN_AI_AGENT_NAME] for s in agents] == turns, tree.shape()
    for span in agents:
        parent = tree.parent(span)
        assert parent is None or parent.name != sc.SPAN_INVOKE_AGENT, tree.shape()
    servers = tree.server_chats()
    assert len(servers) == len(out["record"]) > 0
    for server in servers:
        assert server.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS], "exact ids on every call"
        assert server.attributes[sc.GEN_AI_REQUEST_MODEL] == "gpt-4o"  # the name the program hard-codes
        assert tree.agent_of(server) == server.attributes.get(sc.AGL_LLM_AGENT) is not None, tree.shape()


def _selected(traced: Traced, out: dict[str, Any], agents: list[str]) -> Counter[str]:
    adapter = Adapter(agents=agents)
    rollout = traced.store.get_rollout(out["rollout_id"])
    ts = adapter.transitions(out["spans"], rollout=rollout, attempt=out["attempt"])
    assert all(t.exact for t in ts)
    return Counter(t.agent for t in ts)


def test_swarm_readme(traced: Traced, env_model: ChatOpenAI) -> None:
    pytest.importorskip("langgraph_swarm")
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph_swarm import create_handoff_tool, create_swarm

    def add(a: int, b: int) -> int:
        """Add two numbers"""
        return a + b

    alice = _react_agent(
        env_model,
        [add, create_handoff_tool(agent_name="Bob")],
        prompt="You are Alice, an addition expert.",
        name="Alice",
    )
    bob = _react_agent(
        env_model,
        [create_handoff_tool(agent_name="Alice", description="Transfer to Alice, she can help with math")],
        prompt="You are Bob, you speak like a pirate.",
        name="Bob",
    )
    app = create_swarm([alice, bob], default_active_agent="Alice").compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "1"}}
    _scripted(
        traced,
        [
            reply(None, tool_call("transfer_to_bob")),
            reply("Ahoy, matey!"),
            reply(None, tool_call("transfer_to_alice")),
            reply(None, tool_call("add", a=5, b=7)),
            reply("5 + 7 is 12."),
        ],
    )
    with traced.rollout() as out:
        app.invoke({"messages": [{"role": "user", "content": "i'd like to speak to Bob"}]}, config)
        turn2 = app.invoke({"messages": [{"role": "user", "content": "what's 5 + 7?"}]}, config)
    assert turn2["messages"][-1].content == "5 + 7 is 12."
    assert_one_span_per_turn(out, ["Alice", "Bob", "Bob", "Alice"])
    assert _selected(traced, out, ["Alice"]) == Counter({"Alice": 3})
    assert _selected(traced, out, ["Bob"]) == Counter({"Bob": 2})


def test_supervisor_readme(traced: Traced, env_model: ChatOpenAI) -> None:
    pytest.importorskip("langgraph_supervisor")
    from langgraph_supervisor import create_supervisor

    def add(a: float, b: float) -> float:
        """Add two numbers."""
        return a + b

    def web_search(query: str) -> str:
        """Search the web for information."""
        return "Here are the headcounts for each of the FAANG companies in 2024: ..."

    math_agent = _react_agent(
        model=env_model,
        tools=[add],
        name="math_expert",
        prompt="You are a math expert. Always use one tool at a time.",
    )
    research_agent = _react_agent(
        model=env_model,
        tools=[web_search],
        name="research_expert",
        prompt="You are a world class researcher with access to web search. Do not do any math.",
    )
    workflow = create_supervisor(
        [research_agent, math_agent],
        model=env_model,
        prompt="You are a team supervisor managing a research expert and a math expert.",
    )
    app = workflow.compile()
    _scripted(
        traced,
        [
            reply(None, tool_call("transfer_to_research_expert")),
            reply(None, tool_call("web_search", query="FAANG headcount 2024")),
            reply("Meta 67,317; Apple 164,000; ..."),
            reply(None, tool_call("transfer_to_math_expert")),
            reply(None, tool_call("add", a=67317, b=164000)),
            reply("The combined headcount is 231,317."),
            reply("The combined headcount of the FAANG companies in 2024 is 231,317."),
        ],
    )
    with traced.rollout() as out:
        app.invoke(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "what's the combined headcount of the FAANG companies in 2024?",
                    }
                ]
            }
        )
    turns = ["supervisor", "research_expert", "supervisor", "math_expert", "supervisor"]
    assert_one_span_per_turn(out, turns)
    assert _selected(traced, out, ["supervisor"]) == Counter({"supervisor": 3})
    assert _selected(traced, out, ["research_expert", "math_expert"]) == Counter(
        {"research_expert": 2, "math_expert": 2}
    )


def test_create_react_agent_inside_a_graph_node(traced: Traced, env_model: ChatOpenAI) -> None:
    """A node that runs one prebuilt agent is that agent's turn: one span, named by the agent; a node
    that calls the model itself before delegating keeps its own span around the agent's."""
    from langgraph.graph import START, MessagesState, StateGraph

    def add(a: int, b: int) -> int:
        """Add two numbers"""
        return a + b

    researcher = _react_agent(env_model, [add], prompt="You research.", name="researcher")

    def research(state: MessagesState) -> dict[str, Any]:
        return {"messages": researcher.invoke(state)["messages"][-1:]}

    def review(state: MessagesState) -> dict[str, Any]:
        note = env_model.invoke([("system", "You review."), *state["messages"]])
        return {"messages": [note, *researcher.invoke(state)["messages"][-1:]]}

    g = StateGraph(MessagesState)
    g.add_node("research", research)
    g.add_node("review", review)
    g.add_edge(START, "research")
    g.add_edge("research", "review")
    _scripted(
        traced,
        [reply(None, tool_call("add", a=1, b=2)), reply("3"), reply("looks right"), reply("3 again")],
    )
    with traced.rollout() as out:
        g.compile().invoke({"messages": [{"role": "user", "content": "1 + 2?"}]})
    tree: Tree = out["tree"]
    first, review_span, second = tree.agents()
    assert first.attributes[sc.GEN_AI_AGENT_NAME] == "researcher"
    assert first.attributes[sc.AGL_LANGGRAPH_NODE] == "research"
    assert review_span.attributes[sc.GEN_AI_AGENT_NAME] == "review"
    assert tree.parent(second).span_id == review_span.span_id  # review's own call came first
    assert second.attributes[sc.GEN_AI_AGENT_NAME] == "researcher"
    for server in tree.server_chats():
        assert tree.agent_of(server) == server.attributes.get(sc.AGL_LLM_AGENT)
    assert _selected(traced, out, ["researcher"]) == Counter({"researcher": 3})
