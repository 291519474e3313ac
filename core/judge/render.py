"""A rollout rendered as text for a judge, from its spans: the conversation of its last LLM call
(every message, tool call and tool result it saw), then its failed tool calls and exceptions.

The last call's input messages hold the whole conversation the agent built, so one span gives the
trajectory in the order the model saw it; failures are read from the tool and exception spans because
an agent may hide them from the model. Long content is clipped to a budget (``chars_per_token`` × the
token budget, head and tail kept) so a group fits in the judge's context.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agl import semconv as sc

__all__ = ["CHARS_PER_TOKEN", "clip", "render_spans", "render_task"]

#: a rough, tokenizer-free size estimate: English text averages about four characters per token
CHARS_PER_TOKEN = 4


def clip(text: str, max_chars: int) -> str:
    """``text`` cut to at most about ``max_chars``, keeping its head and tail around a marker."""
    if len(text) <= max_chars:
        return text
    keep = max(max_chars - 40, 0)
    head, tail = keep * 2 // 3, keep // 3
    return f"{text[:head]} …[{len(text) - head - tail} chars clipped]… {text[len(text) - tail :]}"


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _content(msg: dict[str, Any]) -> str:
    content = msg.get("content")
    if isinstance(content, list):  # content parts
        content = " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    parts = [str(content)] if content else []
    for tc in msg.get("tool_calls") or ():
        fn = tc.get("function", tc) if isinstance(tc, dict) else {}
        parts.append(f"[tool call] {fn.get('name')}({fn.get('arguments', '')})")
    return "\n".join(parts)


def _last_chat(spans: Sequence[Any]) -> Any | None:
    chats = [s for s in spans if s.name == sc.SPAN_CHAT and s.attributes.get(sc.GEN_AI_INPUT_MESSAGES)]
    server = [s for s in chats if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER]
    pool = server or chats
    return max(pool, key=lambda s: s.end_ns) if pool else None


def _failures(spans: Sequence[Any], max_chars: int) -> list[str]:
    out = []
    for s in sorted(spans, key=lambda s: s.start_ns):
        a = s.attributes
        if s.name == sc.SPAN_EXECUTE_TOOL and s.status.code == "ERROR":
            args = clip(str(a.get(sc.GEN_AI_TOOL_CALL_ARGUMENTS, "")), max_chars)
            out.append(f"[tool error] {a.get(sc.GEN_AI_TOOL_NAME)}({args}): {s.status.message or ''}")
        elif s.name == sc.SPAN_EXCEPTION:
            msg = clip(str(a.get(sc.AGL_EXCEPTION_MESSAGE, "")), max_chars)
            out.append(f"[exception] {a.get(sc.AGL_EXCEPTION_TYPE, 'Exception')}: {msg}")
    return out


def render_spans(spans: Sequence[Any], *, token_budget: int = 1500) -> str:
    """One trajectory as text: ``role: content`` lines of the last LLM call's conversation and its
    answer, then the failures; each message clipped so the whole stays near ``token_budget``."""
    budget = token_budget * CHARS_PER_TOKEN
    last = _last_chat(spans)
    messages: list[dict[str, Any]] = []
    if last is not None:
        inputs = _json(last.attributes.get(sc.GEN_AI_INPUT_MESSAGES))
        outputs = _json(last.attributes.get(sc.GEN_AI_OUTPUT_MESSAGES))
        if isinstance(outputs, dict):
            outputs = [outputs]
        messages = [m for m in (inputs or []) if isinstance(m, dict)]
        messages += [
            dict(m, role=m.get("role", "assistant")) for m in (outputs or [])[:1] if isinstance(m, dict)
        ]
    failures = _failures(spans, budget // 8)
    items = [m for m in messages if m.get("role") != "system"] or messages
    per = max(budget // max(len(items) + len(failures), 1), 80)
    lines = [f"{m.get('role', '?')}: {clip(_content(m), per)}" for m in items]
    lines += [clip(f, per) for f in failures]
    if not lines:
        return "(no LLM call was recorded)"
    return "\n".join(lines)


def render_task(task_input: Any, *, token_budget: int = 500) -> str:
    """The task a group was given, as text (JSON for structured inputs), clipped."""
    text = (
        task_input if isinstance(task_input, str) else json.dumps(task_input, ensure_ascii=False, default=str)
    )
    return clip(text, token_budget * CHARS_PER_TOKEN)
