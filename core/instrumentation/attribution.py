"""Warn when LLM calls lose their agent: the check the runner makes after each attempt.

An agent framework can be instrumented and still produce calls that no agent span covers: the
application replaced agl's hook, its LLM client bypasses the instrumented framework, the ``openai``
integration is off (no ``traceparent`` reaches the gateway), or the agent ran in a thread that lost
the rollout's context. Then every transition has ``agent=None`` and ``Adapter(agents=[...])`` selects
nothing — silently. :class:`AttributionCheck` looks at an attempt's stored spans and warns once per
process-lifetime of the check, naming the likely cause.

It warns only when the attempt used an agent framework: some of its spans were made by a framework
integration (``agl.integration`` other than ``openai``). A framework being installed or instrumented
proves nothing: a plain-client agent (with or without ``agl.agent``) must not be told its hooks were
bypassed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from agl import semconv as sc

__all__ = ["AttributionCheck", "frameworks_used", "unattributed_calls"]

log = logging.getLogger("agl.runner")

#: integrations that make agent spans (``openai`` only makes LLM-call spans)
_NOT_AGENT_FRAMEWORKS = frozenset({"openai"})
#: attempts with gateway calls the check looks at before it trusts the setup and stops querying
CHECKED_ATTEMPTS = 16


def unattributed_calls(spans: Sequence[Any]) -> tuple[int, int]:
    """(gateway LLM calls with no ``invoke_agent`` span above them, all gateway LLM calls)."""
    by_id = {s.span_id: s for s in spans}
    calls = [s for s in spans if s.name == sc.SPAN_CHAT and s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER]
    missing = 0
    for call in calls:
        span, seen = call, {call.span_id}
        while True:
            parent = by_id.get(span.parent_id) if span.parent_id else None
            if parent is None or parent.span_id in seen:
                missing += 1
                break
            if parent.name == sc.SPAN_INVOKE_AGENT:
                break
            seen.add(parent.span_id)
            span = parent
    return missing, len(calls)


def frameworks_used(spans: Sequence[Any]) -> list[str]:
    """The agent-framework integrations that made some of these spans (``openai`` is a client, not one)."""
    names = {s.attributes.get(sc.AGL_INTEGRATION) for s in spans}
    return sorted(str(n) for n in names if n and n not in _NOT_AGENT_FRAMEWORKS)


def _likely_cause(frameworks: list[str], active: list[str]) -> str:
    from agl.instrumentation import health

    problems = [f"{name}: {p}" for name, h in health().items() if h.instrumented for p in h.problems]
    if problems:
        return "; ".join(problems)
    if "openai" not in active:
        return (
            "the 'openai' integration is not instrumented, so no traceparent reaches the gateway and its "
            "spans cannot be linked to the agent that made the call (agl.instrument() instruments both)"
        )
    return (
        "the LLM calls do not go through the instrumented framework (e.g. a raw client called outside "
        f"{', '.join(frameworks)}), or they ran in a thread or task that lost the rollout's context"
    )


class AttributionCheck:
    """Looks at the first attempts' spans; warns once if gateway calls ran under no agent span in an
    attempt that used an agent framework (the runner calls :meth:`after_attempt` once spans are flushed)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.checked = 0
        self.warned = False

    def after_attempt(self, rollout_id: str, attempt: int) -> None:
        if self.warned or self.checked >= CHECKED_ATTEMPTS:
            return
        from agl.instrumentation import instrumented

        active = instrumented()
        if not any(name not in _NOT_AGENT_FRAMEWORKS for name in active):
            return  # no framework can have made spans: nothing to query
        try:
            spans = self.store.query_spans(rollout_id=rollout_id, attempt=attempt)
        except Exception as exc:  # noqa: BLE001 - a diagnostic must never fail the rollout
            log.debug("agl runner: attribution check of %s/%d skipped: %r", rollout_id, attempt, exc)
            return
        missing, total = unattributed_calls(spans)
        if total == 0:
            return
        frameworks = frameworks_used(spans)
        if not frameworks:  # a plain-client attempt: its calls need no framework's agent span
            self.checked += 1
            return
        self.checked += 1
        if missing:
            self.warned = True
            log.warning(
                "agl runner: %d of %d LLM calls of rollout %s attempt %d went through the gateway but ran "
                "under no agent span, although the attempt used %s: their transitions get agent=None and "
                "Adapter(agents=[...]) cannot select them. Likely cause: %s. Run `agl doctor` from the "
                "application's process to check the hooks. (Warned once.)",
                missing,
                total,
                rollout_id,
                attempt,
                ", ".join(frameworks),
                _likely_cause(frameworks, active),
            )
