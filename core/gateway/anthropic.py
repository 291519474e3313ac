"""The Anthropic Messages API on the gateway: request → chat messages, reply bodies, the event stream.

A Messages request becomes the OpenAI chat messages a Chat Completions client would have sent for the
same conversation (system prompt first, text blocks joined, each ``tool_use`` an assistant tool call
with its ``input`` as JSON arguments, each ``tool_result`` a ``tool`` message), so the backend renders
it through the same chat template into the same prompt token ids: an agent's transitions do not depend
on which API it spoke. ``stop_sequences`` are the chat ``stop`` list; ``top_k`` stays in the raw body,
where the backends read it. Errors answer in Anthropic's shape: ``{"type": "error", "error": {"type",
"message"}}``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal, Union

from pydantic import Field
from starlette.responses import Response

from agl.chat.format import flatten_content
from agl.gateway.backends.base import Choice, GenerationRequest, GenerationResult
from agl.gateway.protocol import ApiError, _Open, parse_request
from agl.gateway.sse import dumps, sse_event

__all__ = ["MessagesRequest", "error_response", "message_body", "message_stream", "to_generation"]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class _Message(_Open):
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class _Tool(_Open):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")
    description: str | None = None
    input_schema: dict[str, Any]


class MessagesRequest(_Open):
    """A ``POST /v1/messages`` body (fields the gateway does not use are accepted and ignored)."""

    model: str = Field(min_length=1)
    messages: list[_Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: Union[str, list[dict[str, Any]], None] = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    stream: bool = False
    tools: list[_Tool] | None = None
    tool_choice: dict[str, Any] | None = None


class CountTokensRequest(_Open):
    """A ``POST /v1/messages/count_tokens`` body: a Messages request without ``max_tokens``."""

    model: str = Field(min_length=1)
    messages: list[_Message] = Field(min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[_Tool] | None = None


def _text(blocks: Any, where: str) -> str:
    """Text blocks (or a string) as one string, joined as ``flatten_content`` joins OpenAI parts."""
    if isinstance(blocks, str):
        return blocks
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise ApiError(400, f"{where}[{i}] must be a text block", param=f"{where}[{i}]")
    return flatten_content(blocks)


def _user_turn(content: Any, where: str) -> list[dict[str, Any]]:
    """A user turn: its ``tool_result`` blocks as ``tool`` messages, then its text as a user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    texts: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block)
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            result = block.get("content")
            text = _text(result, f"{where}[{i}].content") if result is not None else ""
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise ApiError(
                400,
                f"{where}[{i}]: a user turn takes text and tool_result blocks, not {kind!r}",
                param=f"{where}[{i}].type",
            )
    if texts:
        out.append({"role": "user", "content": flatten_content(texts)})
    return out


def _assistant_turn(content: Any, where: str) -> dict[str, Any]:
    """An assistant turn: its text as content, its ``tool_use`` blocks as tool calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block)
        elif (
            kind == "tool_use" and isinstance(block.get("name"), str) and isinstance(block.get("input"), dict)
        ):
            args = json.dumps(block["input"], ensure_ascii=False)
            fn = {"name": block["name"], "arguments": args}
            calls.append({"id": block.get("id") or "", "type": "function", "function": fn})
        else:
            raise ApiError(
                400,
                f"{where}[{i}]: an assistant turn takes text and tool_use blocks, not {kind!r}",
                param=f"{where}[{i}].type",
            )
    msg: dict[str, Any] = {"role": "assistant", "content": flatten_content(texts) if texts else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The OpenAI chat messages of a validated Messages body (system prompt first)."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(body["messages"]):
        where = f"messages[{i}].content"
        if m["role"] == "user":
            out.extend(_user_turn(m["content"], where))
        else:
            out.append(_assistant_turn(m["content"], where))
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic tool definitions as OpenAI function tools."""
    if not tools:
        return None
    out = []
    for t in tools:
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn = {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> Any:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, f"invalid tool_choice {choice!r}", param="tool_choice")


def parse(body: Any, counting: bool = False) -> Any:
    """Validate a Messages (or count_tokens) body; a problem becomes a 400 naming the field."""
    return parse_request(CountTokensRequest if counting else MessagesRequest, body)


def to_generation(
    req: MessagesRequest, body: dict[str, Any], rollout: tuple[str, int] | None
) -> GenerationRequest:
    """The backend request of a validated Messages body (``api="messages"``, ``raw`` the body)."""
    return GenerationRequest(
        model=req.model,
        messages=chat_messages(body),
        tools=chat_tools(body.get("tools")),
        tool_choice=_tool_choice(req.tool_choice),
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_tokens,
        stop=list(req.stop_sequences or ()),
        rollout=rollout,
        api="messages",
        raw=body,
    )


def error_response(exc: ApiError) -> Response:
    """An ApiError in Anthropic's error shape (same status)."""
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": exc.message}}
    return Response(dumps(body), status_code=exc.status, media_type="application/json")


def _content(choice: Choice) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if choice.content:
        out.append({"type": "text", "text": choice.content})
    for tc in choice.tool_calls:
        out.append({"type": "tool_use", "id": tc.id, "name": tc.name, "input": _input(tc.arguments)})
    return out


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"value": value}


def _stop_reason(choice: Choice) -> str:
    if choice.tool_calls:
        return "tool_use"
    return _STOP_REASONS.get(choice.finish_reason, "end_turn")


def message_body(result: GenerationResult, message_id: str) -> dict[str, Any]:
    """The ``message`` object of a finished reply (its first choice)."""
    choice = result.choices[0]
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": result.model,
        "content": _content(choice),
        "stop_reason": _stop_reason(choice),
        "stop_sequence": None,
        "usage": {"input_tokens": result.prompt_tokens or 0, "output_tokens": result.completion_tokens},
    }


class _BlockWriter:
    """Content blocks from chat deltas: one text block while text comes, one ``tool_use`` block per call."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "text" or the open call's chat index, as a string
        self.tool_used = False

    def _start(self, block: dict[str, Any], key: str) -> list[bytes]:
        frames = self.stop()
        self.index += 1
        self.open = key
        return [
            *frames,
            sse_event({"type": "content_block_start", "index": self.index, "content_block": block}),
        ]

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse_event({"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, delta: dict[str, Any]) -> list[bytes]:
        frames: list[bytes] = []
        if delta.get("content") and not self.tool_used:
            if self.open != "text":
                frames += self._start({"type": "text", "text": ""}, "text")
            frames.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for tc in delta.get("tool_calls") or ():
            key, fn = f"call{tc.get('index', 0)}", tc.get("function") or {}
            if self.open != key:
                self.tool_used = True
                block = {
                    "type": "tool_use",
                    "id": tc.get("id") or "",
                    "name": fn.get("name") or "",
                    "input": {},
                }
                frames += self._start(block, key)
            if fn.get("arguments"):
                frames.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return frames


async def message_stream(
    model: str, message_id: str, events: AsyncIterator[dict[str, Any]], input_tokens: int | None
) -> AsyncIterator[bytes]:
    """Anthropic's event sequence (``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``,
    ``message_delta``, ``message_stop``) from the gateway's event protocol: a true stream's tracked
    events, or :func:`agl.gateway.sse.result_events` of a finished reply."""
    opening = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens or 0, "output_tokens": 0},
    }
    yield sse_event({"type": "message_start", "message": opening})
    w = _BlockWriter()
    result: GenerationResult | None = None
    async for ev in events:
        if ev["type"] == "error":
            err = ev["error"]
            body = {"type": "error", "error": {"type": "api_error", "message": err.message}}
            yield sse_event(body)
            return
        if ev["type"] == "end":
            result = ev["result"]
        elif ev["type"] == "delta" and ev["index"] == 0:
            for frame in w.feed(ev["delta"]):
                yield frame
    for frame in w.stop():
        yield frame
    if result is None:  # pragma: no cover - the tracked stream ends with a result or an error
        return
    usage = {"input_tokens": result.prompt_tokens or 0, "output_tokens": result.completion_tokens}
    delta = {"stop_reason": _stop_reason(result.choices[0]), "stop_sequence": None}
    yield sse_event({"type": "message_delta", "delta": delta, "usage": usage})
    yield sse_event({"type": "message_stop"})
