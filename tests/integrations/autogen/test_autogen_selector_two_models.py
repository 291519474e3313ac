"""AutoGen's documented SelectorGroupChat runs unchanged through agl: its agents on ``gpt-4o``, its
selector on ``gpt-4o-mini``, configured by ``OPENAI_BASE_URL`` alone. Both names are served by the
policy (the gateway's default), or each by a model of its own (``serve={"gpt-4o-mini": ...}``, what
``agl gateway serve --serve gpt-4o-mini=...`` does); every call exact, attributed, selectable."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("autogen_agentchat")
pytest.importorskip("autogen_ext.models.openai")

from autogen_agentchat.agents import AssistantAgent  # noqa: E402
from autogen_agentchat.conditions import MaxMessageTermination, TextMentionTermination  # noqa: E402
from autogen_agentchat.teams import SelectorGroupChat  # noqa: E402
from autogen_ext.models.openai import OpenAIChatCompletionClient  # noqa: E402
from autogen_support import run_rollouts  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.adapter import Adapter  # noqa: E402
from agl.gateway.testing import ScriptedBackend, reply, serve_gateway, tool_call  # noqa: E402

SELECTOR_PROMPT = """Select an agent to perform task.

{roles}

Current conversation context:
{history}

Read the above conversation, then select an agent from {participants} to perform the next task.
Make sure the planner agent has assigned tasks before other agents start working.
Only select one agent.
"""
TASK = "Who was the Miami Heat player with the highest points in the 2006-2007 season?"
PICKS = ["PlanningAgent", "WebSearchAgent", "DataAnalystAgent", "PlanningAgent"]
MANAGER = "SelectorGroupChatManager"  # agl's name for the selector's turns


def search_web_tool(query: str) -> str:
    return "Dwyane Wade: 1397 points in 2006-2007, 1601 in 2007-2008."


def percentage_change_tool(start: float, end: float) -> float:
    return ((end - start) / start) * 100


def build_team() -> SelectorGroupChat:
    """The documented program: nothing here knows about agl."""
    model_client = OpenAIChatCompletionClient(model="gpt-4o")
    planning_agent = AssistantAgent(
        "PlanningAgent",
        description="An agent for planning tasks, this agent should be the first to engage when given a new task.",
        model_client=model_client,
        system_message="You are a planning agent. Break down complex tasks into smaller subtasks and "
        'delegate them. After all tasks are complete, summarize the findings and end with "TERMINATE".',
    )
    web_search_agent = AssistantAgent(
        "WebSearchAgent",
        description="An agent for searching information on the web.",
        tools=[search_web_tool],
        model_client=model_client,
        system_message="You are a web search agent. Your only tool is search_tool.",
    )
    data_analyst_agent = AssistantAgent(
        "DataAnalystAgent",
        description="An agent for performing calculations.",
        model_client=model_client,
        tools=[percentage_change_tool],
        system_message="You are a data analyst. Use the tools provided to compute numeric results.",
    )
    termination = TextMentionTermination("TERMINATE") | MaxMessageTermination(max_messages=25)
    return SelectorGroupChat(
        [planning_agent, web_search_agent, data_analyst_agent],
        model_client=OpenAIChatCompletionClient(model="gpt-4o-mini"),
        termination_condition=termination,
        selector_prompt=SELECTOR_PROMPT,
        allow_repeated_speaker=True,
    )


def agents_policy() -> Any:
    """The policy's replies for the three agents (by their system message), in the plan's order."""
    replies = {
        "planning": iter(
            ["1. WebSearchAgent: find the points\n2. DataAnalystAgent: compute", "Wade. TERMINATE"]
        ),
        "web search": iter([reply(None, tool_call("search_web_tool", query="Miami Heat 2006-2007 points"))]),
        "data analyst": iter([reply(None, tool_call("percentage_change_tool", start=1397, end=1601))]),
    }
    picks = iter(PICKS)

    def policy(request: Any) -> Any:
        text = " ".join(str(m.get("content") or "") for m in request.messages or [])
        if "select an agent" in text:
            return next(picks)
        system = str(request.messages[0].get("content") or "")
        return next(next(it for key, it in replies.items() if f"You are a {key}" in system))

    return policy


@pytest.mark.parametrize("selector_model", ["the policy", "a model of its own"])
def test_selector_group_chat_on_two_model_names(
    selector_model: str,
    agl_model: Any,
    agl_store: Any,
    clean_agl: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: Any,
) -> None:
    agl_model.policy = agents_policy()
    serve = {}
    if selector_model == "a model of its own":
        serve = {"gpt-4o-mini": ScriptedBackend(PICKS, models=["selector-model"])}
    with serve_gateway(agl_model.backend, agl_store, serve=serve) as url:
        monkeypatch.setenv("OPENAI_BASE_URL", str(url))  # the only configuration
        agl.instrument("openai", "autogen")

        async def rollout(task: Any, resources: Any) -> float:
            result = await build_team().run(task=TASK)
            return 1.0 if "TERMINATE" in str(result.messages[-1].content) else 0.0

        with caplog.at_level(logging.WARNING, "agl"):
            (rid,) = run_rollouts(rollout, agl_store, str(url), [{}])
    assert not [r for r in caplog.records if r.name.startswith("agl")], caplog.text  # no false alarm

    spans = agl_store.query_spans(rollout_id=rid, attempt=1)
    index = {s.span_id: s for s in spans}
    servers = sorted(
        (s for s in spans if s.name == sc.SPAN_CHAT and s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER),
        key=lambda s: s.start_ns,
    )
    agents = [s.attributes.get(sc.AGL_LLM_AGENT) for s in servers]
    assert agents == [MANAGER, "PlanningAgent", MANAGER, "WebSearchAgent", MANAGER, "DataAnalystAgent"] + [
        MANAGER,
        "PlanningAgent",
    ]
    for s in servers:
        assert s.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS], "exact ids on every call"
        parent = index[s.parent_id]
        while parent.name != sc.SPAN_INVOKE_AGENT:
            parent = index[parent.parent_id]
        assert parent.attributes[sc.GEN_AI_AGENT_NAME] == s.attributes[sc.AGL_LLM_AGENT]
        selector = s.attributes[sc.AGL_LLM_AGENT] == MANAGER
        assert s.attributes[sc.GEN_AI_REQUEST_MODEL] == ("gpt-4o-mini" if selector else "gpt-4o")
        own = selector and selector_model == "a model of its own"
        assert s.attributes[sc.GEN_AI_RESPONSE_MODEL] == ("selector-model" if own else "scripted")
    ts = Adapter(agents=["WebSearchAgent", "DataAnalystAgent"]).transitions(
        spans, rollout=agl_store.get_rollout(rid), attempt=1
    )
    assert Counter(t.agent for t in ts) == Counter({"WebSearchAgent": 1, "DataAnalystAgent": 1})
