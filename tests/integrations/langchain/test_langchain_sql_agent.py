"""The end-to-end scenario: a text-to-SQL LangGraph app (writer → checker with a failing SQLite tool →
rewriter) run through agl's Runner against the gateway's scripted backend, spans in the SQLite store,
transitions from the adapter — sync, async, and with token streaming.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

import lc_sql_app as app  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from lc_support import MODEL, Traced, Tree  # noqa: E402

from agl import semconv as sc  # noqa: E402
from agl.adapter import Adapter  # noqa: E402
from agl.adapter.air_rules import AIR  # noqa: E402
from agl.runner.runner import Runner  # noqa: E402
from agl.testing import assert_agent_spans, assert_merged  # noqa: E402
from agl.types import LLM, NewRollout, Resources, Transition  # noqa: E402

VARIANTS = ["sync", "async", "stream", "astream"]


@pytest.fixture(autouse=True)
def _every_call_attributed(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The runner's unattributed-calls warning stays quiet: every LLM call ran under its agent."""
    yield
    assert "ran under no agent span" not in caplog.text


def make_agent(db: str, variant: str) -> Any:
    """The user's rollout function: build the app on the runner's LLM endpoint, return the reward."""
    asynchronous = variant.startswith("a")
    streaming = variant.endswith("stream")

    def model(resources: Resources) -> ChatOpenAI:
        llm = resources.llm
        assert llm is not None and "/rollouts/" in llm.base_url  # the runner's per-rollout endpoint
        return ChatOpenAI(model=llm.model, base_url=llm.base_url, api_key="sk-test", max_retries=0)

    if asynchronous:

        async def sql_agent(task: dict[str, Any], resources: Resources) -> float:
            graph = app.build_app(model(resources), db, asynchronous=True, streaming=streaming)
            out = await graph.ainvoke({"question": task["question"]})
            return app.reward(db, task["question"], out["query"])

        return sql_agent

    def sql_agent_sync(task: dict[str, Any], resources: Resources) -> float:
        graph = app.build_app(model(resources), db, streaming=streaming)
        out = graph.invoke({"question": task["question"]})
        return app.reward(db, task["question"], out["query"])

    return sql_agent_sync


def issued_tool_calls(tree: Tree, transition: Transition) -> set[str]:
    server = tree.by_id[transition.span_id]
    (message,) = json.loads(server.attributes[sc.GEN_AI_OUTPUT_MESSAGES])
    return {tc["id"] for tc in message.get("tool_calls") or ()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_sql_agent_end_to_end(traced: Traced, tmp_path: Any, variant: str) -> None:
    db = app.make_db(str(tmp_path / "shop.db"))
    traced.backend.policy = app.policy
    traced.backend.record.clear()
    store = traced.store
    resources = store.add_resources({"main": LLM(base_url=str(traced.gateway.base_url), model=MODEL)})
    questions = list(app.TASKS)
    rollouts = store.enqueue(
        [NewRollout(input={"question": q}, resources_version=resources.version) for q in questions]
    )
    runner = Runner(make_agent(db, variant), store, concurrency=2, trace=False, claim_timeout_s=0.2)
    stats = runner.run(max_rollouts=len(rollouts))
    assert stats.succeeded == len(rollouts) and stats.failed == 0, stats.errors
    assert stats.rewards == [1.0] * len(rollouts)  # the rewriter fixed the broken query

    full, picked = Adapter(), Adapter(agents=["writer", "rewriter"])
    for rollout, question in zip(rollouts, questions, strict=True):
        rollout = store.get_rollout(rollout.id)
        assert rollout.status == "succeeded"
        attempt = rollout.attempts[-1].number
        tree = Tree(store.query_spans(rollout_id=rollout.id, attempt=attempt))
        agents = app.expected_agents(question)
        broken = app.TASKS[question][0] != app.TASKS[question][1]

        # --- the span tree: agents, their LLM calls (client + server), tools, reward
        assert Counter(s.attributes[sc.GEN_AI_AGENT_NAME] for s in tree.agents()) == Counter(agents), (
            tree.shape()
        )
        found = assert_agent_spans(store, rollout.id, list(dict.fromkeys(agents)), attempt=attempt)
        assert len(found.failed_tools) == (1 if broken else 0)  # agl.testing's view agrees
        clients = tree.client_chats()
        assert [tree.agent_of(c) for c in clients] == agents, tree.shape()
        for client in clients:
            assert tree.parent(client).name == sc.SPAN_INVOKE_AGENT
            (server,) = tree.children(client, sc.SPAN_CHAT)
            assert server.attributes[sc.AGL_SIDE] == sc.SIDE_SERVER
        tools = tree.tools()
        assert len(tools) == (2 if broken else 1), tree.shape()
        assert [t.status.code == "ERROR" for t in tools] == ([True, False] if broken else [False])
        for agent_span in tree.agents():
            assert tree.parent(agent_span).name == sc.SPAN_ROLLOUT
        (reward_span,) = tree.named(sc.SPAN_REWARD)
        assert reward_span.attributes[sc.AGL_REWARD_VALUE] == 1.0

        # --- every LLM call is exactly one transition, with the ids the engine produced
        record = [(req, res) for req, res in traced.backend.record if req.rollout == (rollout.id, attempt)]
        transitions = full.transitions(
            store.query_spans(rollout_id=rollout.id, attempt=attempt), rollout=rollout
        )
        assert len(transitions) == len(record) == len(clients) == len(tree.server_chats())
        assert [t.agent for t in transitions] == agents

        # --- multi-turn merging: one sequence per agent conversation, never shared between agents. The
        # checker's second call re-sends its review (tool call + result) exactly, so it merges; after
        # the rewriter, the checker starts a fresh review (its messages are reset): a new sequence
        merged = assert_merged(transitions, {"writer": 1, "checker": 2, "rewriter": 1} if broken else None)
        if not broken:
            assert merged.sequences == {"writer": 1, "checker": 1}
        assert merged.stats.merged_calls == agents.count("checker") - merged.sequences["checker"] > 0
        assert merged.breaks == ({"checker": ["diverged"]} if broken else {})
        assert merged.stats.tokens_saved > 0
        for t, (_, result) in zip(transitions, record, strict=True):
            server = tree.by_id[t.span_id]
            assert server.attributes[sc.AGL_SIDE] == sc.SIDE_SERVER and t.exact
            assert list(t.prompt_ids) == result.prompt_ids == server.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS]
            assert list(t.response_ids) == result.choices[0].response_ids
            assert list(t.response_ids) == server.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]
            assert t.final_reward == 1.0

        # --- AIR: the failing execute_sql call penalises exactly the checker call that issued it
        failing = [s.attributes[sc.GEN_AI_TOOL_CALL_ID] for s in tools if s.status.code == "ERROR"]
        for t in transitions:
            penalised = bool(issued_tool_calls(tree, t) & set(failing))
            assert t.intermediate_reward == (AIR().tool_error if penalised else 0.0), (t.agent, failing)
            if penalised:
                assert t.agent == "checker"
        assert sum(t.intermediate_reward != 0 for t in transitions) == len(failing)

        # --- selecting writer + rewriter: only theirs, the same ids; the checker's calls are excluded
        chosen = picked.transitions(
            store.query_spans(rollout_id=rollout.id, attempt=attempt), rollout=rollout
        )
        assert [t.agent for t in chosen] == [a for a in agents if a != "checker"]
        wanted = [t for t in transitions if t.agent in ("writer", "rewriter")]
        assert [(t.prompt_ids, t.response_ids) for t in chosen] == [
            (t.prompt_ids, t.response_ids) for t in wanted
        ]
    assert picked.stats.unselected == sum(app.expected_agents(q).count("checker") for q in questions)
    assert picked.stats.unselected_rewards == 1  # the checker's penalty is not trained on
