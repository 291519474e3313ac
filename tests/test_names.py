"""One normalisation of agent, tool and task names (agl.names): trimmed wherever a name passes — spans
from the SDK and from OTLP, the baggage, agent selection, LoRA names — with the raw value kept."""

from __future__ import annotations

from opentelemetry import baggage
from opentelemetry import context as otel_context

from agl import semconv as sc
from agl.adapter import agent_matcher
from agl.instrumentation.agent import agent_context
from agl.lora import lora_name, lora_names, lora_pattern
from agl.names import display_name, normalise_attributes


def test_display_name_trims_only_the_surrounding_whitespace() -> None:
    assert display_name("Content Planner\n") == "Content Planner"
    assert display_name("  Senior  Writer\t") == "Senior  Writer"  # inner spaces are the name's
    assert display_name(" \n") is None and display_name(None) is None


def test_span_attributes_are_trimmed_and_the_raw_value_kept() -> None:
    attrs = {
        sc.GEN_AI_AGENT_NAME: "Content Planner\n",
        sc.GEN_AI_TOOL_NAME: " search ",
        sc.AGL_TASK_NAME: "plan",
        sc.AGL_HANDOFF_TO: "Writer\n",
    }
    normalise_attributes(attrs)
    assert attrs[sc.GEN_AI_AGENT_NAME] == "Content Planner"
    assert attrs[sc.AGL_AGENT_NAME_RAW] == "Content Planner\n"
    assert attrs[sc.GEN_AI_TOOL_NAME] == "search" and attrs[sc.AGL_TOOL_NAME_RAW] == " search "
    assert attrs[sc.AGL_TASK_NAME] == "plan" and sc.AGL_TASK_NAME_RAW not in attrs  # unchanged: no raw
    assert attrs[sc.AGL_HANDOFF_TO] == "Writer"


def test_sdk_spans_are_stored_with_trimmed_names() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    from agl.tracing.spanconv import span_from_otel

    provider = TracerProvider()
    attrs = {sc.AGL_ROLLOUT_ID: "ro-1", sc.AGL_ATTEMPT: 1, sc.GEN_AI_AGENT_NAME: "Content Planner\n"}
    with provider.get_tracer("t").start_as_current_span(sc.SPAN_INVOKE_AGENT, attributes=attrs) as span:
        pass
    stored = span_from_otel(span)  # type: ignore[arg-type]
    assert stored.attributes[sc.GEN_AI_AGENT_NAME] == "Content Planner"
    assert stored.attributes[sc.AGL_AGENT_NAME_RAW] == "Content Planner\n"


def test_baggage_selection_and_lora_names_use_the_trimmed_name() -> None:
    ctx = agent_context(otel_context.get_current(), "Content Planner\n")
    assert baggage.get_baggage(sc.BAGGAGE_AGENT, ctx) == "Content Planner"
    match = agent_matcher(["Content Planner\n"])
    assert match("Content Planner") and match("Content Planner\n") and not match("Planner")
    assert lora_name("Content Planner\n") == "Content_Planner"
    assert lora_pattern("Content_Planner").fullmatch("Content Planner")
    assert lora_names(["Content Planner\n", "Content Planner"]) == {
        "Content Planner\n": "Content_Planner",
        "Content Planner": "Content_Planner",
    }  # one agent written two ways: one LoRA, not a clash
