"""Chat messages + tools ⇄ model text: rendering through a chat template, parsing tool calls back.

The rendering is the single source of prompt token ids, so it must be stable: the same
conversation always renders to the same text, and a tool call the model emitted in the canonical
format renders back to exactly the text it generated (what ``agl.llm.prefix_match`` measures).

Templates that know about tools (Qwen2.5, Llama 3.1, Hermes, ...) get the OpenAI messages and tools
as Hugging Face's ``apply_chat_template`` would pass them. Templates that do not (SmolLM2's) get the
conversation *lowered* to plain messages in the Hermes/Qwen convention that small instruct models
were trained on:

- the tool list goes into the system message between ``<tools>`` tags, one JSON object per line;
- an assistant tool call becomes ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- a tool result becomes a ``tool`` message ``<tool_response>\\n...\\n</tool_response>``.

Parsing is lenient: ``<tool_call>`` blocks holding one JSON object or a list of them, ``arguments``
or ``parameters`` as an object or a JSON string, an unterminated block (generation stopped at EOS, or
the next ``<tool_call>`` began) and Markdown code fences are accepted; a block that holds no call
stays in the content. A block whose call is followed by more (the model kept writing after the
call's closing brace, or wrote several calls one after another) keeps every complete call at its
start and the rest as content: :func:`parse_reply` counts such blocks (``repairs``), and the gateway
records the count on the call's span (``agl.llm.tool_call_repairs``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made; ``arguments`` is the JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


__all__ = [
    "TOOL_SYSTEM_PROMPT",
    "ParsedReply",
    "content_chars",
    "flatten_content",
    "lower_messages",
    "new_tool_call_id",
    "parse_reply",
    "parse_tool_calls",
    "render_chat",
    "render_tool_call",
    "template_supports_tools",
]

TOOL_SYSTEM_PROMPT = (
    "You are a function calling AI model. You may call one or more functions to assist with the user "
    "query. Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|(?=<tool_call>)|\Z)", re.S)
_FENCE_OPEN_RE = re.compile(r"\s*```(?:json)?\s*")
_DECODER = json.JSONDecoder()


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def flatten_content(content: Any) -> str:
    """OpenAI content (a string, None, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                text = part.get("text")
                if text is None and part.get("type") == "refusal":
                    text = part.get("refusal")
                if isinstance(text, str):
                    parts.append(text)
        return "".join(parts)
    return str(content)


def content_chars(messages: Sequence[Any] | None, prompt: str | None = None) -> int:
    """Characters of message content (stripped, as templates that trim it see it), plus a completion
    ``prompt``: a lower bound of the rendered prompt's length under any template, counted without
    rendering anything (cheap enough for the event loop, whatever the request's size).

    Tool calls and tool definitions are left out: they are re-serialised when rendered and may come
    out shorter than sent.
    """
    total = len(prompt) if isinstance(prompt, str) else 0
    for msg in messages or ():
        if not isinstance(msg, dict):
            continue
        content = msg.get("content")
        if isinstance(content, str):
            total += len(content.strip())
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else part
                if isinstance(text, str):
                    total += len(text.strip())
    return total


def _arguments_object(arguments: Any) -> Any:
    """Tool-call arguments as a JSON value (the text when it is not JSON, so nothing is lost)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return arguments
    return {} if arguments is None else arguments


def render_tool_call(name: str, arguments: Any) -> str:
    """The canonical text of one tool call: what the model is asked to emit and what is re-rendered."""
    body = json.dumps({"name": name, "arguments": _arguments_object(arguments)}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _tool_function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool) if isinstance(tool, dict) else {}


TOOL_CALL_OPEN = "<tool_call>\n"


def forced_tool_prefix(tool_choice: Any, tools: Sequence[dict[str, Any]] | None) -> str:
    """The text a reply must start with to honour ``tool_choice``: ``""`` for ``None``/``"auto"``/
    ``"none"``; the tool-call opening for ``"required"``; the opening and the function's name up to its
    arguments for a named function (the start of :func:`render_tool_call`'s text, so the parsed call is
    the same). Raises ``ValueError`` naming a value that cannot be honoured."""
    if tool_choice in (None, "auto", "none"):
        return ""
    names = [_tool_function(t).get("name") for t in tools or []]
    if not names:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools, and the request offers none")
    if tool_choice == "required":
        return TOOL_CALL_OPEN
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise ValueError(
                f"tool_choice names the function {name!r}, which is not among the tools ({', '.join(map(str, names))})"
            )
        return TOOL_CALL_OPEN + json.dumps({"name": name}, ensure_ascii=False)[:-1] + ', "arguments": '
    raise ValueError(
        f"tool_choice {tool_choice!r} is not supported: use 'none', 'auto', 'required' or a function"
    )


def lower_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Messages with tool definitions, tool calls and tool results spelled out as plain text."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        role = msg.get("role", "user")
        if role == "developer":
            role = "system"
        content = flatten_content(msg.get("content"))
        if role == "assistant" and msg.get("tool_calls"):
            calls = []
            for tc in msg["tool_calls"]:
                fn = tc.get("function", {}) if isinstance(tc, dict) else {}
                calls.append(render_tool_call(fn.get("name", ""), fn.get("arguments")))
            content = (content + "\n" if content else "") + "\n".join(calls)
        elif role in ("tool", "function"):
            role = "tool"
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        listing = "\n".join(json.dumps(_tool_function(t), ensure_ascii=False) for t in tools)
        prompt = TOOL_SYSTEM_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _native_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a tool-aware template: text content, tool-call arguments as objects (HF convention)."""
    out = []
    for msg in messages:
        m = dict(msg)
        m["content"] = flatten_content(msg.get("content"))
        if msg.get("tool_calls"):
            calls = []
            for tc in msg["tool_calls"]:
                fn = dict(tc.get("function", {}))
                fn["arguments"] = _arguments_object(fn.get("arguments"))
                calls.append({**tc, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


def template_supports_tools(template: str) -> bool:
    return "tools" in template


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _raise(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=16)
def _compile(template: str) -> Callable[..., str]:
    """Compile like Hugging Face's ``apply_chat_template`` does, so both render identically."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(template).render


def render_chat(
    template: str,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
) -> str:
    """The prompt text for ``messages`` (+ ``tools``) under ``template``."""
    if template_supports_tools(template):
        msgs = _native_messages(messages)
        kwargs: dict[str, Any] = {"tools": list(tools) if tools else None}
    else:
        msgs = lower_messages(messages, tools)
        kwargs = {}
    return _compile(template)(
        messages=msgs, add_generation_prompt=add_generation_prompt, **kwargs, **(special_tokens or {})
    )


def _parse_call(obj: Any) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of one call object, or None when it is not a call. The arguments of a
    call are a JSON object (OpenAI's and Anthropic's wire formats both say so): a number, list or string
    that decodes to one of those is no call (``{"name": "add", "arguments": 2`` is text the model was
    still writing, not a call with arguments 2); ``null`` is no arguments; a string that is not JSON is
    kept as the model wrote it, so the agent sees, and AIR penalises, arguments that do not parse."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return obj["name"], args
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


@dataclass(frozen=True)
class ParsedReply:
    """Model text split into content and tool calls; ``repairs``: the ``<tool_call>`` blocks that held
    more than one JSON call (text after the call, or several calls in a row), whose calls were kept and
    whose remaining text went to the content."""

    content: str | None
    tool_calls: list[ToolCall]
    repairs: int = 0


def _block_calls(body: str) -> tuple[list[tuple[str, str]], str, bool] | None:
    """The complete calls at the start of one block's body (a fence opening it skipped), the text
    after them, and whether the body was more than one JSON value; None when it starts with no call."""
    fence = _FENCE_OPEN_RE.match(body)
    pos = fence.end() if fence else 0
    calls: list[tuple[str, str]] = []
    values = 0
    while True:
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if pos >= len(body) or body[pos] not in "[{":
            break
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except ValueError:
            break
        parsed = [_parse_call(o) for o in (obj if isinstance(obj, list) else [obj])]
        if not parsed or any(p is None for p in parsed):
            break
        calls += [p for p in parsed if p is not None]
        values, pos = values + 1, end
    if not calls:
        return None
    rest = body[pos:].strip()
    if fence and rest.startswith("```"):  # the fence's closing
        rest = rest[3:].strip()
    return calls, rest, values > 1 or bool(rest)


def parse_reply(text: str, *, allowed: set[str] | None = None) -> ParsedReply:
    """Split model output into content and tool calls. Blocks holding no call (or, with ``allowed``,
    a call of a function not in it) stay in the content whole; text after a block's calls joins it."""
    if "<tool_call>" not in text:
        return ParsedReply(text, [])
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = repairs = 0
    for match in _TOOL_CALL_RE.finditer(text):
        found = _block_calls(match.group(1))
        if found is None:
            continue
        parsed, rest, repaired = found
        if allowed is not None and any(name not in allowed for name, _ in parsed):
            continue
        kept.append(text[pos : match.start()])
        if rest:
            before = "".join(kept)
            kept.append(("\n" if before and not before[-1].isspace() else "") + rest)
        repairs += repaired
        pos = match.end()
        calls.extend(ToolCall(name=name, arguments=args, id=new_tool_call_id()) for name, args in parsed)
    if not calls:
        return ParsedReply(text, [])
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return ParsedReply(content or None, calls, repairs)


def parse_tool_calls(text: str, *, allowed: set[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """Split model output into (content, tool calls) (:func:`parse_reply` without its repair count)."""
    reply = parse_reply(text, allowed=allowed)
    return reply.content, reply.tool_calls
