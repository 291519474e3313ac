"""Each CrewAI agent's LLM calls reach the gateway naming that agent (its ``role``).

The integration puts the role in the W3C baggage (``agl.agent``) for the length of the agent's
``invoke_agent`` span (its tools included), the openai integration sends it with each request, and
the gateway records it on its server span (``agl.llm.agent``): the name a backend with an adapter per
agent serves the call by. Real CrewAI (researcher → writer; and the hierarchical process, where a
manager delegates to them), its native OpenAI provider, agl's gateway with the scripted backend on
127.0.0.1, rollouts through agl's Runner.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("crewai")

from crewai_research_app import MANAGER, expected_calls  # noqa: E402
from crewai_support import by_time, run_rollouts  # noqa: E402
from test_crewai_scenario import make_agent  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402

TASK = {"country": "france", "sloppy": True}


@pytest.fixture
def instrumented(clean_agl: None) -> Iterator[None]:
    assert agl.instrument("openai", "crewai") == ["openai", "crewai"]
    yield


@pytest.mark.parametrize("process", ["sequential", "hierarchical"])
def test_each_role_calls_as_itself(
    process: str, gateway: Any, scripted_model: Any, instrumented: None
) -> None:
    url, store = gateway
    (rid,) = run_rollouts(make_agent("kickoff", False, False, process), store, str(url), [TASK])
    spans = store.query_spans(rollout_id=rid, attempt=1)
    servers = by_time(s for s in spans if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER)
    expected = expected_calls(TASK, process)
    roles = {"researcher", "writer"} | ({MANAGER} if process == "hierarchical" else set())
    assert set(expected) == roles
    # a delegated coworker's calls name the coworker, and the manager's name it again after
    assert [s.attributes.get(sc.AGL_LLM_AGENT) for s in servers] == expected
    # and the backend itself was handed the same agent with each request (what it routes by)
    assert [call.request.agent for call in scripted_model.of(rid)] == expected


@pytest.mark.parametrize("adapter_gateway", [["researcher", "writer"]], indirect=True)
def test_each_role_is_served_by_its_own_adapter(adapter_gateway: Any, agl_tracer: Any) -> None:
    """The whole way: a tiny random Llama with a LoRA adapter per trained role behind the gateway;
    each CrewAI agent's calls are served by its own adapter, an untrained role's by the base model."""
    from crewai import LLM, Agent, Crew, Process, Task

    assert agl_tracer.instrument("openai", "crewai") == ["openai", "crewai"]
    llm = LLM(
        model=f"openai/{adapter_gateway.MODEL}",
        base_url=adapter_gateway.url,
        api_key="sk-agl-test",
        max_tokens=3,
    )
    roles = ("researcher", "writer", "editor")  # editor is not trained: no adapter of its own
    agents = [Agent(role=r, goal=f"do the {r}'s job", backstory="", llm=llm, max_iter=1) for r in roles]
    tasks = [
        Task(description=f"{r}: one word", expected_output="a word", agent=a)
        for r, a in zip(roles, agents, strict=True)
    ]
    crew = Crew(agents=agents, tasks=tasks, process=Process.sequential)
    rid = adapter_gateway.run(crew.kickoff)
    served = adapter_gateway.served(rid)
    assert served == [("researcher", "researcher"), ("writer", "writer"), ("editor", sc.BASE_ADAPTER)]
