"""Look into a store as a person would: rollout tables, one rollout's attempts, span trees.

The text ``agl rollouts list|show`` and ``agl spans`` print (their flags live in :mod:`agl.cli.inspect`),
and the span tags and one-line details the dashboard shows (:func:`span_tag`, :func:`span_details`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from agl import semconv as sc

__all__ = [
    "attempt_kinds_of",
    "error_from_spans",
    "failure_kind_of",
    "format_rollout",
    "final_reward_of",
    "format_rollouts",
    "format_span_tree",
    "span_details",
    "span_tag",
    "with_span_errors",
]

#: span kind -> tag shown in the tree (by operation name, which is also the span name, DESIGN §4)
_TAGS = {
    sc.OP_INVOKE_AGENT: "agent",
    sc.OP_EXECUTE_TOOL: "tool",
    sc.OP_CHAT: "llm",
    sc.SPAN_REWARD: "reward",
    sc.SPAN_EXCEPTION: "error",
    sc.SPAN_MESSAGE: "message",
    sc.SPAN_OBJECT: "object",
    sc.SPAN_HANDOFF: "handoff",
    sc.SPAN_GUARDRAIL: "guardrail",
    sc.SPAN_ROLLOUT: "rollout",
}


def error_from_spans(store: Any, rollout_id: str, attempt: int) -> Any:
    """The attempt's error as its last ``agl.exception`` span tells it (``agl.emit_exception``), for an
    attempt that was finished as failed without ``error=``; None when it recorded no exception."""
    from agl.types import AttemptError

    spans = store.query_spans(rollout_id=rollout_id, attempt=attempt, name=sc.SPAN_EXCEPTION)
    if not spans:
        return None
    span = spans[-1]
    a = span.attributes
    stack = next(
        (e.attributes.get(sc.AGL_EXCEPTION_STACKTRACE) for e in span.events if e.name == sc.EVENT_EXCEPTION),
        None,
    )
    return AttemptError(
        type=str(a.get(sc.AGL_EXCEPTION_TYPE, "Exception")),
        message=str(a.get(sc.AGL_EXCEPTION_MESSAGE, "")),
        traceback=stack if isinstance(stack, str) else None,
    )


def with_span_errors(store: Any, rollout: Any) -> Any:
    """``rollout`` with each failed attempt that has no error filled from its exception spans."""
    attempts = []
    changed = False
    for a in rollout.attempts:
        if a.status == "failed" and a.error is None:
            err = error_from_spans(store, rollout.id, a.number)
            if err is not None:
                a = a.model_copy(update={"error": err})
                changed = True
        attempts.append(a)
    return rollout.model_copy(update={"attempts": attempts}) if changed else rollout


# ----------------------------------------------------------------------------------- formatting


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}m"


def _cut(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def final_reward_of(store: Any, rollout: Any) -> float | None:
    """The final reward the rollout's finishing attempt reported (None: none reported, or no attempt)."""
    from agl.adapter import final_reward, finishing_attempt

    attempt = finishing_attempt(rollout)
    if attempt is None:
        return None
    spans = store.query_spans(
        rollout_id=rollout.id, attempt=attempt, name=sc.SPAN_REWARD, include_stale=False
    )
    return final_reward(spans)


def failure_kind_of(store: Any, rollout: Any) -> str | None:
    """How a finished rollout ended (:func:`agl.adapter.failures.failure_kind`: infra, agent, task,
    no_reward); None while it is not finished."""
    from agl.adapter.failures import deciding_attempt, failure_kind

    if not rollout.done or rollout.status == "cancelled":
        return None
    attempt = deciding_attempt(rollout)
    spans = [] if attempt is None else store.query_spans(rollout_id=rollout.id, attempt=attempt)
    return failure_kind(rollout, spans)


def format_rollouts(
    rollouts: Sequence[Any],
    rewards: dict[str, float | None] | None = None,
    kinds: dict[str, str | None] | None = None,
) -> str:
    """A table: one line per rollout, with its final reward (``-``: none reported), how many attempts it
    took, how it ended (its failure kind, ``-`` while running) and the last error."""
    if not rollouts:
        return "no rollouts"
    header = ("ID", "STATUS", "MODE", "REWARD", "ATTEMPTS", "KIND", "GROUP", "CREATED", "LAST ERROR")
    rows = [header]
    for r in rollouts:
        last_error = next((a.error for a in reversed(r.attempts) if a.error is not None), None)
        err = "" if last_error is None else _cut(f"{last_error.type}: {last_error.message}", 60)
        reward = (rewards or {}).get(r.id)
        shown = "-" if reward is None else f"{reward:g}"
        attempts = str(len(r.attempts))
        kind = (kinds or {}).get(r.id) or "-"
        rows.append(
            (r.id, r.status, r.mode, shown, attempts, kind, r.group_id or "-", _when(r.created_at), err)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in rows
    ]
    counts: dict[str, int] = {}
    for r in rollouts:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines.append(f"{len(rollouts)} rollout(s): " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return "\n".join(line.rstrip() for line in lines)


def attempt_kinds_of(store: Any, rollout: Any) -> dict[int, str | None]:
    """Each attempt's failure kind (:func:`agl.adapter.failures.attempt_kind`), by attempt number; a
    cancelled rollout's attempts have none (nothing decides what a cancelled run teaches)."""
    from agl.adapter.failures import attempt_kind

    if rollout.status == "cancelled":
        return {a.number: None for a in rollout.attempts}
    spans = store.query_spans(rollout_id=rollout.id, include_stale=True)
    return {a.number: attempt_kind(rollout, a.number, spans) for a in rollout.attempts}


def format_rollout(
    rollout: Any,
    *,
    span_counts: dict[int, int] | None = None,
    tracebacks: bool = False,
    kinds: dict[int, str | None] | None = None,
) -> str:
    """One rollout and each of its attempts: status, worker, timing, failure kind (``kinds``, by
    attempt number: :func:`attempt_kinds_of`), error."""
    r = rollout
    lines = [
        f"rollout   {r.id}",
        f"status    {r.status}" + (f" (ended {_when(r.ended_at)})" if r.ended_at else ""),
        f"mode      {r.mode}    group {r.group_id or '-'}    task {r.task_id or '-'}",
        f"resources {'latest at claim' if r.resources_version is None else f'v{r.resources_version}'}",
        f"config    timeout {f'{r.config.timeout_s}s' if r.config.timeout_s else '-'}, lease {r.config.lease_s}s, "
        f"max attempts {r.config.max_attempts}",
        f"created   {_when(r.created_at)}",
        f"input     {_cut(json.dumps(r.input, default=str), 100)}",
    ]
    if r.metadata:
        lines.append(f"metadata  {_cut(json.dumps(r.metadata, default=str), 100)}")
    lines.append(f"attempts  {len(r.attempts)}")
    for a in r.attempts:
        took = (a.ended_at or time.time()) - a.started_at
        spans = "" if span_counts is None else f", {span_counts.get(a.number, 0)} span(s)"
        lines.append(
            f"  #{a.number} {a.status:<10} worker {a.worker_id or '-'}, started {_when(a.started_at)}, "
            f"{'took' if a.ended_at else 'running for'} {_duration(took)}"
            + (f", resources v{a.resources_version}" if a.resources_version is not None else "")
            + spans
            + (f", {kinds[a.number]}" if kinds and kinds.get(a.number) else "")
        )
        if a.error is not None:
            lines.append(f"     error: {a.error.type}: {_cut(a.error.message, 200)}")
            if tracebacks and a.error.traceback:
                lines.extend("       " + line for line in a.error.traceback.rstrip().splitlines())
    return "\n".join(lines)


def span_tag(span: Any) -> str:
    """The span's kind as a short tag (agent, tool, llm, reward, ...), or '' for other spans."""
    op = span.attributes.get(sc.GEN_AI_OPERATION_NAME)
    return _TAGS.get(op if isinstance(op, str) else span.name, _TAGS.get(span.name, ""))


def span_details(span: Any) -> str:
    """One line on what the span did: agent or tool name, model and token counts, reward, error."""
    a = span.attributes
    tag = span_tag(span)
    parts: list[str] = []
    if tag == "agent":
        parts.append(str(a.get(sc.GEN_AI_AGENT_NAME, "")))
    elif tag == "tool":
        parts.append(str(a.get(sc.GEN_AI_TOOL_NAME, "")))
        if sc.GEN_AI_TOOL_CALL_ARGUMENTS in a:
            parts.append(f"args={a[sc.GEN_AI_TOOL_CALL_ARGUMENTS]}")
    elif tag == "llm":
        model = a.get(sc.GEN_AI_RESPONSE_MODEL) or a.get(sc.GEN_AI_REQUEST_MODEL)
        if model:
            parts.append(str(model))
        if sc.AGL_SIDE in a:
            parts.append(f"({a[sc.AGL_SIDE]})")
        prompt_ids = a.get(sc.AGL_LLM_PROMPT_TOKEN_IDS)
        response_ids = a.get(sc.AGL_LLM_RESPONSE_TOKEN_IDS)
        if isinstance(prompt_ids, list) and isinstance(response_ids, list):
            parts.append(f"tokens {len(prompt_ids)}->{len(response_ids)}")
        elif sc.GEN_AI_USAGE_INPUT_TOKENS in a or sc.GEN_AI_USAGE_OUTPUT_TOKENS in a:
            parts.append(
                f"usage {a.get(sc.GEN_AI_USAGE_INPUT_TOKENS, '?')}->{a.get(sc.GEN_AI_USAGE_OUTPUT_TOKENS, '?')}"
            )
        if sc.AGL_LLM_WEIGHT_VERSION in a:
            parts.append(f"weights v{a[sc.AGL_LLM_WEIGHT_VERSION]}")
    elif tag == "reward":
        parts.append(f"{a.get(sc.AGL_REWARD_NAME, 'reward')}={a.get(sc.AGL_REWARD_VALUE, '?')}")
        if a.get(sc.AGL_REWARD_PRIMARY):
            parts.append("(primary)")
    elif tag == "error":
        parts.append(f"{a.get(sc.AGL_EXCEPTION_TYPE, '')}: {a.get(sc.AGL_EXCEPTION_MESSAGE, '')}")
    elif tag == "message":
        parts.append(str(a.get(sc.AGL_MESSAGE_BODY, "")))
    if span.status.code == "ERROR":
        parts.append(f"ERROR{': ' + span.status.message if span.status.message else ''}")
    if span.stale:
        parts.append("(stale)")
    return " ".join(p for p in parts if p)


def format_span_tree(spans: Sequence[Any], *, width: int = 100) -> str:
    """An indented tree (children under parents, by start time) with agent/tool/LLM/reward spans tagged."""
    if not spans:
        return "  (no spans)"
    by_id = {s.span_id: s for s in spans}
    children: dict[str | None, list[Any]] = {}
    for s in spans:
        parent = s.parent_id if s.parent_id in by_id and s.parent_id != s.span_id else None
        children.setdefault(parent, []).append(s)
    for kids in children.values():
        kids.sort(key=lambda s: (s.start_ns, s.seq or 0))
    lines: list[str] = []
    seen: set[str] = set()

    def walk(span: Any, depth: int) -> None:
        if span.span_id in seen:  # malformed parent links cannot loop the printer
            return
        seen.add(span.span_id)
        tag = span_tag(span)
        label = f"{'  ' * depth}{f'[{tag}] ' if tag else ''}{span.name}"
        details = span_details(span)
        dur = _duration(span.duration_ns / 1e9)
        room = max(10, width - len(label) - len(dur) - 3)
        line = f"{label} {_cut(details, room)}".rstrip() if details else label
        lines.append(f"{line.ljust(width - len(dur) - 1)} {dur}")
        for kid in children.get(span.span_id, ()):
            walk(kid, depth + 1)

    for root in children.get(None, ()):
        walk(root, 0)
    for s in spans:  # anything only reachable through a parent cycle
        if s.span_id not in seen:
            walk(s, 0)
    return "\n".join("  " + line.rstrip() for line in lines)
