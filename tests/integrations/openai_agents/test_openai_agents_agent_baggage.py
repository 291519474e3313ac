"""Each Agents SDK ``Agent``'s model calls reach the gateway naming that agent (``Agent.name``).

The integration puts the agent's name in the W3C baggage (``agl.agent``) for the length of its agent
span, the openai integration sends it with each request, and the gateway records it on its server
span (``agl.llm.agent``): the name a backend with an adapter per agent serves the call by. Real SDK
(triage → researcher → answerer, handoffs), real ``AsyncOpenAI`` client, agl's gateway with the
scripted backend on 127.0.0.1, rollouts through agl's Runner.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("agents")

from openai_agents_rag_app import expected_calls, make_model  # noqa: E402
from test_openai_agents_scenario import make_agent, run_rollouts  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402

QUESTION = {"question": "What is the capital of France? [sloppy]", "answer": "Paris"}


@pytest.fixture
def instrumented(clean_agl: None) -> None:
    agl.instrument("openai", "openai_agents")


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_each_agent_calls_as_itself(api: str, gateway: Any, scripted_model: Any, instrumented: None) -> None:
    url, store = gateway
    (rid,) = run_rollouts(make_agent(api, "run"), store, str(url), [QUESTION])
    servers = sorted(
        (
            s
            for s in store.query_spans(rollout_id=rid, attempt=1)
            if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER
        ),
        key=lambda s: s.start_ns,
    )
    expected = [agent for agent, _ in expected_calls(QUESTION["question"])]
    assert {"triage", "researcher", "answerer"} <= set(expected)
    assert [s.attributes.get(sc.AGL_LLM_AGENT) for s in servers] == expected
    # and the backend itself was handed the same agent with each request (what it routes by)
    assert [call.request.agent for call in scripted_model.of(rid)] == expected


@pytest.mark.parametrize("adapter_gateway", [["researcher", "answerer"]], indirect=True)
def test_each_agent_is_served_by_its_own_adapter(
    adapter_gateway: Any, agl_tracer: Any, clean_agl: None
) -> None:
    """The whole way: a tiny random Llama with a LoRA adapter per trained agent behind the gateway;
    each SDK ``Agent``'s model call is served by its own adapter, an untrained agent's by the base."""
    import asyncio

    from agents import Agent, ModelSettings
    from agents import Runner as SdkRunner

    assert agl_tracer.instrument("openai", "openai_agents") == ["openai", "openai_agents"]
    settings = ModelSettings(max_tokens=3)

    async def run() -> None:
        model = make_model("chat", adapter_gateway.url, adapter_gateway.MODEL)
        for name in ("researcher", "answerer", "triage"):
            agent = Agent(
                name=name, instructions=f"You are the {name}.", model=model, model_settings=settings
            )
            await SdkRunner.run(agent, "What is the capital of France?")

    rid = adapter_gateway.run(lambda: asyncio.run(run()))
    assert adapter_gateway.served(rid) == [
        ("researcher", "researcher"),
        ("answerer", "answerer"),
        ("triage", sc.BASE_ADAPTER),  # not trained: served by the base model
    ]
