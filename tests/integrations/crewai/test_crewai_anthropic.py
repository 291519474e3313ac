"""A CrewAI crew on an ``anthropic/`` model (CrewAI's native Anthropic provider, the real anthropic SDK)
through agl's gateway Messages API: rollouts run by agl's Runner, every LLM call under its agent, exact ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("crewai")
pytest.importorskip("anthropic")

from crewai_research_app import build_crew, crew_inputs  # noqa: E402
from crewai_support import agent_above, run_rollouts  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.adapter import Adapter  # noqa: E402

TASKS = [{"country": "france", "sloppy": True}, {"country": "japan"}]


@pytest.fixture(scope="module")
def agl_model(agl_policy: Any, agl_agent_of: Any) -> Any:
    """The suite's scripted model, answering to any model name (CrewAI needs a claude-* one)."""
    from agl.testing.fixtures import RecordingModel

    return RecordingModel(agl_policy, agl_agent_of, accept_any_model=True)


@pytest.fixture
def instrumented(clean_agl: None) -> Iterator[None]:
    assert agl.instrument("anthropic", "crewai") == ["anthropic", "crewai"]
    yield


def agent(task: Any, resources: Any) -> float:
    from crewai import LLM

    # the Anthropic SDK appends /v1/messages itself: its base URL is the rollout URL without /v1;
    # CrewAI sends only claude-* names to its native Anthropic provider
    base = resources.llm.base_url.removesuffix("/v1")
    llm = LLM(model="anthropic/claude-scripted", base_url=base, api_key="sk-agl-test", max_tokens=512)
    out = build_crew(llm).kickoff(inputs=crew_inputs(task))
    capital = {"france": "Paris", "japan": "Tokyo"}[task["country"]]
    return 1.0 if capital in str(out.raw) else 0.0


def test_crew_on_an_anthropic_model_trains_through_the_gateway(gateway: Any, instrumented: None) -> None:
    url, store = gateway
    ids = run_rollouts(agent, store, str(url), TASKS)
    transitions = Adapter().from_store(store, ids)
    assert transitions and all(t.exact for t in transitions)
    for rid in ids:
        spans = store.query_spans(rollout_id=rid, attempt=1)
        index = {s.span_id: s for s in spans}
        servers = [s for s in spans if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER]
        assert servers and {s.attributes[sc.AGL_LLM_API] for s in servers} == {"messages"}
        assert {agent_above(s, index) for s in servers} == {"researcher", "writer"}
        clients = [s for s in spans if s.attributes.get(sc.AGL_INTEGRATION) == "anthropic"]
        assert len(clients) == len(servers)
        # the anthropic SDK 2.x opens a GenAI span of its own around messages.create and sends its
        # traceparent: the gateway's span is the child of that span, which holds agl's client span
        for server in servers:
            parent = index[server.parent_id]
            assert parent.attributes.get(sc.GEN_AI_OPERATION_NAME) == sc.OP_CHAT, parent.name
