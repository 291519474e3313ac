"""The Agents SDK's README handoffs program runs unchanged through agl on the SDK's default model (the
Responses API, a GPT-5 model name with its reasoning settings), configured by ``OPENAI_BASE_URL`` alone;
and with ``OPENAI_DEFAULT_MODEL`` set to the policy's mixed-case name, which the SDK lowercases, even on
a gateway that serves only its own names (``--only-model-names``)."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("agents")

from agents import Agent  # noqa: E402
from agents import Runner as SdkRunner  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.adapter import Adapter  # noqa: E402
from agl.gateway.testing import reply, serve_gateway, tool_call  # noqa: E402
from agl.testing.fixtures import RecordingModel  # noqa: E402
from agl.types import NewRollout  # noqa: E402

POLICY_NAME = "SmolLM2-135M-Instruct"


def build_triage() -> Agent:
    """The README's handoffs example, as written."""
    spanish_agent = Agent(name="Spanish agent", instructions="You only speak Spanish.")
    english_agent = Agent(name="English agent", instructions="You only speak English")
    return Agent(
        name="Triage agent",
        instructions="Handoff to the appropriate agent based on the language of the request.",
        handoffs=[spanish_agent, english_agent],
    )


def policy(request: Any) -> Any:
    system = str((request.messages or [{}])[0].get("content") or "")
    if system.startswith("Handoff"):
        return reply(None, tool_call("transfer_to_spanish_agent"))
    return "¡Hola! Estoy bien, gracias."


@pytest.fixture(autouse=True)
def fresh_sdk_http_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs "a new program": the SDK keeps one module-level httpx client for its default
    OpenAI client (``agents.models.openai_provider._http_client`` in newer releases), bound to the event
    loop of the first ``asyncio.run``; a second program in the same process would reuse it on a closed
    loop. Reset it, as a fresh process would have it."""
    import agents.models.openai_provider as provider

    monkeypatch.setattr(provider, "_http_client", None, raising=False)


@pytest.mark.parametrize("default_model", [None, POLICY_NAME])
def test_readme_handoffs_on_the_sdks_default_model(
    default_model: str | None, agl_store: Any, clean_agl: None, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    model = RecordingModel(policy, models=[POLICY_NAME])
    strict = default_model is not None  # the 404 the lowercased name used to get
    with serve_gateway(model.backend, agl_store, only_model_names=strict) as url:
        monkeypatch.setenv("OPENAI_BASE_URL", str(url))  # the only configuration
        if default_model is None:
            monkeypatch.delenv("OPENAI_DEFAULT_MODEL", raising=False)
        else:
            monkeypatch.setenv("OPENAI_DEFAULT_MODEL", default_model)
        agl.instrument("openai", "openai_agents")

        async def rollout(task: Any, resources: Any) -> float:
            result = await SdkRunner.run(build_triage(), input="Hola, ¿cómo estás?")
            return 1.0 if "Hola" in str(result.final_output) else 0.0

        (created,) = agl_store.enqueue([NewRollout(input={})])
        with caplog.at_level(logging.WARNING, "agl"):
            stats = agl.Runner(rollout, agl_store, timeout_s=60).run(max_rollouts=1)
        assert stats.succeeded == 1 and stats.rewards == [1.0], stats.errors
    assert not [r for r in caplog.records if r.name.startswith("agl")], caplog.text  # no false alarm

    spans = agl_store.query_spans(rollout_id=created.id, attempt=1)
    servers = sorted(
        (s for s in spans if s.name == sc.SPAN_CHAT and s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER),
        key=lambda s: s.start_ns,
    )
    assert [s.attributes.get(sc.AGL_LLM_AGENT) for s in servers] == ["Triage agent", "Spanish agent"]
    requested = {s.attributes[sc.GEN_AI_REQUEST_MODEL] for s in servers}
    assert requested == {(default_model or "gpt-5.6-luna").lower()}  # what the SDK sent, recorded
    assert {s.attributes[sc.GEN_AI_RESPONSE_MODEL] for s in servers} == {POLICY_NAME}
    assert all(s.attributes[sc.AGL_LLM_API] == "responses" for s in servers)
    assert all(s.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS] for s in servers)
    ts = Adapter(agents=["Spanish agent"]).transitions(
        spans, rollout=agl_store.get_rollout(created.id), attempt=1
    )
    assert Counter(t.agent for t in ts) == Counter({"Spanish agent": 1}) and ts[0].exact
