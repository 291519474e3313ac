"""The shared end-to-end scenario for AutoGen AgentChat: a math team, only ``solver`` trained.

A real AutoGen app (``solver`` with a ``calculator`` tool that fails on malformed expressions, and
``verifier``, in a ``RoundRobinGroupChat`` or a ``SelectorGroupChat``), its real
``OpenAIChatCompletionClient`` pointed at agl's gateway on 127.0.0.1 (scripted model, SmolLM2
tokenizer), the SQLite store, rollouts through ``agl.runner.runner.Runner`` — with ``team.run``,
``team.run_stream``, a streaming model client, and a sync agent that runs its own event loop.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("autogen_agentchat")

from autogen_math_app import SELECTOR, TeamKind, build_team, expected_calls, make_client  # noqa: E402
from autogen_support import run_rollouts, tree  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.adapter import Adapter  # noqa: E402
from agl.adapter.air_rules import AIR  # noqa: E402
from agl.testing import assert_agent_spans, assert_merged  # noqa: E402

QUESTIONS = [
    {"question": "What is 6*7? [sloppy]", "answer": "42"},
    {"question": "What is 2+3?", "answer": "5"},
]
VARIANTS: list[tuple[TeamKind, str]] = [
    ("round_robin", "run"),
    ("round_robin", "run_stream"),
    ("round_robin", "model_stream"),
    ("round_robin", "sync"),
    ("selector", "run"),
    ("selector", "model_stream"),
]


@pytest.fixture(autouse=True)
def _every_call_attributed(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The runner's unattributed-calls warning stays quiet: every LLM call ran under its agent."""
    yield
    assert "ran under no agent span" not in caplog.text


def score(result: Any, task: dict[str, str]) -> float:
    last = result.messages[-1]
    return 1.0 if last.source == "verifier" and f"VERIFIED {task['answer']}" in str(last.content) else 0.0


def make_agent(kind: TeamKind, mode: str) -> Any:
    """The user's rollout function: builds the team on the resources' LLM and runs it once."""

    async def run_team(task: dict[str, str], resources: Any) -> float:
        client = make_client(resources.llm.base_url, resources.llm.model)
        team = build_team(client, kind, stream=mode == "model_stream")
        try:
            if mode == "run_stream":
                result = None
                async for item in team.run_stream(task=task["question"]):
                    result = item
            else:
                result = await team.run(task=task["question"])
        finally:
            await client.close()
        return score(result, task)

    if mode == "sync":

        def sync_agent(task: dict[str, str], resources: Any) -> float:
            return asyncio.run(run_team(task, resources))

        return sync_agent
    return run_team


@pytest.fixture
def instrumented(clean_agl: None) -> Iterator[None]:
    assert agl.instrument("openai", "autogen") == ["openai", "autogen"]
    yield


@pytest.mark.parametrize(("kind", "mode"), VARIANTS)
def test_math_team_end_to_end(
    kind: TeamKind, mode: str, gateway: Any, scripted_model: Any, instrumented: None
) -> None:
    url, store = gateway
    ids = run_rollouts(make_agent(kind, mode), store, str(url), QUESTIONS)
    tokenizer = scripted_model.backend.tokenizer

    all_transitions = Adapter().from_store(store, ids)
    for rid, task in zip(ids, QUESTIONS, strict=True):
        expected = expected_calls(task["question"], kind)
        spans = store.query_spans(rollout_id=rid, attempt=1)
        index, ancestors, agent_above = tree(spans)
        assert len({s.trace_id for s in spans}) == 1  # one trace per rollout, gateway spans included
        rollout_span = next(s for s in spans if s.name == sc.SPAN_ROLLOUT)

        # --- agents: exactly one invoke_agent span per turn, in agl's shape, inside the rollout
        agents = sorted((s for s in spans if s.name == sc.SPAN_INVOKE_AGENT), key=lambda s: s.start_ns)
        turns = [a for i, (a, _) in enumerate(expected) if i == 0 or expected[i - 1][0] != a]
        assert [a.attributes[sc.GEN_AI_AGENT_NAME] for a in agents] == turns
        found = assert_agent_spans(store, rid, list(dict.fromkeys(turns)), attempt=1)  # agl.testing helper
        assert sum(map(len, found.llm_calls.values())) == len(expected)
        assert not [
            s for s in spans if s.name.startswith(sc.SPAN_INVOKE_AGENT + " ")
        ]  # no AutoGen-named copy
        for a in agents:
            assert a.kind == "INTERNAL" and a.attributes[sc.GEN_AI_OPERATION_NAME] == sc.OP_INVOKE_AGENT
            assert a.attributes[sc.AGL_INTEGRATION] == "autogen"
            assert rollout_span in ancestors(a)
            assert not any(x.name == sc.SPAN_INVOKE_AGENT for x in ancestors(a))  # turns never nest here

        # --- LLM calls: client span (openai integration) -> server span (gateway), under the right agent
        servers = sorted(
            (s for s in spans if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER), key=lambda s: s.start_ns
        )
        assert len(servers) == len(expected)
        for server in servers:
            client = index[server.parent_id]
            assert client.name == sc.SPAN_CHAT and client.attributes[sc.AGL_SIDE] == sc.SIDE_CLIENT
        assert [agent_above(s) for s in servers] == [agent for agent, _ in expected]
        # each call's baggage named its agent: the gateway would serve it with that agent's adapter
        assert [s.attributes.get(sc.AGL_LLM_AGENT) for s in servers] == [agent for agent, _ in expected]

        # --- tools: one execute_tool per call, under the solver, ERROR for the malformed expression
        tools = sorted((s for s in spans if s.name == sc.SPAN_EXECUTE_TOOL), key=lambda s: s.start_ns)
        n_calc = sum(1 for agent, what in expected if what == "calculator")
        assert [t.attributes[sc.GEN_AI_TOOL_NAME] for t in tools] == ["calculator"] * n_calc
        assert all(
            agent_above(t) == "solver" and t.attributes[sc.AGL_INTEGRATION] == "autogen" for t in tools
        )
        sloppy = "[sloppy]" in task["question"]
        assert [t.status.code for t in tools] == (["ERROR", "UNSET"] if sloppy else ["UNSET"])
        good = tools[-1]
        assert json.loads(good.attributes[sc.GEN_AI_TOOL_CALL_ARGUMENTS]) == {
            "expression": task["question"].split("What is ")[1].split("?")[0]
        }
        assert good.attributes[sc.GEN_AI_TOOL_CALL_RESULT] == task["answer"]
        if sloppy:
            bad = tools[0]
            assert "malformed expression" in bad.attributes[sc.GEN_AI_TOOL_CALL_RESULT]
            assert any(e.name == sc.EVENT_EXCEPTION for e in bad.events)

        rewards = [s for s in spans if s.name == sc.SPAN_REWARD]
        assert [r.attributes[sc.AGL_REWARD_VALUE] for r in rewards] == [1.0]

        # --- every LLM call -> exactly one exact transition with the gateway's token ids
        transitions = [t for t in all_transitions if t.rollout_id == rid]
        recorded = scripted_model.of(rid)
        assert len(transitions) == len(servers) == len(recorded)
        for t, server, call, (agent, what) in zip(transitions, servers, recorded, expected, strict=True):
            assert t.exact and t.span_id == server.span_id and t.agent == agent
            assert call.agent == (agent if agent != SELECTOR else "selector")
            assert list(t.prompt_ids) == server.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS]
            assert list(t.response_ids) == server.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]
            # ... and equal to what the scripted model's tokenizer makes of the request it received
            assert list(t.prompt_ids) == tokenizer.encode_chat(call.messages, call.tools)[1]
            assert what in tokenizer.decode(list(t.response_ids))
            assert t.final_reward == 1.0

        # --- AIR: the failing calculator call penalises exactly the LLM call that issued it
        air = [t.intermediate_reward for t in transitions]
        if sloppy:
            call_id = tools[0].attributes[sc.GEN_AI_TOOL_CALL_ID]
            issuer = next(
                i for i, s in enumerate(servers) if call_id in s.attributes[sc.GEN_AI_OUTPUT_MESSAGES]
            )
            assert expected[issuer] == ("solver", "calculator") and issuer == (1 if kind == "selector" else 0)
            assert air == [AIR().tool_error if i == issuer else 0.0 for i in range(len(air))]
        else:
            assert air == [0.0] * len(air)

    # --- train the solver only: the verifier's (and the selector's) calls never become transitions
    selected = Adapter(agents=["solver"]).from_store(store, ids)
    assert {t.agent for t in selected} == {"solver"}
    assert [t.span_id for t in selected] == [t.span_id for t in all_transitions if t.agent == "solver"]
    n_solver = sum(
        1 for task in QUESTIONS for agent, _ in expected_calls(task["question"], kind) if agent == "solver"
    )
    assert len(selected) == n_solver < len(all_transitions)

    # --- multi-turn merging: the solver's and the verifier's later calls re-send the team's history
    # exactly, so each agent's calls are one sequence per rollout; the selector builds a fresh prompt
    # for every choice, so each of its calls is a new sequence (a break: diverged)
    calls = Counter(agent for task in QUESTIONS for agent, _ in expected_calls(task["question"], kind))
    n = len(ids)
    want = {"solver": n, "verifier": n}
    if kind == "selector":
        want[SELECTOR] = calls[SELECTOR]
    merged = assert_merged(all_transitions, want)
    assert merged.stats.merged_calls == calls["solver"] + calls["verifier"] - 2 * n > 0
    assert merged.breaks == ({SELECTOR: ["diverged"] * (calls[SELECTOR] - n)} if kind == "selector" else {})
