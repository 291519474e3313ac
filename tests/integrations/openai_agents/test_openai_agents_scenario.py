"""The shared end-to-end scenario for the OpenAI Agents SDK: retrieval QA, trained agents selected.

A real Agents SDK app (triage → researcher with a ``search`` tool that fails on an empty query →
answerer), its real ``AsyncOpenAI`` client pointed at agl's gateway on 127.0.0.1 (scripted model,
SmolLM2 tokenizer), the SQLite store, rollouts through ``agl.runner.runner.Runner`` — for both model classes
(Chat Completions and the default Responses model) and ``Runner.run``, ``run_sync`` and
``run_streamed``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("agents")

from agents import Runner as SdkRunner  # noqa: E402
from openai_agents_rag_app import build_app, expected_calls, make_model  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.adapter import Adapter  # noqa: E402
from agl.adapter.air_rules import AIR  # noqa: E402
from agl.testing import assert_agent_spans, assert_merged  # noqa: E402
from agl.types import LLM, NewRollout  # noqa: E402

QUESTIONS = [
    {"question": "What is the capital of France? [sloppy]", "answer": "Paris"},
    {"question": "What is the capital of Japan?", "answer": "Tokyo"},
]
VARIANTS = [(api, mode) for api in ("chat", "responses") for mode in ("run", "sync", "streamed")]


@pytest.fixture(autouse=True)
def _every_call_attributed(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The runner's unattributed-calls warning stays quiet: every LLM call ran under its agent."""
    yield
    assert "ran under no agent span" not in caplog.text


def score(output: Any, task: Any) -> float:
    return 1.0 if task["answer"] in str(output) else 0.0


def make_agent(api: str, mode: str) -> Any:
    """The user's rollout function: builds the app on the resources' LLM and runs it once."""

    def app(resources: Any) -> Any:
        llm = resources.llm
        return build_app(make_model(api, llm.base_url, llm.model))  # type: ignore[arg-type]

    if mode == "sync":

        def sync_agent(task: Any, resources: Any) -> float:
            result = SdkRunner.run_sync(app(resources), task["question"])
            return score(result.final_output, task)

        return sync_agent

    async def async_agent(task: Any, resources: Any) -> float:
        if mode == "run":
            result = await SdkRunner.run(app(resources), task["question"])
        else:
            result = SdkRunner.run_streamed(app(resources), task["question"])
            async for _event in result.stream_events():
                pass
        return score(result.final_output, task)

    return async_agent


@pytest.fixture
def instrumented(clean_agl: None) -> Iterator[None]:
    agl.instrument("openai", "openai_agents")
    yield


def run_rollouts(agent: Any, store: Any, base_url: str, inputs: list[Any]) -> list[str]:
    """Enqueue one rollout per input and let agl's Runner run them all; returns the rollout ids."""
    from agl.runner.runner import Runner

    store.add_resources({"main": LLM(base_url=base_url, model="scripted")})
    rollouts = store.enqueue([NewRollout(input=x) for x in inputs])
    ids = [r.id for r in rollouts]
    stats = Runner(agent, store, concurrency=2, timeout_s=60).run(max_rollouts=len(ids))
    done = store.wait_for_rollouts(ids, timeout_s=30)
    assert [r.status for r in done] == ["succeeded"] * len(ids), stats.errors
    return ids


def tree(spans: list[Any]) -> tuple[dict[str, Any], Any]:
    index = {s.span_id: s for s in spans}

    def agent_above(s: Any) -> str | None:
        while s.parent_id is not None and s.parent_id in index:
            s = index[s.parent_id]
            if s.name == sc.SPAN_INVOKE_AGENT:
                return s.attributes[sc.GEN_AI_AGENT_NAME]
        return None

    return index, agent_above


@pytest.mark.parametrize(("api", "mode"), VARIANTS)
def test_retrieval_qa_end_to_end(
    api: str, mode: str, gateway: Any, scripted_model: Any, instrumented: None
) -> None:
    url, store = gateway
    ids = run_rollouts(make_agent(api, mode), store, str(url), QUESTIONS)
    tokenizer = scripted_model.backend.tokenizer

    all_transitions = Adapter().from_store(store, ids)
    for rid, task in zip(ids, QUESTIONS, strict=True):
        expected = expected_calls(task["question"])
        spans = store.query_spans(rollout_id=rid, attempt=1)
        index, agent_above = tree(spans)

        # --- the span tree: agents, tools, handoffs, LLM calls (client + server), reward
        agents_ = sorted((s for s in spans if s.name == sc.SPAN_INVOKE_AGENT), key=lambda s: s.start_ns)
        assert [a.attributes[sc.GEN_AI_AGENT_NAME] for a in agents_] == ["triage", "researcher", "answerer"]
        found = assert_agent_spans(store, rid, ["triage", "researcher", "answerer"], attempt=1)  # agl.testing
        assert [agent for agent, _ in expected].count("researcher") == len(found.llm_calls["researcher"])
        assert len(found.failed_tools) == (1 if "[sloppy]" in task["question"] else 0)
        rollout_span = next(s for s in spans if s.name == sc.SPAN_ROLLOUT)
        assert len({s.trace_id for s in spans}) == 1  # one trace per rollout, gateway spans included
        for a in agents_:
            assert rollout_span.span_id in _ancestors(a, index)
        servers = sorted(
            (s for s in spans if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER), key=lambda s: s.start_ns
        )
        assert len(servers) == len(expected)
        for server in servers:
            client = index[server.parent_id]  # the gateway span is the client span's child
            assert client.name == sc.SPAN_CHAT and client.attributes[sc.AGL_SIDE] == sc.SIDE_CLIENT
        assert [agent_above(s) for s in servers] == [agent for agent, _ in expected]
        # each call's baggage named its agent: the gateway would serve it with that agent's adapter
        assert [s.attributes.get(sc.AGL_LLM_AGENT) for s in servers] == [agent for agent, _ in expected]
        tools = sorted((s for s in spans if s.name == sc.SPAN_EXECUTE_TOOL), key=lambda s: s.start_ns)
        n_search = sum(1 for _, what in expected if what == "search")
        assert [t.attributes[sc.GEN_AI_TOOL_NAME] for t in tools] == ["search"] * n_search
        assert all(agent_above(t) == "researcher" for t in tools)
        assert [t.status.code == "ERROR" for t in tools] == (
            [True, False] if "[sloppy]" in task["question"] else [False]
        )
        handoffs = [s for s in spans if s.name == sc.SPAN_HANDOFF]
        assert sorted(
            (h.attributes[sc.AGL_HANDOFF_FROM], h.attributes[sc.AGL_HANDOFF_TO]) for h in handoffs
        ) == [
            ("researcher", "answerer"),
            ("triage", "researcher"),
        ]
        rewards = [s for s in spans if s.name == sc.SPAN_REWARD]
        assert [r.attributes[sc.AGL_REWARD_VALUE] for r in rewards] == [1.0]
        assert rollout_span.span_id in _ancestors(rewards[0], index)

        # --- every LLM call → exactly one exact transition with the gateway's token ids
        transitions = [t for t in all_transitions if t.rollout_id == rid]
        assert len(transitions) == len(servers)
        recorded = scripted_model.of(rid)
        assert len(recorded) == len(servers)
        for t, server, call, (agent, what) in zip(transitions, servers, recorded, expected, strict=True):
            assert t.exact and t.span_id == server.span_id and t.agent == agent == call.agent
            assert list(t.prompt_ids) == server.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS]
            assert list(t.response_ids) == server.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]
            # ... and equal to what the scripted model's tokenizer makes of the request it received
            assert list(t.prompt_ids) == tokenizer.encode_chat(call.messages, call.tools)[1]
            decoded = tokenizer.decode(list(t.response_ids))
            assert (what in decoded) if what != "text" else (task["answer"] in decoded)
            assert t.final_reward == 1.0

        # --- AIR: the failing search penalises exactly the call that issued it
        failing = [t for t in tools if t.status.code == "ERROR"]
        air = [t.intermediate_reward for t in transitions]
        if failing:
            call_id = failing[0].attributes[sc.GEN_AI_TOOL_CALL_ID]
            issuer = next(
                i for i, s in enumerate(servers) if call_id in s.attributes[sc.GEN_AI_OUTPUT_MESSAGES]
            )
            assert issuer == 1  # the researcher's first call: the empty query
            assert air == [AIR().tool_error if i == issuer else 0.0 for i in range(len(air))]
        else:
            assert air == [0.0] * len(air)

    # --- train researcher + answerer only: the triage agent's calls never become transitions
    selected = Adapter(agents=["researcher", "answerer"]).from_store(store, ids)
    assert {t.agent for t in selected} == {"researcher", "answerer"}
    assert len(selected) == len(all_transitions) - len(ids)  # one triage call per rollout
    assert [t.span_id for t in selected] == [t.span_id for t in all_transitions if t.agent != "triage"]

    # --- multi-turn merging: each agent's turn is one sequence per rollout, never shared between
    # agents (the answerer sees the researcher's history, but in its own sequence); the researcher's
    # later calls re-send its tool calls and results exactly, so they extend its first call's sequence
    merged = assert_merged(
        all_transitions, {"triage": len(ids), "researcher": len(ids), "answerer": len(ids)}
    )
    n_research = sum(
        agent == "researcher" for task in QUESTIONS for agent, _ in expected_calls(task["question"])
    )
    assert merged.stats.merged_calls == n_research - len(ids) > 0
    assert merged.breaks == {} and merged.stats.merge_rate == 1.0


def _ancestors(span: Any, index: dict[str, Any]) -> list[str]:
    out = []
    while span.parent_id is not None and span.parent_id in index:
        out.append(span.parent_id)
        span = index[span.parent_id]
    return out


def test_tool_arguments_and_results_reach_the_store(gateway: Any, instrumented: None) -> None:
    url, store = gateway
    (rid,) = run_rollouts(make_agent("responses", "run"), store, str(url), QUESTIONS[:1])
    tools = sorted(
        (s for s in store.query_spans(rollout_id=rid, attempt=1) if s.name == sc.SPAN_EXECUTE_TOOL),
        key=lambda s: s.start_ns,
    )
    assert [json.loads(t.attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS]) for t in tools] == [
        {"query": ""},
        {"query": "France"},
    ]
    assert tools[1].attributes[sc.GEN_AI_TOOL_CALL_RESULT] == "Paris is the capital of France."
    assert (
        sc.GEN_AI_TOOL_CALL_RESULT not in tools[0].attributes
        or "error" in tools[0].attributes[sc.GEN_AI_TOOL_CALL_RESULT].lower()
    )
