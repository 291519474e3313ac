"""The gateway's stream writers: OpenAI chat-completion chunks, completion chunks, Responses-API events.

Every writer reads the same event protocol a streaming backend yields (through the gateway's tracking
wrapper): ``{"type": "delta", "index", "delta", ...}`` (an OpenAI chat delta: ``content`` and/or
``tool_calls``), ``{"type": "end", "result"}`` and ``{"type": "error", "error": ApiError}``. A reply
that was generated whole is streamed by turning it into that protocol first (:func:`result_events`),
so one writer per API serves both the true stream and the buffered one.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from agl.gateway.backends.base import GenerationResult
from agl.gateway.protocol import ResponsesRequest, new_id, responses_body

try:  # orjson is faster where installed; the stdlib is enough
    import orjson

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    loads = orjson.loads
except ImportError:  # pragma: no cover

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()

    loads = json.loads

__all__ = [
    "chat_chunks",
    "completion_chunks",
    "dumps",
    "loads",
    "pieces",
    "response_stream",
    "result_events",
    "sse",
    "sse_event",
]

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One ``data:`` SSE frame (OpenAI chat / completions streams)."""
    return b"data: " + dumps(obj) + b"\n\n"


def sse_event(obj: dict[str, Any]) -> bytes:
    """One named SSE frame, the event name being the object's ``type`` (Responses and Messages APIs)."""
    return b"event: " + obj["type"].encode() + b"\ndata: " + dumps(obj) + b"\n\n"


def pieces(text: str) -> list[str]:
    """Split text for streaming into word-sized deltas (whitespace kept, so they join back exactly)."""
    return re.findall(r"\s*\S+|\s+", text) or [""]


async def result_events(result: GenerationResult, index: int = 0) -> AsyncIterator[dict[str, Any]]:
    """A finished reply's choice ``index`` as the streaming event protocol: its text in word-sized
    deltas, then each tool call (name, id and whole arguments in one delta), then the ``end`` event."""
    choice = result.choices[index]
    if choice.content:
        for piece in pieces(choice.content):
            yield {"type": "delta", "index": index, "delta": {"content": piece}}
    for k, tc in enumerate(choice.tool_calls):
        call = {"index": k, "id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": ""}}
        yield {"type": "delta", "index": index, "delta": {"tool_calls": [call]}}
        args = {"index": k, "function": {"arguments": tc.arguments}}
        yield {"type": "delta", "index": index, "delta": {"tool_calls": [args]}}
    yield {"type": "end", "result": result}


def _usage_chunk(head: dict[str, Any], result: GenerationResult) -> bytes:
    prompt = result.prompt_tokens or 0
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": result.completion_tokens,
        "total_tokens": prompt + result.completion_tokens,
    }
    return sse({**head, "choices": [], "usage": usage})


async def chat_stream(
    events: AsyncIterator[dict[str, Any]],
    head: dict[str, Any],
    *,
    prompt_ids: list[int] | None,
    want_ids: bool,
    want_logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """Chat-completion chunks from a true stream's tracked events, as they come. ``head`` holds the
    chunks' ``id``, ``object``, ``created`` and ``model``; ``prompt_ids`` go on the first chunk."""
    result: GenerationResult | None = None
    async for ev in events:
        kind = ev["type"]
        if kind == "delta":
            lps = ev.get("logprobs")
            choice: dict[str, Any] = {
                "index": ev["index"],
                "delta": ev["delta"],
                "logprobs": {"content": lps, "refusal": None} if want_logprobs and lps is not None else None,
                "finish_reason": ev.get("finish_reason"),
            }
            if want_ids:
                choice["token_ids"] = ev.get("token_ids")
            chunk = {**head, "choices": [choice]}
            if prompt_ids is not None:
                chunk["prompt_token_ids"], prompt_ids = prompt_ids, None
            yield sse(chunk)
        elif kind == "error":
            yield sse(ev["error"].body())
            return
        elif kind == "end":
            result = ev["result"]
    if result is not None and include_usage:
        yield _usage_chunk(head, result)
    yield DONE


async def chat_chunks(
    result: GenerationResult, response_id: str, include_usage: bool, token_ids: bool
) -> AsyncIterator[bytes]:
    """A finished chat reply (every choice) as chat-completion chunks."""
    head = {"id": response_id, "object": "chat.completion.chunk", "created": int(time.time())}
    head["model"] = result.model

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}
        return sse({**head, "choices": [choice]})

    for i, c in enumerate(result.choices):
        first: dict[str, Any] = {"role": "assistant", "content": ""}
        yield chunk(i, first, **({"prompt_token_ids": result.prompt_ids} if token_ids and i == 0 else {}))
        async for ev in result_events(result, i):
            if ev["type"] == "delta":
                yield chunk(i, ev["delta"])
        yield chunk(i, {}, c.finish_reason, **({"token_ids": c.response_ids} if token_ids else {}))
    if include_usage:
        yield _usage_chunk(head, result)
    yield DONE


def completion_chunks(payload: dict[str, Any], include_usage: bool) -> Iterator[bytes]:
    """A finished ``/v1/completions`` body as text-completion chunks."""
    head = {k: payload[k] for k in ("id", "created", "model")}
    head["object"] = "text_completion"
    for c in payload["choices"]:
        for piece in pieces(c["text"]):
            choice = {"index": c["index"], "text": piece, "logprobs": None, "finish_reason": None}
            yield sse({**head, "choices": [choice]})
        last = {"index": c["index"], "text": "", "logprobs": None, "finish_reason": c["finish_reason"]}
        yield sse({**head, "choices": [last]})
    if include_usage:
        yield sse({**head, "choices": [], "usage": payload["usage"]})
    yield DONE


class _ResponseWriter:
    """The Responses-API event sequence, built from deltas: a message item while text comes, a
    ``function_call`` item per tool call (text after the first call is dropped, as a model's calls
    end its turn), every event numbered by ``sequence_number``."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.msg: dict[str, Any] | None = None  # the open message item: id, idx, text pieces
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its function_call item

    def event(self, obj: dict[str, Any]) -> bytes:
        obj["sequence_number"] = self.seq
        self.seq += 1
        return sse_event(obj)

    def text(self, piece: str) -> Iterator[bytes]:
        if self.calls:
            return
        if self.msg is None:
            self.msg = {"id": new_id("msg"), "idx": len(self.items), "parts": []}
            item = {"type": "message", "id": self.msg["id"], "status": "in_progress", "role": "assistant"}
            yield self.event(
                {
                    "type": "response.output_item.added",
                    "output_index": self.msg["idx"],
                    "item": {**item, "content": []},
                }
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield self.event({"type": "response.content_part.added", **self._ids(), "part": part})
        self.msg["parts"].append(piece)
        yield self.event(
            {"type": "response.output_text.delta", **self._ids(), "delta": piece, "logprobs": []}
        )

    def _ids(self) -> dict[str, Any]:
        assert self.msg is not None
        return {"item_id": self.msg["id"], "output_index": self.msg["idx"], "content_index": 0}

    def close_message(self) -> Iterator[bytes]:
        if self.msg is None:
            return
        ids, text = self._ids(), "".join(self.msg["parts"])
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = {"type": "message", "id": self.msg["id"], "status": "completed", "role": "assistant"}
        item["content"] = [part]
        self.items.append(item)
        self.msg = None
        yield self.event({"type": "response.output_text.done", **ids, "text": text, "logprobs": []})
        yield self.event({"type": "response.content_part.done", **ids, "part": part})
        yield self.event(
            {"type": "response.output_item.done", "output_index": ids["output_index"], "item": item}
        )

    def tool_call(self, tc: dict[str, Any]) -> Iterator[bytes]:
        k, fn = tc.get("index", 0), tc.get("function") or {}
        call = self.calls.get(k)
        if call is None:
            yield from self.close_message()
            call = self.calls[k] = {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": tc.get("id") or new_id("call"),
                "name": fn.get("name") or "",
                "arguments": "",
                "status": "in_progress",
            }
            call["idx"], call["parts"] = len(self.items) + len(self.calls) - 1, []
            item = {key: v for key, v in call.items() if key not in ("idx", "parts")}
            yield self.event(
                {"type": "response.output_item.added", "output_index": call["idx"], "item": item}
            )
        args = fn.get("arguments")
        if args:
            call["parts"].append(args)
            yield self.event(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": call["id"],
                    "output_index": call["idx"],
                    "delta": args,
                }
            )

    def close_calls(self) -> Iterator[bytes]:
        yield from self.close_message()
        for call in self.calls.values():
            idx = call.pop("idx")
            call["arguments"], call["status"] = "".join(call.pop("parts")), "completed"
            self.items.append(call)
            ids = {"item_id": call["id"], "output_index": idx}
            yield self.event(
                {
                    "type": "response.function_call_arguments.done",
                    **ids,
                    "arguments": call["arguments"],
                    "name": call["name"],
                }
            )
            yield self.event({"type": "response.output_item.done", "output_index": idx, "item": call})


async def response_stream(
    req: ResponsesRequest, response_id: str, created: float, events: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[bytes]:
    """Responses-API events (the sequence the openai SDK and the Agents SDK parse) from the event
    protocol: a true stream's tracked events, or :func:`result_events` of a finished reply."""
    w = _ResponseWriter()
    opening = responses_body(req, response_id, created, result=None)
    yield w.event({"type": "response.created", "response": opening})
    yield w.event({"type": "response.in_progress", "response": {**opening}})
    result: GenerationResult | None = None
    async for ev in events:
        if ev["type"] == "error":
            err = ev["error"]
            yield w.event({"type": "error", "code": err.code, "message": err.message, "param": err.param})
            return
        if ev["type"] == "end":
            result = ev["result"]
        elif ev["type"] == "delta" and ev["index"] == 0:
            delta = ev["delta"]
            if delta.get("content"):
                for frame in w.text(delta["content"]):
                    yield frame
            for tc in delta.get("tool_calls") or ():
                for frame in w.tool_call(tc):
                    yield frame
    for frame in w.close_calls():
        yield frame
    if result is None:  # pragma: no cover - the tracked stream ends with a result or an error
        return
    final = responses_body(req, response_id, created, result=result, output=w.items)
    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
    yield w.event({"type": kind, "response": final})
