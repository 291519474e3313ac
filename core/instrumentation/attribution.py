"""Warn when LLM calls lose their agent, or were never traced: the checks the runner makes after an
attempt, from the attempt's stored spans (so a warning is only ever given when it is true).

**Untraced calls.** An attempt whose LLM calls went through the gateway but left no span of agl's
instrumentation (no client-side ``chat`` span, ``agl.side = client``, and no framework's span; with a
framework's spans the unattributed check below names the missing client integration) ran without it: ``agl.instrument()`` was not called in the agent's process, or ran too late.
The gateway still attributes each call to its rollout (the per-rollout URL), but not to an agent, so
``agents=`` selects nothing and tool errors reach no call. Whether integrations are instrumented when
the run *starts* proves nothing either way: ``agl.instrument()`` instruments a framework when the
program imports it (integrations "waiting for import"), which is usually after the runner started.

**Unattributed calls.**

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


def client_spans(spans: Sequence[Any]) -> int:
    """Spans an instrumented LLM client (or a framework's LLM hook) made in the agent's process."""
    return sum(1 for s in spans if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_CLIENT)


class AttributionCheck:
    """Looks at the first attempts' spans (the runner calls :meth:`after_attempt` once they are
    flushed); warns once if gateway calls left no client span at all, and once if they ran under no
    agent span in an attempt that used an agent framework."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.checked = 0
        self.warned = False
        self.warned_untraced = False

    def after_attempt(self, rollout_id: str, attempt: int) -> None:
        if (self.warned and self.warned_untraced) or self.checked >= CHECKED_ATTEMPTS:
            return
        try:
            spans = self.store.query_spans(rollout_id=rollout_id, attempt=attempt)
        except Exception as exc:  # noqa: BLE001 - a diagnostic must never fail the rollout
            log.debug("agl runner: attribution check of %s/%d skipped: %r", rollout_id, attempt, exc)
            return
        missing, total = unattributed_calls(spans)
        if total == 0:
            return  # no LLM call went through the gateway: nothing to say
        self.checked += 1
        frameworks = frameworks_used(spans)
        if not frameworks and not client_spans(spans):
            self._untraced(rollout_id, attempt, total)
            return
        if not frameworks or self.warned:  # a plain-client attempt: its calls need no agent span
            return
        if missing:
            from agl.instrumentation import instrumented

            active = instrumented()
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

    def _untraced(self, rollout_id: str, attempt: int, total: int) -> None:
        if self.warned_untraced:
            return
        self.warned_untraced = True
        log.warning(
            "agl runner: the %d LLM call(s) of rollout %s attempt %d went through the gateway but left no "
            "client-side span: agl's client instrumentation did not run in the agent's process (call "
            "agl.instrument() in the agent's module before it builds its clients; agl runner does it "
            "unless --no-instrument). The calls still count for their rollout, but not for an agent: "
            "agents= selects none of them and tool errors reach no call. (Warned once.)",
            total,
            rollout_id,
            attempt,
        )
