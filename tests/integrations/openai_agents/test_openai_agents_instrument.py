"""OpenAI Agents SDK integration: registration, idempotence, reversibility, exporter handling, context.

These run the real SDK against the real gateway (scripted model) with spans kept in memory; the
store/Runner/adapter scenario is in ``test_openai_agents_scenario.py``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("agents")

import agents  # noqa: E402
from agents import Agent, Runner, function_tool  # noqa: E402
from agents.tracing import get_trace_provider, set_trace_processors  # noqa: E402
from openai_agents_rag_app import ANSWERER, RESEARCHER, UserProcessor, build_app, make_model  # noqa: E402
from opentelemetry import trace  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.instrumentation import available_instrumentors, failure_counts, get_instrumentor, instrumented  # noqa: E402
from agl.integrations.openai_agents import OpenAIAgentsInstrumentor  # noqa: E402

QUESTION = "What is the capital of France? [sloppy]"


def processors() -> tuple[Any, ...]:
    return tuple(get_trace_provider()._multi_processor._processors)


def by_name(spans: Any, name: str) -> list[Any]:
    return [s for s in spans if s.name == name]


def ancestors(span: Any, index: dict[int, Any]) -> list[Any]:
    out = []
    while span.parent is not None and span.parent.span_id in index:
        span = index[span.parent.span_id]
        out.append(span)
    return out


def agent_above(span: Any, index: dict[int, Any]) -> str | None:
    for a in ancestors(span, index):
        if a.name == sc.SPAN_INVOKE_AGENT:
            return a.attributes[sc.GEN_AI_AGENT_NAME]
    return None


def test_registered_through_the_entry_point() -> None:
    found = available_instrumentors()
    assert found["openai_agents"] is OpenAIAgentsInstrumentor
    assert OpenAIAgentsInstrumentor.extra == "openai-agents"
    assert OpenAIAgentsInstrumentor.instruments == ("openai-agents >= 0.20.0",)


def test_instrument_twice_is_once_and_uninstrument_restores(
    gateway_url: Any, memory_spans: Any, user_processor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AGL_OPENAI_AGENTS_REPLACE_EXPORTER")
    provider, exporter = memory_spans
    before = processors()
    assert before == (user_processor,)
    patched_before = {name: getattr(agents.Runner, name) for name in ("run", "run_sync", "run_streamed")}
    assert agl.instrument("openai_agents", tracer_provider=provider) == ["openai_agents"]
    once = processors()
    assert agl.instrument("openai_agents", tracer_provider=provider) == ["openai_agents"]
    assert processors() == once
    assert once == (user_processor, get_instrumentor("openai_agents").processor)  # added; the app's own kept
    added = once[-1]
    assert "openai_agents" in instrumented()

    seen_before = len(user_processor.spans)
    with agl.rollout_context("ro-twice", 1):
        _run("chat", gateway_url.for_rollout("ro-twice", 1))
    assert len(by_name(exporter.get_finished_spans(), sc.SPAN_INVOKE_AGENT)) == 3  # once each, not twice
    assert len(user_processor.spans) > seen_before  # the app's processor still gets everything

    assert agl.uninstrument("openai_agents") == ["openai_agents"]
    assert all(a is b for a, b in zip(processors(), before, strict=True))
    assert get_instrumentor("openai_agents").processor is None and not added.enabled
    assert {name: getattr(agents.Runner, name) for name in patched_before} == patched_before
    assert agl.uninstrument("openai_agents") == []  # twice is harmless


def test_replace_exporter_swaps_the_sdk_processors_and_puts_them_back(
    clean_agl: None, user_processor: Any
) -> None:
    before = processors()
    assert before == (user_processor,)
    agl.instrument("openai_agents")  # AGL_OPENAI_AGENTS_REPLACE_EXPORTER=1 (fixture)
    assert processors() == (get_instrumentor("openai_agents").processor,)
    agl.uninstrument("openai_agents")
    assert processors() == before

    # the app sets its own list while agl is instrumented: uninstrument leaves the app's choice alone
    agl.instrument("openai_agents")
    mine = UserProcessor()
    set_trace_processors([mine])
    agl.uninstrument("openai_agents")
    assert processors() == (mine,)
    set_trace_processors(list(before))


def test_replace_exporter_as_an_instrument_argument(clean_agl: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGL_OPENAI_AGENTS_REPLACE_EXPORTER")
    before = processors()
    inst = get_instrumentor("openai_agents")
    inst.instrument(replace_exporter=True, skip_dep_check=True)
    try:
        assert processors() == (inst.processor,)
    finally:
        inst.uninstrument()
    assert processors() == before


def test_replace_exporter_through_agl_instrument_options(
    clean_agl: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AGL_OPENAI_AGENTS_REPLACE_EXPORTER")
    before = processors()
    with pytest.raises(agl.instrumentation.IntegrationNotFoundError, match="nope"):
        agl.instrument("openai_agents", options={"nope": {}})
    assert processors() == before  # a refused call changes nothing
    agl.instrument("openai_agents", options={"openai_agents": {"replace_exporter": True}})
    try:
        assert processors() == (get_instrumentor("openai_agents").processor,)
    finally:
        agl.uninstrument("openai_agents")
    assert processors() == before


def _run(api: str, url: str, question: str = QUESTION) -> Any:
    return Runner.run_sync(build_app(make_model(api, url)), question)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_spans_nest_under_the_right_agent(api: str, gateway_url: Any, memory_spans: Any) -> None:
    url = gateway_url
    provider, exporter = memory_spans
    agl.instrument("openai", "openai_agents", tracer_provider=provider)
    with agl.rollout_context("ro-nest", 1) as rc:
        result = _run(api, url.for_rollout("ro-nest", 1))
        assert trace.get_current_span() is rc.span  # nothing agl attached is left current
    assert result.final_output == "Paris is the capital of France."
    spans = exporter.get_finished_spans()
    index = {s.context.span_id: s for s in spans}

    agents_ = by_name(spans, sc.SPAN_INVOKE_AGENT)
    assert [a.attributes[sc.GEN_AI_AGENT_NAME] for a in agents_] == ["triage", "researcher", "answerer"]
    for a in agents_:
        assert a.attributes[sc.GEN_AI_OPERATION_NAME] == sc.OP_INVOKE_AGENT
        assert a.parent is not None and a.parent.span_id == rc.span.get_span_context().span_id

    chats = by_name(spans, sc.SPAN_CHAT)
    assert all(c.attributes[sc.AGL_SIDE] == sc.SIDE_CLIENT for c in chats)
    assert [agent_above(c, index) for c in sorted(chats, key=lambda s: s.start_time)] == [
        "triage", "researcher", "researcher", "researcher", "answerer"
    ]  # fmt: skip
    # exactly one client span per LLM call: the openai integration's, not a second from the SDK
    assert all(c.attributes.get(sc.AGL_INTEGRATION) != "openai_agents" for c in chats)

    tools = sorted(by_name(spans, sc.SPAN_EXECUTE_TOOL), key=lambda s: s.start_time)
    assert [t.attributes[sc.GEN_AI_TOOL_NAME] for t in tools] == ["search", "search"]
    failed, ok = tools
    assert failed.status.status_code.name == "ERROR"
    assert "Error running tool" in failed.status.description  # newer SDKs redact the details by default
    assert json.loads(failed.attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS]) == {"query": ""}
    assert ok.status.status_code.name == "UNSET"
    assert json.loads(ok.attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS]) == {"query": "France"}
    assert ok.attributes[sc.GEN_AI_TOOL_CALL_RESULT] == "Paris is the capital of France."
    # the tool call id is the one the model's response carried
    issued = [
        json.loads(c.attributes[sc.GEN_AI_OUTPUT_MESSAGES]) for c in sorted(chats, key=lambda s: s.start_time)
    ]
    ids = [tc["id"] for out in issued for m in out for tc in (m.get("tool_calls") or ())]
    assert failed.attributes[sc.GEN_AI_TOOL_CALL_ID] == ids[1]
    assert ok.attributes[sc.GEN_AI_TOOL_CALL_ID] == ids[2]
    assert all(agent_above(t, index) == "researcher" for t in tools)

    handoffs = sorted(by_name(spans, sc.SPAN_HANDOFF), key=lambda s: s.start_time)
    assert [(h.attributes[sc.AGL_HANDOFF_FROM], h.attributes[sc.AGL_HANDOFF_TO]) for h in handoffs] == [
        ("triage", "researcher"),
        ("researcher", "answerer"),
    ]
    assert [agent_above(h, index) for h in handoffs] == ["triage", "researcher"]
    assert handoffs[0].attributes[sc.GEN_AI_TOOL_CALL_ID] == ids[0]
    assert handoffs[1].attributes[sc.GEN_AI_TOOL_CALL_ID] == ids[3]

    (guard,) = by_name(spans, sc.SPAN_GUARDRAIL)
    assert guard.attributes[sc.AGL_GUARDRAIL_NAME] == "question_not_empty"
    assert guard.attributes[sc.AGL_GUARDRAIL_TRIGGERED] is False
    assert agent_above(guard, index) == "triage"
    assert all(s.attributes[sc.AGL_ROLLOUT_ID] == "ro-nest" for s in spans if s.name != sc.SPAN_ROLLOUT)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_without_the_openai_integration_the_sdk_spans_are_the_llm_spans(
    api: str, gateway_url: Any, memory_spans: Any
) -> None:
    url = gateway_url
    provider, exporter = memory_spans
    agl.instrument("openai_agents", tracer_provider=provider)
    with agl.rollout_context("ro-sdk", 1):
        assert _run(api, url.for_rollout("ro-sdk", 1)).final_output == "Paris is the capital of France."
    spans = exporter.get_finished_spans()
    index = {s.context.span_id: s for s in spans}
    chats = sorted(by_name(spans, sc.SPAN_CHAT), key=lambda s: s.start_time)
    assert [agent_above(c, index) for c in chats] == [
        "triage",
        "researcher",
        "researcher",
        "researcher",
        "answerer",
    ]
    for c in chats:
        assert c.attributes[sc.AGL_INTEGRATION] == "openai_agents"
        assert c.attributes[sc.AGL_SIDE] == sc.SIDE_CLIENT
        assert c.attributes[sc.GEN_AI_REQUEST_MODEL] == "scripted"
        assert c.attributes[sc.GEN_AI_USAGE_INPUT_TOKENS] > 0
        assert c.attributes[sc.GEN_AI_INPUT_MESSAGES] and c.attributes[sc.GEN_AI_OUTPUT_MESSAGES]
    assert "Paris is the capital of France." in chats[-1].attributes[sc.GEN_AI_OUTPUT_MESSAGES]
    (failed,) = [t for t in by_name(spans, sc.SPAN_EXECUTE_TOOL) if t.status.status_code.name == "ERROR"]
    assert failed.attributes[sc.GEN_AI_TOOL_CALL_ID] in chats[1].attributes[sc.GEN_AI_OUTPUT_MESSAGES]


def test_uninstrument_leaves_no_spans(gateway_url: Any, memory_spans: Any) -> None:
    url = gateway_url
    provider, exporter = memory_spans
    agl.instrument("openai", "openai_agents", tracer_provider=provider)
    agl.uninstrument("openai_agents", "openai")
    with agl.rollout_context("ro-off", 1):
        assert _run("chat", url.for_rollout("ro-off", 1)).final_output == "Paris is the capital of France."
    names = {s.name for s in exporter.get_finished_spans()}
    assert names == {sc.SPAN_ROLLOUT}


def test_tool_code_runs_inside_its_execute_tool_span(
    gateway_url: Any, memory_spans: Any, scripted_model: Any
) -> None:
    """User code in a tool (e.g. agl.emit_reward) sees the tool's span as current, in the right trace."""
    url = gateway_url
    provider, exporter = memory_spans
    agl.instrument("openai", "openai_agents", tracer_provider=provider)
    seen: list[Any] = []

    @function_tool
    def search(query: str) -> str:
        """Search."""
        seen.append(trace.get_current_span())
        agl.emit_reward(0.5, name="searched", primary=False)
        return "Paris is the capital of France."

    model = make_model("responses", url.for_rollout("ro-tool", 1))
    answerer = Agent(name="answerer", instructions=ANSWERER, model=model)
    researcher = Agent(
        name="researcher", instructions=RESEARCHER, tools=[search], handoffs=[answerer], model=model
    )

    async def main() -> Any:
        with agl.rollout_context("ro-tool", 1) as rc:
            result = await Runner.run(researcher, "What is the capital of France?")
            # awaited in this very task: every context agl attached was detached again
            assert trace.get_current_span() is rc.span
            return result

    assert asyncio.run(main()).final_output == "Paris is the capital of France."
    processor = get_instrumentor("openai_agents").processor
    assert processor._spans == {} and processor._traces == {}
    spans = exporter.get_finished_spans()
    (tool,) = by_name(spans, sc.SPAN_EXECUTE_TOOL)
    assert seen[0].get_span_context().span_id == tool.context.span_id
    (reward,) = by_name(spans, sc.SPAN_REWARD)
    assert reward.parent.span_id == tool.context.span_id


def test_a_failing_processor_never_breaks_the_run(
    gateway_url: Any, memory_spans: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = gateway_url
    provider, _exporter = memory_spans
    agl.instrument("openai_agents", tracer_provider=provider)
    processor = get_instrumentor("openai_agents").processor

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("tracer exploded")

    monkeypatch.setattr(processor._tracer, "start_span", boom)
    failed = failure_counts("openai_agents.").get("openai_agents.on_span_start", 0)
    with agl.rollout_context("ro-boom", 1):
        assert _run("chat", url.for_rollout("ro-boom", 1)).final_output == "Paris is the capital of France."
    assert failure_counts("openai_agents.")["openai_agents.on_span_start"] > failed


@pytest.mark.parametrize("how", ["agents.set_trace_processors", "provider.set_processors"])
def test_processors_replaced_after_instrument_keep_agl_spans(
    how: str, gateway_url: Any, memory_spans: Any, user_processor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The offline pattern: instrument, then the app drops the SDK's uploader by setting its own list."""
    monkeypatch.delenv("AGL_OPENAI_AGENTS_REPLACE_EXPORTER")
    provider, exporter = memory_spans
    before = processors()
    agl.instrument("openai", "openai_agents", tracer_provider=provider)
    inst = get_instrumentor("openai_agents")
    mine = UserProcessor()
    try:
        if how == "agents.set_trace_processors":
            agents.set_trace_processors([mine])  # imported before agl.instrument(): same outcome
        else:
            get_trace_provider().set_processors([mine])
        assert processors() == (mine, inst.processor)  # the app's list, then agl's
        assert inst.health().ok, inst.health().problems

        with agl.rollout_context("ro-replaced", 1):
            result = _run("chat", gateway_url.for_rollout("ro-replaced", 1))
        assert result.final_output == "Paris is the capital of France."
        spans = exporter.get_finished_spans()
        index = {s.context.span_id: s for s in spans}
        agents_seen = [s.attributes[sc.GEN_AI_AGENT_NAME] for s in by_name(spans, sc.SPAN_INVOKE_AGENT)]
        assert sorted(agents_seen) == ["answerer", "researcher", "triage"]
        tools = by_name(spans, sc.SPAN_EXECUTE_TOOL)
        assert tools and {(t.attributes[sc.GEN_AI_TOOL_NAME], agent_above(t, index)) for t in tools} == {
            ("search", "researcher")
        }
        assert {agent_above(c, index) for c in by_name(spans, sc.SPAN_CHAT)} == {
            "triage",
            "researcher",
            "answerer",
        }
        assert mine.spans  # the app's own processor gets everything too
    finally:
        agl.uninstrument("openai_agents", "openai")
        set_trace_processors(list(before))
    # uninstrument removed the wrapper: a later replacement no longer re-adds agl's processor
    assert vars(type(get_trace_provider())).get("set_processors") is not None
    set_trace_processors([mine])
    assert processors() == (mine,)
    set_trace_processors(list(before))


def test_health_reports_a_processor_dropped_behind_agls_back(
    memory_spans: Any, user_processor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AGL_OPENAI_AGENTS_REPLACE_EXPORTER")
    provider, _exporter = memory_spans
    before = processors()
    agl.instrument("openai_agents", tracer_provider=provider)
    inst = get_instrumentor("openai_agents")
    assert inst.health().ok
    multi = get_trace_provider()._multi_processor
    try:
        multi._processors = (user_processor,)  # bypasses set_processors, as a custom provider might
        health = inst.health()
        assert not health.ok and "no longer registered" in health.problems[0]
    finally:
        agl.uninstrument("openai_agents")
        set_trace_processors(list(before))
