"""The Agents SDK's two guardrail examples (``examples/agent_patterns/input_guardrails.py`` and
``output_guardrails.py``) as their programs are shaped: an agent-based input guardrail that trips on a
maths-homework request, and an output guardrail that trips on a phone number in a structured reply.
Each runs through agl's Runner against the gateway on 127.0.0.1 (the scripted model playing the agents),
configured by ``OPENAI_BASE_URL`` alone.

Asserts: a tripped guardrail marks the agent span ERROR with the same description whichever kind
tripped (the SDK puts an input trip on its turn span, which agl does not map, and an output trip on
the agent span); the main agent's reply an input trip threw away is marked on the agent span
(``agl.discarded.windows``) and left out of training by default, kept and marked ``discarded=True``
with ``Adapter(keep_discarded=True)``, while the guardrail agent's own call and an output-guardrail
trip's judged reply stay ordinary transitions.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("agents")

from agents import (  # noqa: E402
    Agent,
    GuardrailFunctionOutput,
    InputGuardrailTripwireTriggered,
    OutputGuardrailTripwireTriggered,
    RunContextWrapper,
    input_guardrail,
    output_guardrail,
)
from agents import Runner as SdkRunner  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.adapter import Adapter  # noqa: E402
from agl.gateway.testing import serve_gateway  # noqa: E402
from agl.testing.fixtures import RecordingModel  # noqa: E402
from agl.types import NewRollout  # noqa: E402

CHECKER = "Guardrail check"
SUPPORT = "Customer support agent"
ASSISTANT = "Assistant"


class HomeworkVerdict(BaseModel):
    reasoning: str
    is_math_homework: bool


class Reply(BaseModel):
    reasoning: str = Field(description="how to answer the user")
    response: str = Field(description="the answer to the user")
    user_name: str | None = Field(description="the user's name, if known")


checker = Agent(
    name=CHECKER,
    instructions="Check if the user is asking you to do their math homework.",
    output_type=HomeworkVerdict,
)


@input_guardrail
async def math_guardrail(ctx: RunContextWrapper[None], agent: Agent, input: Any) -> GuardrailFunctionOutput:
    verdict = (await SdkRunner.run(checker, input, context=ctx.context)).final_output_as(HomeworkVerdict)
    return GuardrailFunctionOutput(output_info=verdict, tripwire_triggered=verdict.is_math_homework)


@output_guardrail
async def sensitive_data_check(
    ctx: RunContextWrapper, agent: Agent, output: Reply
) -> GuardrailFunctionOutput:
    leaked = "650" in output.response or "650" in output.reasoning
    return GuardrailFunctionOutput(output_info={"phone_number": leaked}, tripwire_triggered=leaked)


support = Agent(
    name=SUPPORT,
    instructions="You are a customer support agent. You help customers with their questions.",
    input_guardrails=[math_guardrail],
)
assistant = Agent(
    name=ASSISTANT,
    instructions="You are a helpful assistant.",
    output_type=Reply,
    output_guardrails=[sensitive_data_check],
)


def policy(request: Any) -> str:
    system = str((request.messages or [{}])[0].get("content") or "")
    if system.startswith("Check if"):
        return json.dumps({"reasoning": "it is an equation to solve", "is_math_homework": True})
    if system.startswith("You are a customer"):
        return "x = 3"  # the reply the tripped guardrail throws away
    return json.dumps(
        {
            "reasoning": "the area code 650 is Palo Alto's",
            "response": "Near 650: Palo Alto.",
            "user_name": None,
        }
    )


async def input_example(task: Any, resources: Any) -> float:
    try:
        await SdkRunner.run(
            support, [{"role": "user", "content": "Can you help me solve for x: 2x + 5 = 11"}]
        )
    except InputGuardrailTripwireTriggered:
        return 1.0  # the program refuses, as the example does
    return 0.0


async def output_example(task: Any, resources: Any) -> float:
    try:
        await SdkRunner.run(assistant, "My phone number is 650-123-4567. Where do you think I live?")
    except OutputGuardrailTripwireTriggered:
        return 0.0  # the reply leaked the number
    return 1.0


@pytest.fixture(autouse=True)
def fresh_sdk_http_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new program's SDK client (see test_openai_agents_default_model)."""
    import agents.models.openai_provider as provider

    monkeypatch.setattr(provider, "_http_client", None, raising=False)


def _run(program: Any, store: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    model = RecordingModel(policy)
    with serve_gateway(model.backend, store) as url:
        monkeypatch.setenv("OPENAI_BASE_URL", str(url))
        monkeypatch.delenv("OPENAI_DEFAULT_MODEL", raising=False)
        agl.instrument("openai", "openai_agents")
        (created,) = store.enqueue([NewRollout(input={})])
        stats = agl.Runner(program, store, timeout_s=60).run(max_rollouts=1)
        assert stats.succeeded == 1, stats.errors
    return created.id


def _agent_span(store: Any, rid: str, name: str) -> Any:
    (span,) = [
        s
        for s in store.query_spans(rollout_id=rid)
        if s.name == sc.SPAN_INVOKE_AGENT and s.attributes.get(sc.GEN_AI_AGENT_NAME) == name
    ]
    return span


def _tripped(store: Any, rid: str) -> list[Any]:
    return [
        s
        for s in store.query_spans(rollout_id=rid)
        if s.name == sc.SPAN_GUARDRAIL and s.attributes.get(sc.AGL_GUARDRAIL_TRIGGERED)
    ]


@pytest.mark.parametrize(("program", "agent"), [(input_example, SUPPORT), (output_example, ASSISTANT)])
def test_a_tripped_guardrail_marks_the_agent_alike(
    program: Any, agent: str, agl_store: Any, clean_agl: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    rid = _run(program, agl_store, monkeypatch)
    assert _tripped(agl_store, rid)  # the guardrail span says it tripped ...
    span = _agent_span(agl_store, rid, agent)
    assert span.status.code == "ERROR"  # ... and the agent is marked as an error is marked
    assert span.status.message == "Guardrail tripwire triggered"


def test_the_reply_an_input_guardrail_threw_away_is_not_trained_on(
    agl_store: Any, clean_agl: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    rid = _run(input_example, agl_store, monkeypatch)
    span = _agent_span(agl_store, rid, SUPPORT)
    assert span.attributes[sc.AGL_DISCARDED_REASON] == sc.DISCARDED_INPUT_GUARDRAIL
    assert len(span.attributes[sc.AGL_DISCARDED_WINDOWS]) == 2
    adapter = Adapter()
    kept = adapter.from_store(agl_store, [rid])
    assert [t.agent for t in kept] == [CHECKER]  # the verdict that tripped it is a call like any other
    assert adapter.stats.discarded == 1 and not kept[0].discarded
    marked = Adapter(keep_discarded=True).from_store(agl_store, [rid])
    by_agent = {t.agent: t for t in marked}
    assert set(by_agent) == {CHECKER, SUPPORT}
    assert by_agent[SUPPORT].discarded and by_agent[SUPPORT].response_text == "x = 3"
    assert not by_agent[CHECKER].discarded


def test_an_output_guardrails_judged_reply_stays_a_transition(
    agl_store: Any, clean_agl: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    rid = _run(output_example, agl_store, monkeypatch)
    assert sc.AGL_DISCARDED_WINDOWS not in _agent_span(agl_store, rid, ASSISTANT).attributes
    (t,) = Adapter().from_store(agl_store, [rid])
    assert t.agent == ASSISTANT and not t.discarded and t.final_reward == 0.0
