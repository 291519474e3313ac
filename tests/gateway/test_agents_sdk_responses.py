"""The OpenAI Agents SDK's default model (Responses API) runs a tool loop against the gateway."""

from __future__ import annotations

import json
from typing import Any

import pytest
from gw_helpers import server_spans

from agl import semconv as sc
from agl.gateway.testing import ScriptedBackend, reply, serve_gateway, tool_call

openai = pytest.importorskip("openai")

agents = pytest.importorskip("agents")


@pytest.fixture
def sdk_tracing_off() -> Any:
    """The SDK's default processor uploads to OpenAI: off for this test, restored after (global state)."""
    provider = agents.tracing.get_trace_provider()
    before = getattr(provider, "_manual_disabled", None)
    agents.set_tracing_disabled(True)
    yield
    if before is None and hasattr(provider, "_manual_disabled"):
        provider._manual_disabled = None
        provider._refresh_disabled_flag()
    else:
        agents.set_tracing_disabled(bool(before))


@pytest.mark.parametrize("streamed", [False, True])
async def test_agent_tool_loop_over_responses(
    store: Any, rollout: tuple[str, int], streamed: bool, sdk_tracing_off: None
) -> None:
    calls: list[tuple[int, int]] = []

    @agents.function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        calls.append((a, b))
        return a * b

    backend = ScriptedBackend(
        [reply("Multiplying.", tool_call("multiply", a=6, b=7)), reply("The answer is 42.")]
    )
    with serve_gateway(backend, store) as url:
        client = openai.AsyncOpenAI(base_url=url.for_rollout(*rollout), api_key="x")
        model = agents.OpenAIResponsesModel(model="scripted", openai_client=client)
        agent = agents.Agent(name="calculator", instructions="You multiply.", tools=[multiply], model=model)
        if streamed:
            run = agents.Runner.run_streamed(agent, "6*7?")
            async for _ in run.stream_events():
                pass
            final = run.final_output
        else:
            final = (await agents.Runner.run(agent, "6*7?")).final_output
        await client.close()
    assert final == "The answer is 42."
    assert calls == [(6, 7)]
    first, second = server_spans(store, rollout[0])
    msgs = json.loads(second.attributes[sc.GEN_AI_INPUT_MESSAGES])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[3]["content"] == "42"
    assert second.attributes[sc.AGL_LLM_PREFIX_MATCH] is True
    assert json.loads(first.attributes[sc.GEN_AI_TOOL_DEFINITIONS])[0]["function"]["name"] == "multiply"
