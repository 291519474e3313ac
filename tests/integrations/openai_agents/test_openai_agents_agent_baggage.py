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

from openai_agents_rag_app import expected_calls  # noqa: E402
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
