"""What a client-side ``chat`` span records about one Anthropic Messages call.

``gen_ai.input.messages`` is the request's ``system`` (as a system message) followed by its
``messages`` as sent; ``gen_ai.output.messages`` is one Chat Completions-style assistant message
(text blocks joined as content, ``tool_use`` blocks as tool calls with JSON arguments), the shape every
agl integration records, so the adapter reads it the same way. Works on the SDK's pydantic objects and
on parsed JSON (raw responses), whole or streamed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from agl import semconv
from agl.instrumentation import safe_json
from agl.instrumentation.stainless import ClientChatSpan

MESSAGES = "messages"
_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}


def _g(obj: Any, key: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(key)
    return getattr(obj, key, None)


def classify(method: str, url: str) -> str | None:
    """``messages`` for a ``POST .../messages`` (not ``count_tokens``): the calls agl records."""
    if method.lower() != "post":
        return None
    path = url.split("?", 1)[0].rstrip("/")
    return MESSAGES if path.endswith("/messages") or path == "messages" else None


def request_attributes(api: str, body: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.GEN_AI_SYSTEM: "anthropic",
        semconv.AGL_SIDE: semconv.SIDE_CLIENT,
        semconv.AGL_INTEGRATION: "anthropic",
    }
    if not isinstance(body, Mapping):
        return attrs
    if isinstance(body.get("model"), str):
        attrs[semconv.GEN_AI_REQUEST_MODEL] = body["model"]
    for key, attr in (
        ("temperature", semconv.GEN_AI_REQUEST_TEMPERATURE),
        ("top_p", semconv.GEN_AI_REQUEST_TOP_P),
        ("max_tokens", semconv.GEN_AI_REQUEST_MAX_TOKENS),
    ):
        value = body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            attrs[attr] = value
    messages: list[Any] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": system})
    messages.extend(body.get("messages") or ())
    attrs[semconv.GEN_AI_INPUT_MESSAGES] = safe_json(messages)
    if body.get("tools"):
        attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = safe_json(body["tools"])
    return attrs


def _assistant(texts: list[str], calls: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _call(block: Any, arguments: str) -> dict[str, Any]:
    return {
        "id": _g(block, "id"),
        "type": "function",
        "function": {"name": _g(block, "name"), "arguments": arguments},
    }


def message_attributes(msg: Any) -> dict[str, Any]:
    """The response attributes of a whole ``message`` object."""
    attrs: dict[str, Any] = {}
    if isinstance(_g(msg, "id"), str):
        attrs[semconv.GEN_AI_RESPONSE_ID] = _g(msg, "id")
    if isinstance(_g(msg, "model"), str):
        attrs[semconv.GEN_AI_RESPONSE_MODEL] = _g(msg, "model")
    usage = _g(msg, "usage")
    for key, attr in (
        ("input_tokens", semconv.GEN_AI_USAGE_INPUT_TOKENS),
        ("output_tokens", semconv.GEN_AI_USAGE_OUTPUT_TOKENS),
    ):
        if isinstance(_g(usage, key), int):
            attrs[attr] = _g(usage, key)
    texts, calls = [], []
    for block in _g(msg, "content") or ():
        if _g(block, "type") == "text":
            texts.append(_g(block, "text") or "")
        elif _g(block, "type") == "tool_use":
            calls.append(_call(block, safe_json(_g(block, "input") or {})))
    attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = safe_json([_assistant(texts, calls)])
    reason = _g(msg, "stop_reason")
    if reason is not None:
        attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = [_FINISH.get(str(reason), str(reason))]
    return attrs


class MessagesSpan(ClientChatSpan):
    """One in-flight client ``chat`` span of a Messages call; for streams it assembles the message from
    the events (``message_start`` gives the message, ``content_block_*`` its blocks, ``message_delta``
    the stop reason and usage). Ending and failures: :class:`~agl.instrumentation.stainless.ClientChatSpan`."""

    __slots__ = ("_msg", "_blocks", "_json")
    sdk = "anthropic"

    def __init__(self, api: str, span: trace.Span) -> None:
        super().__init__(api, span)
        self._msg: dict[str, Any] = {}
        self._blocks: dict[int, dict[str, Any]] = {}
        self._json: dict[int, list[str]] = {}

    def response_attributes(self, resp: Any) -> dict[str, Any]:
        return message_attributes(resp)

    def record_chunk(self, chunk: Any) -> None:
        self._on_event(chunk)

    def _on_event(self, event: Any) -> None:
        kind = _g(event, "type")
        if kind == "message_start":
            m = _g(event, "message")
            self._msg = {"id": _g(m, "id"), "model": _g(m, "model"), "usage": {}}
            self._msg["usage"]["input_tokens"] = _g(_g(m, "usage"), "input_tokens")
        elif kind == "content_block_start":
            b = _g(event, "content_block")
            self._blocks[_g(event, "index")] = {
                "type": _g(b, "type"),
                "id": _g(b, "id"),
                "name": _g(b, "name"),
                "text": _g(b, "text") or "",
            }
        elif kind == "content_block_delta":
            d, i = _g(event, "delta"), _g(event, "index")
            if _g(d, "type") == "text_delta" and i in self._blocks:
                self._blocks[i]["text"] += _g(d, "text") or ""
            elif _g(d, "type") == "input_json_delta":
                self._json.setdefault(i, []).append(_g(d, "partial_json") or "")
        elif kind == "message_delta":
            self._msg["stop_reason"] = _g(_g(event, "delta"), "stop_reason")
            usage = _g(event, "usage")
            if isinstance(_g(usage, "output_tokens"), int):
                self._msg.setdefault("usage", {})["output_tokens"] = _g(usage, "output_tokens")
        elif kind == "error":
            self.span.set_status(
                Status(StatusCode.ERROR, str(_g(_g(event, "error"), "message") or "stream error"))
            )

    def stream_attributes(self) -> dict[str, Any]:
        texts, calls = [], []
        for i in sorted(self._blocks):
            b = self._blocks[i]
            if b["type"] == "text":
                texts.append(b["text"])
            elif b["type"] == "tool_use":
                calls.append(_call(b, "".join(self._json.get(i, ())) or "{}"))
        attrs = message_attributes({**self._msg, "content": []})
        attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = safe_json([_assistant(texts, calls)])
        return attrs
