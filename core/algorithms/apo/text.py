"""The optimiser's side of APO, as text: its instructions, how its replies are parsed, and how a
rollout's spans are told to it (:func:`summarize_trace`). Pure functions over strings and spans,
so they can be checked without a model; :mod:`agl.algorithms.apo.optimizer` sends them and
:mod:`agl.algorithms.apo.loop` runs the rounds.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any, Literal

from agl import semconv as sc
from agl.errors import OptimizerError
from agl.types import Span

__all__ = [
    "CRITIQUE_SYSTEM",
    "JSON_ASK",
    "REPAIR_ASK",
    "REWRITE_SYSTEM",
    "TEXT_ASK",
    "OptimizerError",
    "clip",
    "estimate_tokens",
    "parse_rewrite",
    "summarize_trace",
]

#: The optimiser's instructions for the critique (textual gradient). A scripted optimiser in the
#: tests tells the two kinds of call apart by these first words.
CRITIQUE_SYSTEM = (
    "You are a prompt engineer who critiques the prompts of LLM agents. You are shown an agent's "
    "prompt and traces of tasks it failed. Explain briefly and concretely what in the prompt leads "
    "to these failures and what the prompt should say instead. Do not write the new prompt."
)
REWRITE_SYSTEM = (
    "You are a prompt engineer who rewrites the prompts of LLM agents. You are given an agent's "
    "prompt and a critique of it. Write an improved prompt that fixes what the critique points out, "
    "keeping what already works."
)
JSON_ASK = 'Reply with JSON only, exactly {"prompt": "<the complete new prompt>"}.'
TEXT_ASK = "Reply with the complete new prompt only, nothing before or after it."
REPAIR_ASK = 'That reply was not valid JSON of the form {"prompt": "..."}. ' + JSON_ASK


# ------------------------------------------------------------------------------------ parsing


_FENCE = re.compile(r"^\s*```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?\s*```\s*$", re.S)
_TAGS = re.compile(r"<prompt>\s*(.*?)\s*</prompt>", re.S | re.I)


def parse_rewrite(text: str | None, fmt: Literal["json", "text"] = "json") -> str:
    """The new prompt in an optimiser reply; ``OptimizerError`` when there is none.

    ``json``: the first JSON object with a string ``"prompt"`` anywhere in the reply (code fences and
    chatter around it are tolerated), else a ``<prompt>...</prompt>`` block. ``text``: the reply
    itself, without code fences, quotes or ``<prompt>`` tags (for optimisers too weak for JSON).
    """
    raw = (text or "").strip()
    if not raw:
        raise OptimizerError("empty_reply", "the optimiser's reply was empty")
    if fmt == "json":
        decoder = json.JSONDecoder()
        for start in [m.start() for m in re.finditer(r"\{", raw)]:
            try:
                obj, _ = decoder.raw_decode(raw, start)
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                new = obj["prompt"].strip()
                if not new:
                    raise OptimizerError("empty_rewrite", 'the optimiser returned an empty "prompt"')
                return new
        tagged = _TAGS.search(raw)
        if tagged and tagged.group(1).strip():
            return tagged.group(1).strip()
        raise OptimizerError("bad_json", f'no JSON object with a "prompt" string in the reply: {raw[:200]!r}')
    tagged = _TAGS.search(raw)
    if tagged:
        raw = tagged.group(1)
    fenced = _FENCE.match(raw)
    if fenced:
        raw = fenced.group(1)
    raw = raw.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
        raw = raw[1:-1].strip()
    if not raw:
        raise OptimizerError("empty_rewrite", "the optimiser's rewrite was empty")
    return raw


# ------------------------------------------------------------------------------------- traces


def _agent_of(span: Span, by_id: dict[str, Span]) -> str | None:
    seen = 0
    cur: Span | None = span
    while cur is not None and seen < 64:
        if cur.attributes.get(sc.GEN_AI_OPERATION_NAME) == sc.OP_INVOKE_AGENT:
            name = cur.attributes.get(sc.GEN_AI_AGENT_NAME)
            if name:
                return str(name)
        cur = by_id.get(cur.parent_id) if cur.parent_id else None
        seen += 1
    return None


def _content(message: Any) -> str:
    if not isinstance(message, dict):
        return str(message)
    content = message.get("content")
    if isinstance(content, list):
        content = " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    text = "" if content is None else str(content)
    for tc in message.get("tool_calls") or ():
        fn = tc.get("function", tc) if isinstance(tc, dict) else {}
        text += f" [calls {fn.get('name')}({fn.get('arguments')})]"
    return text.strip()


def clip(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def summarize_trace(spans: Sequence[Span], *, max_chars: int = 2000, message_chars: int = 300) -> str:
    """A readable account of one attempt, for the optimiser: LLM calls (agent, the last user
    message, the reply), tool calls and their errors, exceptions and rewards, in time order.

    Server-side chat spans (the gateway's, present for every backend) carry the messages; system
    prompts are left out (the optimiser is shown the prompt separately).
    """
    by_id = {s.span_id: s for s in spans}
    lines: list[str] = []
    for s in sorted(spans, key=lambda x: (x.start_ns, x.end_ns)):
        a = s.attributes
        op = a.get(sc.GEN_AI_OPERATION_NAME)
        if op == sc.OP_CHAT and a.get(sc.AGL_SIDE) == sc.SIDE_SERVER:
            agent = _agent_of(s, by_id) or "agent"
            try:
                msgs = json.loads(a.get(sc.GEN_AI_INPUT_MESSAGES) or "[]")
            except ValueError:
                msgs = []
            last = next(
                (m for m in reversed(msgs) if isinstance(m, dict) and m.get("role") != "system"), None
            )
            if last is not None:
                lines.append(f"[{agent}] {last.get('role', '?')}: {clip(_content(last), message_chars)}")
            try:
                out = json.loads(a.get(sc.GEN_AI_OUTPUT_MESSAGES) or "[]")
            except ValueError:
                out = []
            if s.status.code == "ERROR":
                lines.append(f"[{agent}] LLM call failed: {clip(s.status.message or '', message_chars)}")
            for m in out[:1]:
                lines.append(f"[{agent}] assistant: {clip(_content(m), message_chars)}")
        elif op == sc.OP_EXECUTE_TOOL:
            name = a.get(sc.GEN_AI_TOOL_NAME, "tool")
            args = clip(str(a.get(sc.GEN_AI_TOOL_CALL_ARGUMENTS, "")), 160)
            if s.status.code == "ERROR":
                lines.append(f"tool {name}({args}) -> ERROR {clip(s.status.message or '', 200)}")
            else:
                lines.append(
                    f"tool {name}({args}) -> {clip(str(a.get(sc.GEN_AI_TOOL_CALL_RESULT, '')), 200)}"
                )
        elif s.name == sc.SPAN_EXCEPTION:
            lines.append(
                f"exception {a.get(sc.AGL_EXCEPTION_TYPE, '')}: {clip(str(a.get(sc.AGL_EXCEPTION_MESSAGE, '')), 300)}"
            )
        elif s.name == sc.SPAN_REWARD and a.get(sc.AGL_REWARD_PRIMARY, True):
            lines.append(f"reward {a.get(sc.AGL_REWARD_VALUE)}")
    text = "\n".join(lines) or "(no LLM calls were recorded)"
    if len(text) > max_chars:  # keep the end: the final answer and the reward are what failed
        text = "…\n" + text[-(max_chars - 2) :]
    return text


def estimate_tokens(messages: Sequence[dict[str, str]]) -> int:
    """A deliberately high estimate of a prompt's tokens (digits count one each, other characters
    one per three, plus a few per message), so a budget is not overrun by an under-estimate."""
    total = 0
    for m in messages:
        text = m.get("content") or ""
        digits = sum(c.isdigit() for c in text)
        total += digits + math.ceil((len(text) - digits) / 3) + 6
    return total
