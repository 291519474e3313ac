"""``agl.agent`` / ``agl.tool`` on a plain openai-client agent through agl's real gateway (scripted model):
the agent's calls are attributed to it, a tool that raises is an ERROR span that AIR charges to the call
that issued it, ``Adapter(agents=[...])`` selects one agent's calls, and the decorators keep working for
async functions and returned errors."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry import baggage
from opentelemetry import context as otel_context

openai = pytest.importorskip("openai")

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.adapter import Adapter  # noqa: E402
from agl.adapter.air_rules import AIR  # noqa: E402
from agl.gateway.testing import reply, tool_call  # noqa: E402
from agl.instrumentation.agent import agent_context, request_context  # noqa: E402
from agl.runner.runner import Runner  # noqa: E402
from agl.types import LLM, NewRollout, Resources  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "count_words",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def agl_policy() -> Callable[[Any], Any]:
    """Counter: first a tool call (id from the text), then an answer once the tool replied."""

    def policy(request: Any) -> Any:
        if request.messages[-1]["role"] == "tool":
            return reply("the answer")
        if request.tools:
            text = request.messages[-1]["content"]
            return reply(None, tool_call("count_words", text=text, id=f"call-{len(text.split())}"))
        return reply("checked")

    return policy


@agl.tool
def count_words(text: str) -> int:
    if "boom" in text:
        raise ValueError("cannot count a boom")
    return len(text.split())


def plain_agent(task: dict[str, Any], resources: Resources) -> float:
    """A plain-client agent with a tool, then a second agent that checks the answer (no tools)."""
    llm = resources.llm
    client = openai.OpenAI(base_url=llm.base_url, api_key="sk-agl-test", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["text"]}]
    with agl.agent("counter"):
        first = client.chat.completions.create(model=llm.model, messages=messages, tools=TOOLS)
        message = first.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            try:
                result: Any = count_words(**json.loads(call.function.arguments))
            except ValueError as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
        client.chat.completions.create(model=llm.model, messages=messages, tools=TOOLS)
    with agl.agent("checker"):
        client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "ok?"}])
    return 1.0


def _run(agl_gateway: Any, tasks: list[dict[str, Any]]) -> list[str]:
    store = agl_gateway.store
    version = store.add_resources({"main": LLM(base_url=str(agl_gateway), model="scripted")}).version
    rollouts = [NewRollout(input=t, resources_version=version) for t in tasks]
    ids = [r.id for r in store.enqueue(rollouts)]
    stats = Runner(plain_agent, store, claim_timeout_s=0.2).run(max_rollouts=len(tasks))
    assert stats.succeeded == len(tasks), stats.errors
    return ids


def _an_installed_framework() -> list[str]:
    from agl.instrumentation import available_instrumentors, is_installed

    found = available_instrumentors()
    return [
        n
        for n in ("langchain", "crewai", "autogen", "openai_agents")
        if n in found and is_installed(found[n])
    ][:1]


def test_plain_agent_gets_agent_and_tool_spans(agl_gateway: Any, agl_tracer: Any, caplog: Any) -> None:
    # a framework instrumented but unused must raise no false alarm (when one is installed here)
    agl_tracer.instrument("openai", *_an_installed_framework())
    with caplog.at_level(logging.WARNING, "agl.runner"):
        ok, boom = _run(agl_gateway, [{"text": "one two three"}, {"text": "boom goes it"}])
    assert "ran under no agent span" not in caplog.text
    store = agl_gateway.store

    spans = store.query_spans(rollout_id=boom, attempt=1)
    (tool,) = [s for s in spans if s.name == sc.SPAN_EXECUTE_TOOL]
    assert tool.attributes[sc.GEN_AI_TOOL_NAME] == "count_words"
    assert json.loads(tool.attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS]) == {"text": "boom goes it"}
    assert tool.status.code == "ERROR" and tool.attributes[sc.ERROR_TYPE] == "ValueError"
    agents = {s.attributes[sc.GEN_AI_AGENT_NAME] for s in spans if s.name == sc.SPAN_INVOKE_AGENT}
    assert agents == {"counter", "checker"}

    servers = sorted(
        (s for s in spans if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER), key=lambda s: s.start_ns
    )
    # each call's baggage named its agent to the gateway (which serves that agent's adapter by it)
    assert [s.attributes.get(sc.AGL_LLM_AGENT) for s in servers] == ["counter", "counter", "checker"]

    transitions = Adapter(air=AIR()).transitions(spans, rollout=store.get_rollout(boom))
    assert [t.agent for t in transitions] == ["counter", "counter", "checker"]
    # the failing tool is charged to the call that issued it (the first), not to the others
    assert [t.intermediate_reward for t in transitions] == [pytest.approx(-0.1), 0.0, 0.0]

    ok_spans = store.query_spans(rollout_id=ok, attempt=1)
    (ok_tool,) = [s for s in ok_spans if s.name == sc.SPAN_EXECUTE_TOOL]
    assert ok_tool.status.code != "ERROR" and ok_tool.attributes[sc.GEN_AI_TOOL_CALL_RESULT] == "3"
    ok_transitions = Adapter(air=AIR()).transitions(ok_spans, rollout=store.get_rollout(ok))
    assert all(t.intermediate_reward == 0.0 for t in ok_transitions)

    checker = Adapter(agents=["checker"]).transitions(ok_spans, rollout=store.get_rollout(ok))
    assert [t.agent for t in checker] == ["checker"]  # only the named agent's calls are trained


def test_context_manager_call_id_and_returned_error(agl_tracer: Any) -> None:
    agl_tracer.instrument("openai")  # agl's spans go to the test's provider
    with agl.rollout_context("ro-cm", 1):
        with agl.agent("solo", agent_id="a-1"):
            with agl.tool("lookup", call_id="c-9", arguments='{"q": "x"}') as t:
                t.result({"found": False})
                t.error("not found")
    spans = {s.name: s for s in agl_tracer.spans()}
    tool, agent = spans[sc.SPAN_EXECUTE_TOOL], spans[sc.SPAN_INVOKE_AGENT]
    assert tool.parent is not None and tool.parent.span_id == agent.context.span_id
    assert tool.attributes[sc.GEN_AI_TOOL_CALL_ID] == "c-9"
    assert tool.attributes[sc.GEN_AI_TOOL_CALL_RESULT] == '{"found":false}'
    assert tool.status.status_code.name == "ERROR" and tool.status.description == "not found"
    assert agent.attributes[sc.GEN_AI_AGENT_ID] == "a-1" and agent.status.status_code.name != "ERROR"


def test_async_decorators_and_is_error(agl_tracer: Any) -> None:
    agl_tracer.instrument("openai")

    @agl.tool("fetch", is_error=lambda r: r.startswith("error"))
    async def fetch(url: str) -> str:
        await asyncio.sleep(0)
        return "error: 404" if "missing" in url else "page"

    @agl.agent("browser")
    async def browse() -> list[str]:
        return [await fetch("https://x/ok"), await fetch(url="https://x/missing")]

    async def main() -> list[str]:
        async with agl.rollout_context("ro-async", 1):
            return await browse()

    assert asyncio.run(main()) == ["page", "error: 404"]
    tools = [s for s in agl_tracer.spans() if s.name == sc.SPAN_EXECUTE_TOOL]
    assert [s.status.status_code.name for s in tools] == ["UNSET", "ERROR"]
    assert json.loads(tools[1].attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS]) == {"url": "https://x/missing"}
    (agent,) = [s for s in agl_tracer.spans() if s.name == sc.SPAN_INVOKE_AGENT]
    assert all(s.parent.span_id == agent.context.span_id for s in tools)


def test_bad_names_are_refused() -> None:
    with pytest.raises(ValueError, match="agent's name"):
        agl.agent("")
    with pytest.raises(ValueError, match="non-empty str"):
        agl.tool(name="")
    with pytest.raises(TypeError, match="name is needed"):
        with agl.tool():
            pass


# ------------------------------------------------------------------ the calling agent in the baggage


def test_agent_baggage_nests_and_ends_with_the_span(agl_tracer: Any) -> None:
    def calling() -> str | None:
        return baggage.get_baggage(sc.BAGGAGE_AGENT, request_context(otel_context.get_current()))

    assert calling() is None
    with agl.agent("writer"):
        assert calling() == "writer"
        with agl.agent("rewriter"):
            assert calling() == "rewriter"
        assert calling() == "writer"  # the inner agent's end restores the outer one's name
    assert calling() is None


def test_agent_context_removes_and_a_dead_scope_names_the_live_one_around_it() -> None:
    outer_live, inner_live = [True], [True]
    ctx = agent_context(otel_context.Context(), "writer", live=lambda: outer_live[0])
    assert baggage.get_baggage(sc.BAGGAGE_AGENT, agent_context(ctx, None)) is None
    inner = agent_context(ctx, "rewriter", live=lambda: inner_live[0])
    assert baggage.get_baggage(sc.BAGGAGE_AGENT, request_context(inner)) == "rewriter"
    inner_live[0] = False  # the inner run ended but its context leaked: the outer agent's name is sent
    assert baggage.get_baggage(sc.BAGGAGE_AGENT, request_context(inner)) == "writer"
    outer_live[0] = False  # both ended: nobody's call
    assert baggage.get_baggage(sc.BAGGAGE_AGENT, request_context(inner)) is None
    # an agent opened in the leaked context (agl.agent: always live) names itself again
    again = agent_context(inner, "checker")
    assert baggage.get_baggage(sc.BAGGAGE_AGENT, request_context(again)) == "checker"
