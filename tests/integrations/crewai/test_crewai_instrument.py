"""CrewAI integration: registration, idempotence, reversibility, leaving CrewAI's behaviour alone.

These run real crews against the real gateway (scripted model) with spans kept in memory; the
store/Runner/adapter scenario is in ``test_crewai_scenario.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("crewai")

from crewai import Agent, Crew, Task  # noqa: E402
from crewai.events import crewai_event_bus  # noqa: E402
from crewai.events.base_event_listener import BaseEventListener  # noqa: E402
from crewai.events.event_bus import CrewAIEventsBus  # noqa: E402
from crewai.llms.providers.openai.completion import OpenAICompletion  # noqa: E402
from crewai_research_app import LLM_ERROR, build_crew, crew_inputs, make_llm  # noqa: E402
from crewai_support import agent_above, index_of, named, parent_of, run_rollouts, span_id  # noqa: E402
from opentelemetry import trace  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.adapter import Adapter  # noqa: E402
from agl.instrumentation import available_instrumentors, failure_counts, get_instrumentor, instrumented  # noqa: E402
from agl.integrations.crewai import CrewAIInstrumentor  # noqa: E402
from agl.integrations.crewai._listener import _ATTACHED, AglEventListener  # noqa: E402

FRANCE = {"country": "france", "sloppy": True}
PATCHED = [
    (CrewAIEventsBus, "emit"),
    (OpenAICompletion, "_prepare_completion_params"),
    (OpenAICompletion, "_prepare_responses_params"),
]


def attributes() -> list[Any]:
    return [owner.__dict__[name] for owner, name in PATCHED]


def handlers() -> tuple[dict[Any, frozenset[Any]], dict[Any, frozenset[Any]]]:
    return dict(crewai_event_bus._sync_handlers), dict(crewai_event_bus._async_handlers)


def kickoff(url: str, task: dict[str, Any] = FRANCE, **kwargs: Any) -> Any:
    text_tools = kwargs.pop("text_tools", False)
    return build_crew(make_llm(str(url), text_tools=text_tools), **kwargs).kickoff(inputs=crew_inputs(task))


def test_registered_through_the_entry_point() -> None:
    assert available_instrumentors()["crewai"] is CrewAIInstrumentor
    assert CrewAIInstrumentor.extra == "crewai"
    assert CrewAIInstrumentor.instruments == ("crewai >= 1.15.30",)


def test_importing_the_integration_does_not_import_crewai() -> None:
    code = "import sys, agl.integrations.crewai; assert 'crewai' not in sys.modules, 'crewai imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_instrument_twice_is_once_and_uninstrument_restores(gateway_url: Any, memory_spans: Any) -> None:
    provider, exporter = memory_spans
    before, bus_before = attributes(), handlers()
    failed = sum(failure_counts("crewai.").values())
    assert agl.instrument("openai", "crewai", tracer_provider=provider) == ["openai", "crewai"]
    once = attributes()
    assert agl.instrument("openai", "crewai", tracer_provider=provider) == ["openai", "crewai"]
    assert attributes() == once and all(a is not b for a, b in zip(once, before, strict=True))
    assert all(a.__wrapped__ is b for a, b in zip(once, before, strict=True))  # wrapped once, not twice
    assert "crewai" in instrumented()
    listener = get_instrumentor("crewai").listener
    assert isinstance(listener, AglEventListener)

    assert kickoff(gateway_url).raw == "The capital of France is Paris."
    agents = named(exporter.get_finished_spans(), sc.SPAN_INVOKE_AGENT)
    assert [a.attributes[sc.GEN_AI_AGENT_NAME] for a in agents] == ["researcher", "writer"]  # once each
    assert handlers() == bus_before  # agl registers no handler on the bus: the app's run as before
    assert listener.open_spans() == 0 and sum(failure_counts("crewai.").values()) == failed

    assert agl.uninstrument("crewai") == ["crewai"]
    assert all(a is b for a, b in zip(attributes(), before, strict=True))
    assert handlers() == bus_before
    assert get_instrumentor("crewai").listener is None and not listener.enabled
    n = len(exporter.get_finished_spans())
    assert kickoff(gateway_url).raw == "The capital of France is Paris."
    crewai_spans = [
        s for s in exporter.get_finished_spans()[n:] if s.attributes.get(sc.AGL_INTEGRATION) == "crewai"
    ]
    assert crewai_spans == []  # uninstrumented: CrewAI makes no agl span any more
    assert agl.uninstrument("crewai") == []  # twice is harmless


class RecordingListener(BaseEventListener):
    """An application's own listener, registered the way CrewAI documents."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        super().__init__()

    def setup_listeners(self, bus: Any) -> None:
        from crewai.events import (
            AgentExecutionCompletedEvent,
            AgentExecutionStartedEvent,
            LLMCallCompletedEvent,
            ToolUsageErrorEvent,
            ToolUsageFinishedEvent,
        )

        for cls in (
            AgentExecutionStartedEvent,
            AgentExecutionCompletedEvent,
            LLMCallCompletedEvent,
            ToolUsageErrorEvent,
            ToolUsageFinishedEvent,
        ):
            bus.on(cls)(lambda source, event: self.seen.append(event.type))


def test_the_applications_listeners_still_get_every_event(gateway_url: Any, memory_spans: Any) -> None:
    provider, _ = memory_spans
    runs = []
    for instrument in (False, True):
        if instrument:
            agl.instrument("openai", "crewai", tracer_provider=provider)
        with crewai_event_bus.scoped_handlers():
            listener = RecordingListener()
            out = kickoff(gateway_url)
            assert crewai_event_bus.flush(timeout=10)
            runs.append((out.raw, sorted(listener.seen)))
    assert runs[0] == runs[1]
    assert runs[0][1].count("tool_usage_error") == 1 and runs[0][1].count("llm_call_completed") == 4


def test_a_failing_agl_listener_never_breaks_the_crew(
    gateway_url: Any, memory_spans: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider, exporter = memory_spans
    agl.instrument("openai", "crewai", tracer_provider=provider)

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("agl bug")

    monkeypatch.setattr(AglEventListener, "_describe", boom)
    failed = failure_counts("crewai.event").get("crewai.event", 0)
    current = trace.get_current_span()
    assert kickoff(gateway_url).raw == "The capital of France is Paris."
    listener = get_instrumentor("crewai").listener
    assert failure_counts("crewai.event")["crewai.event"] > failed and listener.open_spans() == 0
    assert trace.get_current_span() is current and _ATTACHED.get() is None


def failing_crew(url: str) -> Any:
    llm = make_llm(str(url))
    llm.max_retries = 0
    agent = Agent(role="writer", goal="g", backstory="b", llm=llm, max_retry_limit=0)
    task = Task(description=f"Write one sentence about France {LLM_ERROR}", expected_output="x", agent=agent)
    return Crew(agents=[agent], tasks=[task])


def test_errors_are_unchanged_and_recorded(gateway_url: Any, memory_spans: Any) -> None:
    provider, exporter = memory_spans
    raised = []
    for instrument in (False, True):
        if instrument:
            agl.instrument("openai", "crewai", tracer_provider=provider)
        current = trace.get_current_span()
        with pytest.raises(Exception) as info:
            failing_crew(gateway_url).kickoff()
        raised.append((type(info.value), str(info.value)))
        assert trace.get_current_span() is current and _ATTACHED.get() is None  # nothing left attached
    assert raised[0] == raised[1]  # the same exception, with or without agl

    spans = exporter.get_finished_spans()
    for name in (sc.SPAN_CREW, sc.SPAN_TASK, sc.SPAN_INVOKE_AGENT):
        (span,) = named(spans, name)
        assert span.status.status_code.name == "ERROR"
    (chat,) = [s for s in spans if s.name == sc.SPAN_CHAT]
    assert chat.status.status_code.name == "ERROR"
    assert agent_above(chat, index_of(spans)) == "writer"
    assert get_instrumentor("crewai").listener.open_spans() == 0


@pytest.mark.parametrize("text_tools", [False, True], ids=["native", "react"])
def test_tool_failures_and_unknown_tools_are_error_spans(
    text_tools: bool, gateway_url: Any, memory_spans: Any
) -> None:
    provider, exporter = memory_spans
    agl.instrument("openai", "crewai", tracer_provider=provider)
    task = {"country": "france", "sloppy": True, "wrong_tool": True}
    assert (
        kickoff(gateway_url, task, tools="failure", text_tools=text_tools).raw
        == "The capital of France is Paris."
    )
    spans = exporter.get_finished_spans()
    index = index_of(spans)
    tools = named(spans, sc.SPAN_EXECUTE_TOOL)
    assert [t.attributes[sc.GEN_AI_TOOL_NAME] for t in tools] == ["encyclopedia", "lookup", "lookup"]
    assert [t.status.status_code.name for t in tools] == ["ERROR", "ERROR", "UNSET"]
    assert "unknown key 'francx'" in tools[1].status.description  # the ToolFailure the tool returned
    assert tools[1].attributes[sc.ERROR_TYPE] == "unknown_key"
    assert all(agent_above(t, index) == "researcher" for t in tools)
    chats = named(spans, sc.SPAN_CHAT)
    for tool in tools:  # each tool span comes after the LLM call that asked for it, under one agent
        issuer = max((c for c in chats if c.end_time <= tool.start_time), key=lambda c: c.end_time)
        assert parent_of(issuer) == parent_of(tool)
        if not text_tools:
            call_id = tool.attributes[sc.GEN_AI_TOOL_CALL_ID]
            assert call_id in issuer.attributes[sc.GEN_AI_OUTPUT_MESSAGES]


def test_parallel_tool_calls_get_their_own_call_ids(gateway_url: Any, memory_spans: Any) -> None:
    provider, exporter = memory_spans
    agl.instrument("openai", "crewai", tracer_provider=provider)
    task = {"country": "france", "sloppy": True, "parallel": True}
    assert kickoff(gateway_url, task).raw == "The capital of France is Paris."
    spans = exporter.get_finished_spans()
    first = named(spans, sc.SPAN_CHAT)[0]
    issued = json.loads(first.attributes[sc.GEN_AI_OUTPUT_MESSAGES])[0]["tool_calls"]
    assert len(issued) == 2  # both lookups in one response
    tools = {
        json.loads(t.attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS])["key"]: t
        for t in named(spans, sc.SPAN_EXECUTE_TOOL)
    }
    assert sorted(tools) == ["france", "francx"]
    for call in issued:  # each span carries the id of the call with its own arguments
        key = json.loads(call["function"]["arguments"])["key"]
        assert tools[key].attributes[sc.GEN_AI_TOOL_CALL_ID] == call["id"]
    assert tools["francx"].status.status_code.name == "ERROR"
    assert tools["france"].status.status_code.name == "UNSET"


def test_kickoff_async_and_concurrent_crews_keep_their_trees_apart(
    gateway_url: Any, memory_spans: Any
) -> None:
    provider, exporter = memory_spans
    agl.instrument("openai", "crewai", tracer_provider=provider)

    async def both() -> list[Any]:
        crews = [
            build_crew(make_llm(str(gateway_url))).kickoff_async(inputs=crew_inputs(t))
            for t in (FRANCE, {"country": "japan"})
        ]
        return list(await asyncio.gather(*crews))

    outs = asyncio.run(both())
    assert [o.raw for o in outs] == ["The capital of France is Paris.", "The capital of Japan is Tokyo."]
    spans = exporter.get_finished_spans()
    index = index_of(spans)
    crews = named(spans, sc.SPAN_CREW)
    assert len(crews) == 2
    for span in spans:
        if span.name in (sc.SPAN_CHAT, sc.SPAN_EXECUTE_TOOL):
            chain = [index[span_id(span)], *[a for a in _chain(span, index)]]
            roots = [c for c in chain if c.name == sc.SPAN_CREW]
            assert len(roots) == 1 and span.context.trace_id == roots[0].context.trace_id
    for crew in crews:  # each crew's LLM calls talk about its own country only
        mine = [s for s in spans if s.name == sc.SPAN_CHAT and crew in _chain(s, index)]
        country = "france" if "france" in mine[0].attributes[sc.GEN_AI_INPUT_MESSAGES] else "japan"
        assert all(country in s.attributes[sc.GEN_AI_INPUT_MESSAGES] for s in mine)


def _chain(span: Any, index: dict[Any, Any]) -> list[Any]:
    out = []
    while parent_of(span) in index:
        span = index[parent_of(span)]
        out.append(span)
    return out


def test_a_standalone_agent_kickoff_is_an_agent_span(gateway_url: Any, memory_spans: Any) -> None:
    provider, exporter = memory_spans
    agl.instrument("openai", "crewai", tracer_provider=provider)
    writer = Agent(role="writer", goal="Write", backstory="You write.", llm=make_llm(str(gateway_url)))
    out = writer.kickoff("Write one sentence saying what the capital of japan is")
    assert out.raw == "The capital of Japan is Tokyo."
    spans = exporter.get_finished_spans()
    (agent,) = named(spans, sc.SPAN_INVOKE_AGENT)
    (chat,) = named(spans, sc.SPAN_CHAT)
    assert agent.attributes[sc.GEN_AI_AGENT_NAME] == "writer" and parent_of(chat) == span_id(agent)


def test_crewai_settings_and_the_global_provider_are_left_alone(gateway_url: Any, memory_spans: Any) -> None:
    provider, _ = memory_spans
    env = {k: os.environ.get(k) for k in ("CREWAI_DISABLE_TELEMETRY", "CREWAI_TRACING_ENABLED")}
    global_provider = trace.get_tracer_provider()
    agl.instrument("openai", "crewai", tracer_provider=provider)
    kickoff(gateway_url)
    assert "OTEL_SDK_DISABLED" not in os.environ
    assert (
        {k: os.environ.get(k) for k in env}
        == env
        == {
            "CREWAI_DISABLE_TELEMETRY": "true",
            "CREWAI_TRACING_ENABLED": "false",
        }
    )
    assert trace.get_tracer_provider() is global_provider


def test_without_the_openai_integration_crewai_makes_the_client_spans_and_headers(
    gateway: Any, scripted_model: Any, clean_agl: None
) -> None:
    url, store = gateway
    assert agl.instrument("crewai") == ["crewai"]

    def agent(task: Any, resources: Any) -> float:
        return 1.0 if "Paris" in kickoff(resources.llm.base_url, task).raw else 0.0

    (rid,) = run_rollouts(agent, store, str(url), [FRANCE])
    spans = store.query_spans(rollout_id=rid, attempt=1)
    index = {s.span_id: s for s in spans}
    servers = sorted(
        (s for s in spans if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER), key=lambda s: s.start_ns
    )
    assert len(servers) == 4
    for server in servers:  # linked through the traceparent header the crewai integration added
        client = index[server.parent_id]
        assert (
            client.attributes[sc.AGL_SIDE] == sc.SIDE_CLIENT
            and client.attributes[sc.AGL_INTEGRATION] == "crewai"
        )
        assert json.loads(client.attributes[sc.GEN_AI_OUTPUT_MESSAGES])[0]["role"] == "assistant"
    transitions = Adapter().from_store(store, [rid])
    assert [t.agent for t in transitions] == ["researcher"] * 3 + ["writer"]
    assert all(t.exact for t in transitions) and [t.span_id for t in transitions] == [
        s.span_id for s in servers
    ]
    assert transitions[0].intermediate_reward < 0  # the failing lookup, still credited to its issuer
