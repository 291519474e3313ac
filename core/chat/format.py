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
or ``parameters`` as an object or a JSON string, an unterminated last block (generation stopped at
EOS) and Markdown code fences are accepted; a block that is not JSON stays in the content.
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
    "content_chars",
    "flatten_content",
    "lower_messages",
    "new_tool_call_id",
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

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
_FENCE_RE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


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
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str, *, allowed: set[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """Split model output into (content, tool calls). Blocks that do not parse stay in the content."""
    if "<tool_call>" not in text:
        return text, []
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for match in _TOOL_CALL_RE.finditer(text):
        body = match.group(1).strip()
        fence = _FENCE_RE.match(body)
        if fence:
            body = fence.group(1)
        try:
            obj = json.loads(body)
        except ValueError:
            continue
        objs = obj if isinstance(obj, list) else [obj]
        parsed = [_parse_call(o) for o in objs]
        if not parsed or any(p is None for p in parsed):
            continue
        if allowed is not None and any(p[0] not in allowed for p in parsed if p):
            continue
        kept.append(text[pos : match.start()])
        pos = match.end()
        calls.extend(ToolCall(name=p[0], arguments=p[1], id=new_tool_call_id()) for p in parsed if p)
    if not calls:
        return text, []
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls
