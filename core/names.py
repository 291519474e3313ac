"""Agent, tool and task names as people see them: the one normalisation every part of agl applies.

A framework may hand agl a name with whitespace nobody sees: CrewAI's own project template writes
``role: >`` in ``agents.yaml``, a folded YAML scalar that keeps a trailing newline, so every agent of
a project made with ``crewai create`` is called ``"Content Planner\\n"``. Left as it is, the name on
the spans differs from the one a person types (``Trainer(agents=["Content Planner"])``,
``agl transitions --agents``, ``--adapter Content_Planner``) and from the one the W3C baggage carries
(its parser strips whitespace), so selection finds nothing and a LoRA per agent is trained under one
name and served under another.

So agl trims surrounding whitespace from every agent, tool and task name, at the few places every
name passes through:

- :func:`agl.instrumentation.agent.agent_context`: the baggage each integration sets for its agents;
- :func:`agl.tracing.spanconv.span_from_otel` and the store's OTLP ingest: every span stored, whichever
  integration (or foreign exporter) made it (:func:`normalise_attributes`; the raw value is kept in
  ``agl.agent.name.raw`` / ``agl.tool.name.raw`` / ``agl.task.name.raw`` when it differed);
- the gateway's baggage parsing, the span adapter's agent names and agent selection
  (:func:`agl.adapter.agent_matcher`), and the LoRA naming rule (:func:`agl.lora.lora_name`).

Only surrounding whitespace goes: inner spaces are part of the name people see.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from agl import semconv as sc

__all__ = ["NAME_ATTRIBUTES", "display_name", "normalise_attributes"]

#: span attributes holding a name people select by -> the attribute that keeps the raw value
NAME_ATTRIBUTES: dict[str, str | None] = {
    sc.GEN_AI_AGENT_NAME: sc.AGL_AGENT_NAME_RAW,
    sc.GEN_AI_TOOL_NAME: sc.AGL_TOOL_NAME_RAW,
    sc.AGL_TASK_NAME: sc.AGL_TASK_NAME_RAW,
    sc.AGL_HANDOFF_FROM: None,
    sc.AGL_HANDOFF_TO: None,
    sc.AGL_LLM_AGENT: None,
}


def display_name(name: Any) -> str | None:
    """``name`` as people see it: surrounding whitespace trimmed; None for None or a blank name.
    A non-string is returned unchanged (a caller that validates types still sees it)."""
    if name is None:
        return None
    if not isinstance(name, str):
        return name
    trimmed = name.strip()
    return trimmed or None


_PAIRS = tuple(NAME_ATTRIBUTES.items())


def normalise_attributes(attributes: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Trim the name attributes of one span in place (keeping the raw value where it changed);
    returns ``attributes``. Cheap when nothing needs trimming (every span agl exports comes through
    here): a few dictionary lookups."""
    get = attributes.get
    for key, raw_key in _PAIRS:
        value = get(key)
        if value is None or type(value) is not str or value == value.strip():
            continue
        trimmed = value.strip()
        if raw_key is not None:
            attributes.setdefault(raw_key, value)
        if trimmed:
            attributes[key] = trimmed
        else:
            del attributes[key]
    return attributes
