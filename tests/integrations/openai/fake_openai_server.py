"""A tiny OpenAI-protocol HTTP server on 127.0.0.1 for tests and benchmarks (a fixture, not a stub).

Speaks enough of ``/v1/chat/completions`` and ``/v1/responses`` — JSON and SSE streaming, text and
tool-call replies, usage — for the real ``openai`` client to parse it, and records every request's
headers and body. The model name picks the behaviour:

- ``tool-*``: the reply is a ``get_weather`` tool call;
- ``fail-400``: a 400 JSON error; ``fail-stream``: a stream that sends one chunk, then an error event;
- anything else: the text reply ``REPLY``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

REPLY = "Hello from the fake server."
TOOL_NAME = "get_weather"
TOOL_ARGS = '{"city": "Paris"}'
USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeOpenAI:
    requests: list[Recorded] = field(default_factory=list)
    record: bool = True

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
            ]
        )

    async def _read(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        if self.record:
            self.requests.append(
                Recorded(request.url.path, {k.lower(): v for k, v in request.headers.items()}, body)
            )
        return body

    async def models(self, request: Request) -> Response:
        if self.record:
            self.requests.append(
                Recorded(request.url.path, {k.lower(): v for k, v in request.headers.items()}, {})
            )
        return JSONResponse(
            {"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "agl"}]}
        )

    # ------------------------------------------------------------------------- chat completions
    async def chat(self, request: Request) -> Response:
        body = await self._read(request)
        model = str(body.get("model", ""))
        if model == "fail-400":
            return JSONResponse({"error": {"message": "bad model", "type": "invalid_request_error"}}, 400)
        tool = model.startswith("tool")
        cid = f"chatcmpl-{len(self.requests)}"
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": None if tool else REPLY}
            if tool:
                message["tool_calls"] = [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": TOOL_NAME, "arguments": TOOL_ARGS},
                    }
                ]
            return JSONResponse(
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [
                        {"index": 0, "message": message, "finish_reason": "tool_calls" if tool else "stop"}
                    ],
                    "usage": USAGE,
                }
            )
        return StreamingResponse(self._chat_stream(cid, model, tool), media_type="text/event-stream")

    async def _chat_stream(self, cid: str, model: str, tool: bool) -> AsyncIterator[bytes]:
        def chunk(delta: dict[str, Any], finish: str | None = None, usage: Any = None) -> bytes:
            data = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            if usage is not None:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n".encode()

        yield chunk({"role": "assistant", "content": ""})
        if model == "fail-stream":
            yield chunk({"content": "partial"})
            yield b'data: {"error": {"message": "the backend fell over", "type": "server_error"}}\n\n'
            return
        if tool:
            yield chunk(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": TOOL_NAME, "arguments": ""},
                        }
                    ]
                }
            )
            half = len(TOOL_ARGS) // 2
            for part in (TOOL_ARGS[:half], TOOL_ARGS[half:]):
                yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": part}}]})
            yield chunk({}, "tool_calls")
        else:
            for word in REPLY.split(" "):
                yield chunk({"content": word if word == REPLY.split(" ")[0] else " " + word})
            yield chunk({}, "stop")
        usage = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": 0,
            "model": model,
            "choices": [],
            "usage": USAGE,
        }
        yield f"data: {json.dumps(usage)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    # -------------------------------------------------------------------------------- responses
    def _response(self, rid: str, model: str, tool: bool, status: str = "completed") -> dict[str, Any]:
        if tool:
            output: list[dict[str, Any]] = [
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": "call_1",
                    "name": TOOL_NAME,
                    "arguments": TOOL_ARGS,
                    "status": "completed",
                }
            ]
        else:
            output = [
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": REPLY, "annotations": []}],
                }
            ]
        return {
            "id": rid,
            "object": "response",
            "created_at": 0,
            "model": model,
            "status": status,
            "output": output if status == "completed" else [],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": {"input_tokens": 11, "output_tokens": 7, "total_tokens": 18},
        }

    async def responses(self, request: Request) -> Response:
        body = await self._read(request)
        model = str(body.get("model", ""))
        if model == "fail-400":
            return JSONResponse({"error": {"message": "bad model", "type": "invalid_request_error"}}, 400)
        tool = model.startswith("tool")
        rid = f"resp_{len(self.requests)}"
        if not body.get("stream"):
            return JSONResponse(self._response(rid, model, tool))
        return StreamingResponse(self._responses_stream(rid, model, tool), media_type="text/event-stream")

    async def _responses_stream(self, rid: str, model: str, tool: bool) -> AsyncIterator[bytes]:
        seq = 0

        def event(data: dict[str, Any]) -> bytes:
            nonlocal seq
            data = {**data, "sequence_number": seq}
            seq += 1
            return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()

        created = self._response(rid, model, tool, status="in_progress")
        yield event({"type": "response.created", "response": created})
        if not tool:
            for word in REPLY.split(" "):
                yield event(
                    {
                        "type": "response.output_text.delta",
                        "item_id": "msg_1",
                        "output_index": 0,
                        "content_index": 0,
                        "delta": word + " ",
                        "logprobs": [],
                    }
                )
        yield event({"type": "response.completed", "response": self._response(rid, model, tool)})


@contextmanager
def serve(fake: FakeOpenAI | None = None) -> Iterator[tuple[FakeOpenAI, str]]:
    """Run the server in a thread on a free 127.0.0.1 port; yields (fake, base_url ending in /v1)."""
    fake = fake or FakeOpenAI()
    config = uvicorn.Config(fake.app(), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("fake OpenAI server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield fake, f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(5)


if __name__ == "__main__":  # python fake_openai_server.py: serve (not recording) until killed
    import sys

    with serve(FakeOpenAI(record=False)) as (_, url):
        print(url, flush=True)
        sys.stdin.read()  # until the parent closes our stdin
