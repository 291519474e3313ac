"""What a client-side ``chat`` span records about one OpenAI call (DESIGN §4).

Works on request bodies (plain dicts) and on responses either as openai's pydantic objects or as
parsed JSON dicts (raw responses), for Chat Completions and Responses, whole or streamed.

Message shapes: ``gen_ai.input.messages`` is the request's ``messages`` list as sent (Chat
Completions), or for Responses the ``instructions`` as a system message followed by the ``input``
(a string becomes one user message; a list of items is kept as sent). ``gen_ai.output.messages`` is
a list of Chat Completions-style assistant messages, one per choice:
``{"role": "assistant", "content": str | None, "tool_calls": [{"id", "type": "function",
"function": {"name", "arguments"}}]}`` (``tool_calls`` only when there are some).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from agl import semconv
from agl.instrumentation import safe_json
from agl.instrumentation.stainless import ClientChatSpan

logger = logging.getLogger(__name__)

CHAT_COMPLETIONS = "chat.completions"
RESPONSES = "responses"

_MAX_TOKENS_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
_RESPONSES_FINISH = {"max_output_tokens": "length", "content_filter": "content_filter"}


def _g(obj: Any, key: str) -> Any:
    """Field of an openai model or of the same data as a parsed-JSON dict."""
    if obj is None:
        return None
    if isinstance(obj, dict):  # a plain dict check: this runs for every field of every chunk
        return obj.get(key)
    return getattr(obj, key, None)


def to_json(value: Any) -> str:
    """Compact JSON of a request/response part (the toolkit's encoder: never raises)."""
    return safe_json(value)


def classify(method: str, url: str) -> str | None:
    """The API a request goes to, if it is an LLM call agl records: chat completions or responses."""
    if method.lower() != "post":
        return None
    path = url.split("?", 1)[0].rstrip("/")
    if path.endswith("/chat/completions") or path == "chat/completions":
        return CHAT_COMPLETIONS
    if path.endswith("/responses") or path == "responses":
        return RESPONSES
    return None


def request_attributes(api: str, body: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.GEN_AI_SYSTEM: "openai",
        semconv.AGL_SIDE: semconv.SIDE_CLIENT,
        semconv.AGL_INTEGRATION: "openai",
    }
    if not isinstance(body, Mapping):
        return attrs
    model = body.get("model")
    if isinstance(model, str):
        attrs[semconv.GEN_AI_REQUEST_MODEL] = model
    for key, attr in (
        ("temperature", semconv.GEN_AI_REQUEST_TEMPERATURE),
        ("top_p", semconv.GEN_AI_REQUEST_TOP_P),
    ):
        value = body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            attrs[attr] = value
    for key in _MAX_TOKENS_KEYS:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            attrs[semconv.GEN_AI_REQUEST_MAX_TOKENS] = value
            break
    try:
        if api == CHAT_COMPLETIONS:
            messages = body.get("messages")
            if messages is not None:
                attrs[semconv.GEN_AI_INPUT_MESSAGES] = to_json(messages)
        else:
            attrs[semconv.GEN_AI_INPUT_MESSAGES] = to_json(_responses_input(body))
        tools = body.get("tools")
        if tools:
            attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = to_json(tools)
    except (TypeError, ValueError) as exc:  # unserialisable input: record the call without it
        logger.debug("agl: cannot serialise request messages: %r", exc)
    return attrs


def _responses_input(body: Mapping[str, Any]) -> list[Any]:
    messages: list[Any] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    value = body.get("input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, (list, tuple)):
        messages.extend(value)
    return messages


def _tool_call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments or ""}}


def _message(content: Any, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def _usage_attrs(usage: Any, attrs: dict[str, Any]) -> None:
    if usage is None:
        return
    prompt = _g(usage, "prompt_tokens")
    if prompt is None:
        prompt = _g(usage, "input_tokens")
    completion = _g(usage, "completion_tokens")
    if completion is None:
        completion = _g(usage, "output_tokens")
    if isinstance(prompt, int):
        attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = prompt
    if isinstance(completion, int):
        attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = completion


def chat_completion_attributes(resp: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    _common_response(resp, attrs)
    messages: list[dict[str, Any]] = []
    finish: list[str] = []
    for choice in _g(resp, "choices") or ():
        msg = _g(choice, "message")
        calls = [
            _tool_call(_g(c, "id"), _g(_g(c, "function"), "name"), _g(_g(c, "function"), "arguments"))
            for c in (_g(msg, "tool_calls") or ())
        ]
        messages.append(_message(_g(msg, "content"), calls))
        reason = _g(choice, "finish_reason")
        finish.append(str(reason) if reason is not None else "")
    attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = to_json(messages)
    if finish:
        attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = finish
    return attrs


def responses_attributes(resp: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    _common_response(resp, attrs)
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in _g(resp, "output") or ():
        kind = _g(item, "type")
        if kind == "message":
            for part in _g(item, "content") or ():
                if _g(part, "type") == "output_text":
                    texts.append(_g(part, "text") or "")
                elif _g(part, "type") == "refusal":
                    texts.append(_g(part, "refusal") or "")
        elif kind == "function_call":
            calls.append(_tool_call(_g(item, "call_id"), _g(item, "name"), _g(item, "arguments")))
    attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = to_json([_message("".join(texts) if texts else None, calls)])
    status = _g(resp, "status")
    if calls:
        reason = "tool_calls"
    elif status == "incomplete":
        detail = _g(_g(resp, "incomplete_details"), "reason")
        reason = _RESPONSES_FINISH.get(str(detail), str(detail or "incomplete"))
    else:
        reason = "stop" if status in (None, "completed") else str(status)
    attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = [reason]
    return attrs


def _common_response(resp: Any, attrs: dict[str, Any]) -> None:
    rid = _g(resp, "id")
    if isinstance(rid, str):
        attrs[semconv.GEN_AI_RESPONSE_ID] = rid
    model = _g(resp, "model")
    if isinstance(model, str):
        attrs[semconv.GEN_AI_RESPONSE_MODEL] = model
    _usage_attrs(_g(resp, "usage"), attrs)


def response_attributes(api: str, resp: Any) -> dict[str, Any]:
    if api == CHAT_COMPLETIONS:
        return chat_completion_attributes(resp)
    return responses_attributes(resp)


class _ChoiceAcc:
    __slots__ = ("content", "finish", "tool_calls")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None


class ChatSpan(ClientChatSpan):
    """One in-flight client ``chat`` span of an openai call; for streams it assembles the output from
    the chunks (ending and failure handling: :class:`~agl.instrumentation.stainless.ClientChatSpan`)."""

    __slots__ = ("_choices", "_resp_attrs", "_resp_final", "_text")
    sdk = "openai"

    def __init__(self, api: str, span: trace.Span) -> None:
        super().__init__(api, span)
        self._choices: dict[int, _ChoiceAcc] | None = None
        self._resp_attrs: dict[str, Any] = {}
        self._resp_final: Any = None
        self._text: list[str] | None = None

    def response_attributes(self, resp: Any) -> dict[str, Any]:
        return response_attributes(self.api, resp)

    def record_chunk(self, chunk: Any) -> None:
        if self.api == CHAT_COMPLETIONS:
            self._on_chat_chunk(chunk)
        else:
            self._on_responses_event(chunk)

    def _on_chat_chunk(self, chunk: Any) -> None:
        attrs = self._resp_attrs
        if semconv.GEN_AI_RESPONSE_ID not in attrs:
            _common_response(chunk, attrs)
        else:
            _usage_attrs(_g(chunk, "usage"), attrs)
        if self._choices is None:
            self._choices = {}
        for choice in _g(chunk, "choices") or ():
            index = _g(choice, "index") or 0
            acc = self._choices.get(index)
            if acc is None:
                acc = self._choices[index] = _ChoiceAcc()
            delta = _g(choice, "delta")
            content = _g(delta, "content")
            if content:
                acc.content.append(content)
            for call in _g(delta, "tool_calls") or ():
                i = _g(call, "index") or 0
                entry = acc.tool_calls.get(i)
                fn = _g(call, "function")
                if entry is None:
                    entry = acc.tool_calls[i] = _tool_call(_g(call, "id"), _g(fn, "name"), "")
                elif _g(call, "id") and not entry["id"]:
                    entry["id"] = _g(call, "id")
                if _g(fn, "name") and not entry["function"]["name"]:
                    entry["function"]["name"] = _g(fn, "name")
                args = _g(fn, "arguments")
                if args:
                    entry["function"]["arguments"] += args
            reason = _g(choice, "finish_reason")
            if reason is not None:
                acc.finish = str(reason)

    def _on_responses_event(self, event: Any) -> None:
        kind = _g(event, "type")
        if kind in ("response.completed", "response.incomplete", "response.failed", "response.created"):
            resp = _g(event, "response")
            if resp is not None:
                self._resp_final = resp
            if kind == "response.failed":
                error = _g(resp, "error")
                message = _g(error, "message") or "response failed"
                self.span.set_status(Status(StatusCode.ERROR, str(message)))
        elif kind == "response.output_text.delta":
            if self._text is None:
                self._text = []
            self._text.append(_g(event, "delta") or "")
        elif kind == "error":
            self.span.set_status(Status(StatusCode.ERROR, str(_g(event, "message") or "stream error")))

    def stream_attributes(self) -> dict[str, Any]:
        if self.api == RESPONSES:
            if self._resp_final is not None and _g(self._resp_final, "output"):
                return responses_attributes(self._resp_final)
            attrs: dict[str, Any] = {}
            if self._resp_final is not None:
                _common_response(self._resp_final, attrs)
            text = "".join(self._text) if self._text is not None else None
            attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = to_json([_message(text, [])])
            return attrs
        attrs = dict(self._resp_attrs)
        choices = self._choices or {}
        messages = []
        finish = []
        for index in sorted(choices):
            acc = choices[index]
            calls = [acc.tool_calls[i] for i in sorted(acc.tool_calls)]
            messages.append(_message("".join(acc.content) if acc.content else None, calls))
            finish.append(acc.finish or "")
        attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = to_json(messages)
        if finish:
            attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = finish
        return attrs
