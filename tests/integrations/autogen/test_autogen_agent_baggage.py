"""Each AutoGen agent's model calls reach the gateway naming that agent (the agent's ``name``).

The integration puts the agent's name in the W3C baggage (``agl.agent``) for the length of its
``invoke_agent`` span, the openai integration sends it with each request, and the gateway records it
on its server span (``agl.llm.agent``): the name a backend with an adapter per agent serves the call
by. Real AutoGen (``solver`` and ``verifier`` in a group chat), real ``OpenAIChatCompletionClient``,
agl's gateway with the scripted backend on 127.0.0.1, rollouts through agl's Runner.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("autogen_agentchat")

from autogen_math_app import expected_calls  # noqa: E402
from autogen_support import run_rollouts  # noqa: E402
from test_autogen_scenario import make_agent  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402

QUESTION = {"question": "What is 6*7? [sloppy]", "answer": "42"}


@pytest.fixture
def instrumented(clean_agl: None) -> Iterator[None]:
    assert agl.instrument("openai", "autogen") == ["openai", "autogen"]
    yield


@pytest.mark.parametrize("mode", ["run", "run_stream"])
def test_each_agent_calls_as_itself(mode: str, gateway: Any, scripted_model: Any, instrumented: None) -> None:
    url, store = gateway
    (rid,) = run_rollouts(make_agent("round_robin", mode), store, str(url), [QUESTION])
    servers = sorted(
        (
            s
            for s in store.query_spans(rollout_id=rid, attempt=1)
            if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER
        ),
        key=lambda s: s.start_ns,
    )
    expected = [agent for agent, _ in expected_calls(QUESTION["question"], "round_robin")]
    assert {"solver", "verifier"} <= set(expected)
    assert [s.attributes.get(sc.AGL_LLM_AGENT) for s in servers] == expected
    # and the backend itself was handed the same agent with each request (what it routes by)
    assert [call.request.agent for call in scripted_model.of(rid)] == expected


@pytest.mark.parametrize("adapter_gateway", [["solver", "verifier"]], indirect=True)
def test_each_agent_is_served_by_its_own_adapter(adapter_gateway: Any, agl_tracer: Any) -> None:
    """The whole way: a tiny random Llama with a LoRA adapter per trained agent behind the gateway;
    each AutoGen agent's turn is served by its own adapter, an untrained agent's by the base model."""
    import asyncio

    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.teams import RoundRobinGroupChat
    from autogen_math_app import make_client

    assert agl_tracer.instrument("openai", "autogen") == ["openai", "autogen"]

    async def run_team() -> None:
        client = make_client(adapter_gateway.url, adapter_gateway.MODEL, max_tokens=3)
        agents = [AssistantAgent(name, model_client=client) for name in ("solver", "verifier", "critic")]
        try:
            await RoundRobinGroupChat(agents, max_turns=3).run(task="What is 6*7?")
        finally:
            await client.close()

    rid = adapter_gateway.run(lambda: asyncio.run(run_team()))
    assert adapter_gateway.served(rid) == [
        ("solver", "solver"),
        ("verifier", "verifier"),
        ("critic", sc.BASE_ADAPTER),  # not trained: served by the base model
    ]
