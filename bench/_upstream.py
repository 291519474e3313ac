"""A fast fake vLLM-compatible upstream for the gateway benchmark (its own process, raw asyncio).

    python bench/_upstream.py PORT

Answers ``POST /v1/chat/completions`` with one fixed chat completion in vLLM's >= 0.10.2 shape
(top-level ``prompt_token_ids``, ``choices[0].token_ids``, ``choices[0].logprobs.content``), or, when
the body asks for ``"stream": true``, the same reply as SSE chunks (``prompt_token_ids`` in the first
chunk, per-chunk ``token_ids`` and logprobs, usage last); ``GET /v1/models`` lists one model. No
tokenizer, no templating, no framework: the answer is prebuilt bytes, so the upstream costs a few tens
of microseconds per request and every proxy in front of it is measured on its own overhead.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
PROMPT_IDS = list(range(151644, 151644 + 40))
REPLY_TOKENS = ["The", " capital", " of", " France", " is", " Paris", ".", "<|im_end|>"]
REPLY_IDS = [785, 6722, 315, 9625, 374, 12095, 13, 151645]
LOGPROBS = [-0.01 * (k + 1) for k in range(len(REPLY_IDS))]
TEXT = "".join(REPLY_TOKENS[:-1])


def _lp(tokens: list[str], lps: list[float]) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, lps, strict=True)
        ]
    }


def chat_body() -> bytes:
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": TEXT, "refusal": None, "tool_calls": []},
                "logprobs": _lp(REPLY_TOKENS, LOGPROBS),
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": REPLY_IDS,
            }
        ],
        "usage": {"prompt_tokens": 40, "completion_tokens": 8, "total_tokens": 48},
        "prompt_logprobs": None,
        "prompt_token_ids": PROMPT_IDS,
    }
    return json.dumps(body, separators=(",", ":")).encode()


def stream_chunks() -> list[bytes]:
    head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
    out = [
        {
            **head,
            "prompt_token_ids": PROMPT_IDS,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
    ]
    for k, (tok, tid, lp) in enumerate(zip(REPLY_TOKENS, REPLY_IDS, LOGPROBS, strict=True)):
        last = k == len(REPLY_IDS) - 1
        out.append(
            {
                **head,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": "" if last else tok},
                        "logprobs": _lp([tok], [lp]),
                        "finish_reason": "stop" if last else None,
                        "token_ids": [tid],
                    }
                ],
            }
        )
    out.append(
        {**head, "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 8, "total_tokens": 48}}
    )
    return [b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in out] + [
        b"data: [DONE]\n\n"
    ]


def _response(status: bytes, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: "
        + ctype
        + b"\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


CHAT = _response(b"200 OK", chat_body())
MODELS = _response(
    b"200 OK",
    json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm"}]}).encode(),
)
NOT_FOUND = _response(b"404 Not Found", b'{"error":{"message":"not found","type":"NotFoundError"}}')
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
STREAM = (
    STREAM_HEAD + b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in stream_chunks()) + b"0\r\n\r\n"
)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            body = await reader.readexactly(length) if length else b""
            if head.startswith(b"POST") and b"/chat/completions" in head[:200]:
                stream = b'"stream":true' in body or b'"stream": true' in body
                writer.write(STREAM if stream else CHAT)
            elif head.startswith(b"GET") and b"/models" in head[:100]:
                writer.write(MODELS)
            else:
                writer.write(NOT_FOUND)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main(port: int) -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    asyncio.run(main(int(sys.argv[1])))
