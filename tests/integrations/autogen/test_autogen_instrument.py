"""The AutoGen instrumentor on its own: reversible, idempotent, spans in agl's shape on agl's provider,
one turn span per agent turn however the agent is called, every tool call (and every way a tool call
fails) as an ``execute_tool`` span, and the application's behaviour unchanged."""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import sys
from typing import Any

import pytest

pytest.importorskip("autogen_agentchat")

import openai  # noqa: E402
from autogen_agentchat.agents import AssistantAgent  # noqa: E402
from autogen_agentchat.messages import TextMessage  # noqa: E402
from autogen_agentchat.tools import AgentTool  # noqa: E402
from autogen_core import CancellationToken  # noqa: E402
from autogen_core.tools import FunctionTool  # noqa: E402
from autogen_math_app import SOLVER, VERIFIER, build_solver, build_team, calculator, make_client  # noqa: E402
from autogen_support import run_rollouts, tree  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.adapter import Adapter  # noqa: E402
from agl.adapter.air_rules import AIR  # noqa: E402
from agl.gateway.testing import ScriptedBackend, reply, serve_gateway, tool_call  # noqa: E402
from agl.instrumentation import failure_counts, get_instrumentor  # noqa: E402
from agl.integrations.autogen import (
    _spans,  # noqa: E402
)
from agl.store import open as open_store  # noqa: E402

#: every module and class whose attributes agl may replace: compared whole before and after
WATCHED = (
    ("autogen_agentchat.agents._base_chat_agent", None),
    ("autogen_agentchat.teams._group_chat._chat_agent_container", None),
    ("autogen_core.tools._base", None),
    ("autogen_agentchat.agents._assistant_agent", "AssistantAgent"),
    ("autogen_agentchat.agents._code_executor_agent", "CodeExecutorAgent"),
    ("autogen_agentchat.agents._society_of_mind_agent", "SocietyOfMindAgent"),
    ("autogen_agentchat.agents._user_proxy_agent", "UserProxyAgent"),
    ("autogen_agentchat.agents._message_filter_agent", "MessageFilterAgent"),
    ("autogen_agentchat.teams._group_chat._selector_group_chat", "SelectorGroupChatManager"),
    ("autogen_agentchat.agents._base_chat_agent", "BaseChatAgent"),
    ("autogen_core.tools._base", "BaseTool"),
)


def _watched() -> list[Any]:
    out = []
    for module_name, class_name in WATCHED:
        module = importlib.import_module(module_name)
        out.append(getattr(module, class_name) if class_name else module)
    return out


def _snapshot() -> list[dict[str, Any]]:
    return [dict(vars(owner)) for owner in _watched()]


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return all(x.keys() == y.keys() and all(x[k] is y[k] for k in x) for x, y in zip(a, b, strict=True))


def _by_name(exporter: Any, name: str) -> list[Any]:
    return sorted((s for s in exporter.get_finished_spans() if s.name == name), key=lambda s: s.start_time)


def _parent(span: Any, exporter: Any) -> Any:
    spans = {s.context.span_id: s for s in exporter.get_finished_spans()}
    return spans.get(span.parent.span_id) if span.parent is not None else None


async def _solve(url: str, question: str = "What is 2+3?") -> Any:
    client = make_client(url)
    try:
        return await build_solver(client).run(task=question)
    finally:
        await client.close()


def test_instrument_twice_is_once_and_uninstrument_leaves_nothing(
    memory_spans: Any, gateway_url: str
) -> None:
    provider, exporter = memory_spans
    agl.uninstrument("autogen")  # start clean even if an earlier test (an example app) left it on
    before = _snapshot()
    assert agl.instrument("autogen", tracer_provider=provider) == ["autogen"]
    inst = get_instrumentor("autogen")
    patched = [(owner, attr, vars(owner)[attr]) for owner, attr in inst.patches]
    assert len(patched) >= 8 and not _same(before, _snapshot())
    changed = {
        (i, k)
        for i, (x, y) in enumerate(zip(before, _snapshot(), strict=True))
        for k in x
        if x[k] is not y[k]
    }
    owners = _watched()
    tracked = [p for p in patched if any(p[0] is o for o in owners)]  # (an MCP module may be patched too)
    assert len(changed) == len(tracked)  # nothing is replaced that agl does not track

    assert agl.instrument("autogen", tracer_provider=provider) == ["autogen"]  # again: patches once
    assert [(o, a, vars(o)[a]) for o, a in inst.patches] == patched
    assert all(vars(o)[a] is r for o, a, r in patched)

    agl.uninstrument("autogen")
    assert _same(before, _snapshot()) and inst.patches == []
    assert not inst.is_instrumented_by_opentelemetry
    result = asyncio.run(_solve(gateway_url))
    assert result.messages[-1].content == "ANSWER: 5"
    assert exporter.get_finished_spans() == ()  # uninstrumented: not a single span on agl's provider

    agl.instrument("autogen", tracer_provider=provider)  # and it comes back
    asyncio.run(_solve(gateway_url))
    assert [s.attributes[sc.GEN_AI_AGENT_NAME] for s in _by_name(exporter, sc.SPAN_INVOKE_AGENT)] == [
        "solver"
    ]


def test_spans_land_on_agls_provider_in_agls_shape(memory_spans: Any, gateway_url: str) -> None:
    provider, exporter = memory_spans
    agl.instrument("openai", "autogen", tracer_provider=provider)  # not the global provider
    asyncio.run(_solve(gateway_url))
    spans = exporter.get_finished_spans()
    assert not [s for s in spans if s.name.startswith(f"{sc.SPAN_INVOKE_AGENT} ")]  # no AutoGen-named copy
    [turn] = _by_name(exporter, sc.SPAN_INVOKE_AGENT)
    assert turn.kind.name == "INTERNAL"
    assert turn.attributes[sc.GEN_AI_AGENT_NAME] == "solver"
    assert turn.attributes[sc.GEN_AI_OPERATION_NAME] == sc.OP_INVOKE_AGENT
    assert turn.attributes[sc.AGL_INTEGRATION] == "autogen"
    chats = _by_name(exporter, sc.SPAN_CHAT)
    assert len(chats) == 2 and all(_parent(c, exporter) is turn for c in chats)
    [tool] = _by_name(exporter, sc.SPAN_EXECUTE_TOOL)
    assert _parent(tool, exporter) is turn and tool.kind.name == "INTERNAL"
    issued = json.loads(chats[0].attributes[sc.GEN_AI_OUTPUT_MESSAGES])[0]["tool_calls"][0]
    assert tool.attributes[sc.GEN_AI_TOOL_CALL_ID] == issued["id"]
    assert tool.attributes[sc.GEN_AI_TOOL_NAME] == "calculator"
    assert tool.attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS] == issued["function"]["arguments"]
    assert tool.attributes[sc.GEN_AI_TOOL_CALL_RESULT] == "5"
    assert tool.status.status_code.name == "UNSET"
    assert chats[0].end_time <= tool.start_time <= tool.end_time <= chats[1].start_time


def test_one_turn_span_however_the_agent_is_called(memory_spans: Any, gateway_url: str) -> None:
    provider, exporter = memory_spans
    agl.instrument("openai", "autogen", tracer_provider=provider)

    async def calls() -> None:
        client = make_client(gateway_url)
        task = [TextMessage(content="What is 2+3?", source="user")]
        await build_solver(client).on_messages(task, CancellationToken())
        async for _ in build_solver(client).on_messages_stream(task, CancellationToken()):
            pass
        await build_solver(client).run(task="What is 2+3?")
        async for _ in build_solver(client, stream=True).run_stream(task="What is 2+3?"):
            pass
        await build_team(client).run(task="What is 2+3?")
        await client.close()

    asyncio.run(calls())
    turns = _by_name(exporter, sc.SPAN_INVOKE_AGENT)
    assert [t.attributes[sc.GEN_AI_AGENT_NAME] for t in turns] == ["solver"] * 5 + ["verifier"]
    for chat in _by_name(exporter, sc.SPAN_CHAT):
        assert _parent(chat, exporter) in turns  # every LLM call directly under its agent's turn
    assert len(_by_name(exporter, sc.SPAN_CHAT)) == 2 * 5 + 1


def test_agent_used_as_a_tool_nests_its_turn_inside_the_tool_call(memory_spans: Any) -> None:
    provider, exporter = memory_spans
    agl.instrument("openai", "autogen", tracer_provider=provider)
    backend = ScriptedBackend(
        [
            reply(None, tool_call("verifier", task="ANSWER: 5 to What is 2+3?")),
            reply("VERIFIED 5"),
            reply("done"),
        ]
    )

    async def run(url: str) -> Any:
        client = make_client(url)
        verifier = AssistantAgent("verifier", model_client=client, system_message=VERIFIER)
        lead = AssistantAgent("lead", model_client=client, system_message=SOLVER, tools=[AgentTool(verifier)])
        result = await lead.run(task="What is 2+3?")
        await client.close()
        return result

    with serve_gateway(backend) as url:
        asyncio.run(run(str(url)))
    lead, inner = _by_name(exporter, sc.SPAN_INVOKE_AGENT)
    [tool] = _by_name(exporter, sc.SPAN_EXECUTE_TOOL)
    assert (
        lead.attributes[sc.GEN_AI_AGENT_NAME] == "lead"
        and inner.attributes[sc.GEN_AI_AGENT_NAME] == "verifier"
    )
    assert _parent(tool, exporter) is lead and _parent(inner, exporter) is tool
    assert tool.attributes[sc.GEN_AI_TOOL_CALL_RESULT].endswith("VERIFIED 5")
    assert [_parent(c, exporter) for c in _by_name(exporter, sc.SPAN_CHAT)] == [lead, inner]


def test_tool_calls_that_fail_without_raising_are_error_spans_and_penalised_once(
    clean_agl: None, tmp_path: Any
) -> None:
    """Malformed JSON arguments and an unknown tool never reach a tool (AutoGen returns
    ``FunctionExecutionResult(is_error=True)``): they still get an ERROR ``execute_tool`` span, and AIR
    penalises the LLM call that issued each of them exactly once."""
    agl.instrument("openai", "autogen")
    script = [
        reply(None, tool_call("calculator", '{"expression": ')),
        reply(None, tool_call("abacus", expression="2+3")),
        reply(None, tool_call("calculator", expression="2+3")),
        reply("ANSWER: 5"),
    ]
    store = open_store(f"sqlite:///{tmp_path / 'agl.db'}")

    async def agent(task: str, resources: Any) -> float:
        client = make_client(resources.llm.base_url)
        solver = AssistantAgent(
            "solver",
            model_client=client,
            tools=[FunctionTool(calculator, description="calc")],
            max_tool_iterations=4,
        )
        result = await solver.run(task=task)
        await client.close()
        return 1.0 if result.messages[-1].content == "ANSWER: 5" else 0.0

    with serve_gateway(ScriptedBackend(script), store) as url:
        (rid,) = run_rollouts(agent, store, str(url), ["What is 2+3?"])
    spans = store.query_spans(rollout_id=rid, attempt=1)
    _, _, agent_above = tree(spans)
    tools = sorted((s for s in spans if s.name == sc.SPAN_EXECUTE_TOOL), key=lambda s: s.start_ns)
    assert [t.attributes[sc.GEN_AI_TOOL_NAME] for t in tools] == ["calculator", "abacus", "calculator"]
    assert [t.status.code for t in tools] == ["ERROR", "ERROR", "UNSET"]
    assert all(agent_above(t) == "solver" and sc.GEN_AI_TOOL_CALL_ID in t.attributes for t in tools)
    assert tools[0].attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS] == '{"expression": '
    assert tools[0].attributes[sc.GEN_AI_TOOL_CALL_RESULT].startswith("Error:")
    assert "not found" in tools[1].attributes[sc.GEN_AI_TOOL_CALL_RESULT]
    assert tools[2].attributes[sc.GEN_AI_TOOL_CALL_RESULT] == "5"

    [transitions] = [Adapter().from_store(store, [rid])]
    assert [t.agent for t in transitions] == ["solver"] * 4
    penalty = AIR().tool_error
    assert [t.intermediate_reward for t in transitions] == [penalty, penalty, 0.0, 0.0]
    assert [t.final_reward for t in transitions] == [1.0] * 4
    store.close()


def test_parallel_tool_calls_each_get_their_own_span(memory_spans: Any) -> None:
    provider, exporter = memory_spans
    agl.instrument("openai", "autogen", tracer_provider=provider)
    both = reply(None, tool_call("calculator", expression="2+3"), tool_call("calculator", expression="6*"))
    with serve_gateway(ScriptedBackend([both, reply("ANSWER: 5")])) as url:
        result = asyncio.run(_solve(str(url)))
    assert result.messages[-1].content == "ANSWER: 5"
    [turn] = _by_name(exporter, sc.SPAN_INVOKE_AGENT)
    first_chat = _by_name(exporter, sc.SPAN_CHAT)[0]
    issued = {
        c["id"]: c for c in json.loads(first_chat.attributes[sc.GEN_AI_OUTPUT_MESSAGES])[0]["tool_calls"]
    }
    tools = {t.attributes[sc.GEN_AI_TOOL_CALL_ID]: t for t in _by_name(exporter, sc.SPAN_EXECUTE_TOOL)}
    assert tools.keys() == issued.keys() and len(tools) == 2
    for call_id, span in tools.items():
        assert _parent(span, exporter) is turn
        assert span.attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS] == issued[call_id]["function"]["arguments"]
        ok = json.loads(issued[call_id]["function"]["arguments"])["expression"] == "2+3"
        assert span.status.status_code.name == ("UNSET" if ok else "ERROR")
        assert (span.attributes[sc.GEN_AI_TOOL_CALL_RESULT] == "5") is ok


def _summary(result: Any) -> list[tuple[str, str, str]]:
    out = []
    for m in result.messages:
        content = m.content if isinstance(m.content, str) else [getattr(c, "content", "") for c in m.content]
        out.append((type(m).__name__, m.source, str(content)))
    return out


def test_application_behaviour_is_unchanged(memory_spans: Any, gateway_url: str) -> None:
    provider, exporter = memory_spans

    async def team(question: str) -> Any:
        client = make_client(gateway_url)
        result = await build_team(client, "selector").run(task=question)
        await client.close()
        return result

    plain = [_summary(asyncio.run(team(q))) for q in ("What is 6*7? [sloppy]", "What is 2+3?")]
    agl.instrument("openai", "autogen", tracer_provider=provider)
    traced = [_summary(asyncio.run(team(q))) for q in ("What is 6*7? [sloppy]", "What is 2+3?")]
    assert traced == plain and exporter.get_finished_spans()

    # the model failing: the same exception reaches the application, and the turn is an ERROR span
    failing = ScriptedBackend([reply(error="the model is down")])
    errors = []
    for instrumented in (True, False):
        if not instrumented:
            agl.uninstrument("autogen", "openai")
        with serve_gateway(failing) as url, pytest.raises(openai.APIStatusError) as info:
            asyncio.run(_solve(str(url)))
        errors.append((type(info.value), info.value.status_code))
    assert errors[0] == errors[1]
    [turn] = [t for t in _by_name(exporter, sc.SPAN_INVOKE_AGENT) if t.status.status_code.name == "ERROR"]
    assert turn.attributes[sc.GEN_AI_AGENT_NAME] == "solver"


def test_agl_failures_never_break_the_run(
    memory_spans: Any, gateway_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider, _ = memory_spans
    agl.instrument("autogen", tracer_provider=provider)

    def broken(self: Any, *args: Any) -> None:
        raise RuntimeError("agl bug")

    monkeypatch.setattr(_spans.ToolCall, "finish", broken)
    errors = failure_counts("autogen.tool_result").get("autogen.tool_result", 0)
    result = asyncio.run(_solve(gateway_url))
    assert result.messages[-1].content == "ANSWER: 5"
    assert failure_counts("autogen.tool_result")["autogen.tool_result"] == errors + 1


def test_mcp_call_site_is_instrumented_once_imported(memory_spans: Any, gateway_url: str) -> None:
    pytest.importorskip("mcp")
    provider, _ = memory_spans
    name = "autogen_ext.tools.mcp._workbench"
    if name in sys.modules:  # imported by an earlier test: instrument() patches it at once
        workbench = sys.modules[name]
        original = vars(workbench)["trace_tool_span"]
        agl.instrument("autogen", tracer_provider=provider)
    else:
        agl.instrument("autogen", tracer_provider=provider)
        workbench = importlib.import_module(name)  # imported after instrument()
        original = vars(workbench)["trace_tool_span"]
        asyncio.run(_solve(gateway_url))  # the next tool call notices the module
    replaced = vars(workbench)["trace_tool_span"]
    assert replaced is not original and replaced.__wrapped__ is original
    assert (workbench, "trace_tool_span") in get_instrumentor("autogen").patches
    agl.uninstrument("autogen")
    assert vars(workbench)["trace_tool_span"] is original


def test_warns_once_when_nothing_traces_the_llm_calls(
    memory_spans: Any, gateway_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    provider, exporter = memory_spans
    agl.instrument("autogen", tracer_provider=provider)  # the openai integration left out
    with caplog.at_level(logging.WARNING, logger="agl.integrations.autogen"):
        asyncio.run(_solve(gateway_url))
        asyncio.run(_solve(gateway_url))
    warned = [r for r in caplog.records if "'openai' integration is not instrumented" in r.getMessage()]
    assert len(warned) == 1
    assert _by_name(exporter, sc.SPAN_CHAT) == [] and len(_by_name(exporter, sc.SPAN_INVOKE_AGENT)) == 2


def test_no_warning_with_the_one_line_setup(
    memory_spans: Any, gateway_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    provider, exporter = memory_spans
    assert {"autogen", "openai"} <= set(
        agl.instrument(tracer_provider=provider)
    )  # every installed integration
    with caplog.at_level(logging.WARNING, logger="agl.integrations.autogen"):
        asyncio.run(_solve(gateway_url))
    assert not [r for r in caplog.records if r.name.startswith("agl.integrations.autogen")]
    assert len(_by_name(exporter, sc.SPAN_CHAT)) == 2
    agl.uninstrument()
