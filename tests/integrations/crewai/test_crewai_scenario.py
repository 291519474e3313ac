"""The shared end-to-end scenario for CrewAI: researcher (failing lookup tool) → writer; train the writer.

A real CrewAI crew, its native OpenAI provider pointed at agl's gateway on 127.0.0.1 (scripted model,
SmolLM2 tokenizer), the SQLite store, rollouts through ``agl.runner.runner.Runner`` — for ``kickoff``,
``kickoff_async``, ``akickoff``, a streaming crew, a streaming LLM, CrewAI's text (ReAct) tool
protocol with a ``BaseTool``, and the hierarchical process.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("crewai")

from crewai_research_app import (  # noqa: E402
    MANAGER,
    build_crew,
    crew_inputs,
    expected_calls,
    make_llm,
)
from crewai_support import agent_above, by_time, run_rollouts  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.adapter import Adapter  # noqa: E402
from agl.adapter.air_rules import AIR  # noqa: E402
from agl.testing import assert_agent_spans, assert_merged  # noqa: E402

TASKS = [{"country": "france", "sloppy": True}, {"country": "japan"}]

# (how the crew is run, LLM streaming, text tools (ReAct) + BaseTool, process)
VARIANTS = {
    "kickoff": ("kickoff", False, False, "sequential"),
    "kickoff_async": ("kickoff_async", False, False, "sequential"),
    "akickoff": ("akickoff", False, False, "sequential"),
    "streaming_crew": ("stream", False, False, "sequential"),
    "streaming_llm": ("kickoff", True, False, "sequential"),
    "react_basetool": ("kickoff", False, True, "sequential"),
    "hierarchical": ("kickoff", False, False, "hierarchical"),
}


@pytest.fixture(autouse=True)
def _every_call_attributed(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The runner's unattributed-calls warning stays quiet: every LLM call ran under its agent."""
    yield
    assert "ran under no agent span" not in caplog.text


def score(raw: Any, task: dict[str, Any]) -> float:
    capital = {"france": "Paris", "japan": "Tokyo"}[task["country"]]
    return 1.0 if capital in str(raw) else 0.0


def make_agent(how: str, stream_llm: bool, text_tools: bool, process: str) -> Any:
    """The user's rollout function: builds the crew on the resources' LLM and runs it once."""

    def crew(resources: Any) -> Any:
        llm = make_llm(resources.llm.base_url, stream=stream_llm, text_tools=text_tools)
        return build_crew(
            llm, process=process, tools="basetool" if text_tools else "decorator", stream=how == "stream"
        )

    if how in ("kickoff", "stream"):

        def sync_agent(task: Any, resources: Any) -> float:
            out = crew(resources).kickoff(inputs=crew_inputs(task))
            if how == "stream":
                chunks = [chunk.content for chunk in out]
                assert chunks, "a streaming crew yields chunks"
                out = out.result
            return score(out.raw, task)

        return sync_agent

    async def async_agent(task: Any, resources: Any) -> float:
        c = crew(resources)
        out = await (c.kickoff_async if how == "kickoff_async" else c.akickoff)(inputs=crew_inputs(task))
        return score(out.raw, task)

    return async_agent


@pytest.fixture
def instrumented(clean_agl: None) -> Iterator[None]:
    assert agl.instrument("openai", "crewai") == ["openai", "crewai"]
    yield


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_research_crew_end_to_end(
    variant: str, gateway: Any, scripted_model: Any, instrumented: None
) -> None:
    how, stream_llm, text_tools, process = VARIANTS[variant]
    url, store = gateway
    ids = run_rollouts(make_agent(how, stream_llm, text_tools, process), store, str(url), TASKS)
    tokenizer = scripted_model.backend.tokenizer
    all_transitions = Adapter().from_store(store, ids)

    for rid, task in zip(ids, TASKS, strict=True):
        expected = expected_calls(task, process)
        spans = store.query_spans(rollout_id=rid, attempt=1)
        index = {s.span_id: s for s in spans}

        # --- the span tree: rollout → crew → tasks → agents → (LLM calls, tools), reward
        assert len({s.trace_id for s in spans}) == 1  # one trace per rollout, gateway spans included
        assert all(s.parent_id is None or s.parent_id in index for s in spans)  # nothing dangles
        (rollout_span,) = [s for s in spans if s.name == sc.SPAN_ROLLOUT]
        (crew_span,) = [s for s in spans if s.name == sc.SPAN_CREW]
        assert crew_span.parent_id == rollout_span.span_id
        assert crew_span.attributes[sc.AGL_CREW_PROCESS] == process
        tasks = by_time(s for s in spans if s.name == sc.SPAN_TASK)
        assert len(tasks) == 2 and all(t.parent_id == crew_span.span_id for t in tasks)
        agents = by_time(s for s in spans if s.name == sc.SPAN_INVOKE_AGENT)
        names = [a.attributes[sc.GEN_AI_AGENT_NAME] for a in agents]
        if process == "sequential":
            assert names == ["researcher", "writer"]
            assert [a.parent_id for a in agents] == [t.span_id for t in tasks]
        else:  # the manager runs each task and delegates it: the coworker nests under the delegation
            assert names == [MANAGER, "researcher", MANAGER, "writer"]
            assert [index[a.parent_id].name for a in agents] == [
                sc.SPAN_TASK,
                sc.SPAN_EXECUTE_TOOL,
                sc.SPAN_TASK,
                sc.SPAN_EXECUTE_TOOL,
            ]
        assert all(s.status.code != "ERROR" for s in [crew_span, *tasks, *agents])
        found = assert_agent_spans(store, rid, list(dict.fromkeys(names)), attempt=1)  # agl.testing helper
        assert sum(map(len, found.llm_calls.values())) == len(expected)

        servers = by_time(s for s in spans if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER)
        clients = [s for s in spans if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_CLIENT]
        assert len(servers) == len(clients) == len(expected)
        for server in servers:
            client = index[server.parent_id]  # the gateway span is the client span's child
            assert client.name == sc.SPAN_CHAT and client.attributes[sc.AGL_SIDE] == sc.SIDE_CLIENT
            assert client.attributes[sc.AGL_INTEGRATION] == "openai"  # one client span per call
            assert index[client.parent_id].name == sc.SPAN_INVOKE_AGENT  # made by that agent
        assert [agent_above(s, index) for s in servers] == expected
        # each call's baggage named its agent (the role): the gateway would serve that agent's adapter
        assert [s.attributes.get(sc.AGL_LLM_AGENT) for s in servers] == expected

        tools = by_time(s for s in spans if s.name == sc.SPAN_EXECUTE_TOOL)
        lookups = [t for t in tools if t.attributes[sc.GEN_AI_TOOL_NAME] == "lookup"]
        assert all(agent_above(t, index) == "researcher" for t in lookups)
        failing = [t for t in lookups if t.status.code == "ERROR"]
        sloppy = bool(task.get("sloppy")) and process == "sequential"
        assert len(failing) == (1 if sloppy else 0)  # one failing call, however often CrewAI retried it
        retried = [t for t in lookups if t.attributes.get(sc.AGL_TOOL_RETRIED)]
        assert len(retried) == (2 if sloppy and text_tools else 0)  # ReAct-mode ToolUsage retries twice
        ok = [t for t in lookups if t.status.code != "ERROR" and not t.attributes.get(sc.AGL_TOOL_RETRIED)]
        assert [t.attributes[sc.GEN_AI_TOOL_CALL_RESULT] for t in ok][-1].startswith(
            {"france": "Paris", "japan": "Tokyo"}[task["country"]]
        )
        for t in failing + retried:
            assert "unknown key" in (t.status.message or "") or t.attributes.get(sc.AGL_TOOL_RETRIED)
            assert any(e.name == "exception" for e in t.events)
        if not text_tools:  # native function calling: the tool span knows the LLM's tool call id
            for t in tools:
                call_id = t.attributes[sc.GEN_AI_TOOL_CALL_ID]
                issuer = [s for s in servers if call_id in s.attributes[sc.GEN_AI_OUTPUT_MESSAGES]]
                assert len(issuer) == 1 and issuer[0].end_ns <= t.start_ns
                args = json.loads(t.attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS])
                assert json.loads(issuer[0].attributes[sc.GEN_AI_OUTPUT_MESSAGES])[0]["tool_calls"][0][
                    "function"
                ]["arguments"] == json.dumps(args)
        (reward,) = [s for s in spans if s.name == sc.SPAN_REWARD]
        assert reward.attributes[sc.AGL_REWARD_VALUE] == 1.0 and reward.parent_id == rollout_span.span_id

        # --- every LLM call → exactly one exact transition with the gateway's token ids
        transitions = [t for t in all_transitions if t.rollout_id == rid]
        recorded = scripted_model.of(rid)
        assert len(transitions) == len(servers) == len(recorded)
        assert all(c.stream == (stream_llm or how == "stream") for c in recorded)  # streamed when asked
        for t, server, call, agent in zip(transitions, servers, recorded, expected, strict=True):
            assert t.exact and t.span_id == server.span_id and t.agent == agent == call.agent
            assert list(t.prompt_ids) == server.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS]
            assert list(t.response_ids) == server.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]
            # ... and equal to what the scripted model's tokenizer makes of the request it received
            assert list(t.prompt_ids) == tokenizer.encode_chat(call.messages, call.tools)[1]
            said = call.reply.content or call.reply.tool_calls[0].name
            assert said.split("\n")[0] in tokenizer.decode(list(t.response_ids))
            assert t.final_reward == 1.0

        # --- AIR: the failing lookup penalises exactly the researcher call that issued it
        air = [t.intermediate_reward for t in transitions]
        if sloppy:
            issuer = 0  # the researcher's first call: the misspelt key
            assert air == [AIR().tool_error if i == issuer else 0.0 for i in range(len(air))]
        else:
            assert air == [0.0] * len(air)

    # --- train the writer only: no other agent's call becomes a transition
    selected = Adapter(agents=["writer"]).from_store(store, ids)
    assert {t.agent for t in selected} == {"writer"}
    assert len(selected) == len(ids)  # one writer call per rollout
    assert [t.span_id for t in selected] == [t.span_id for t in all_transitions if t.agent == "writer"]

    # --- multi-turn merging: with native tool calls the researcher's later calls re-send its tool
    # calls and results exactly and extend its first call's sequence; with text tools (ReAct) CrewAI
    # re-sends each reply with the tool's Observation appended, so every call starts a new sequence
    # (a break: edited). The hierarchical manager holds one conversation per task (its delegation, the
    # coworker's answer, its own answer merge); the second task opens a fresh one (diverged).
    calls = Counter(agent for task in TASKS for agent in expected_calls(task, process))
    n = len(ids)
    want = {"researcher": calls["researcher"] if text_tools else n, "writer": n}
    if process == "hierarchical":
        want[MANAGER] = 2 * n  # two tasks
    merged = assert_merged(all_transitions, want)
    breaks = {"researcher": ["edited"] * (calls["researcher"] - n)} if text_tools else {}
    if process == "hierarchical":
        breaks[MANAGER] = ["diverged"] * n
    assert merged.breaks == breaks
    merged_manager = calls[MANAGER] - 2 * n if process == "hierarchical" else 0
    assert merged.stats.merged_calls == (0 if text_tools else calls["researcher"] - n) + merged_manager
    assert (merged.stats.merge_rate > 0) == (not text_tools)
