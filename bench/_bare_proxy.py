"""A bare pass-through proxy: the floor for what agl's gateway adds (its own process).

    python bench/_bare_proxy.py PORT UPSTREAM

The same server stack as agl's gateway (uvicorn with uvloop and httptools, Starlette) and the same
upstream client (one aiohttp session), but nothing else: no validation, no spans, no tokenisation, no
rollout. ``POST /v1/chat/completions`` (also under any ``/rollouts/.../v1`` prefix) forwards the body
and returns the upstream's status and bytes, streamed chunk by chunk when the body asks for a stream.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


def create_app(upstream: str) -> Starlette:
    state: dict[str, aiohttp.ClientSession] = {}
    url = upstream.rstrip("/") + "/v1/chat/completions"

    async def chat(request: Request) -> Response:
        body = await request.body()
        session = state["session"]
        resp = await session.post(url, data=body, headers={"Content-Type": "application/json"})
        if b'"stream":true' in body.replace(b" ", b""):

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    async for chunk in resp.content.iter_any():
                        yield chunk
                finally:
                    resp.release()

            return StreamingResponse(chunks(), status_code=resp.status, media_type="text/event-stream")
        data = await resp.read()
        resp.release()
        return Response(data, status_code=resp.status, media_type="application/json")

    async def models(request: Request) -> Response:
        async with state["session"].get(upstream.rstrip("/") + "/v1/models") as resp:
            return Response(await resp.read(), status_code=resp.status, media_type="application/json")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        try:
            yield
        finally:
            await state["session"].close()

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/rollouts/{rid}/attempts/{n}/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


if __name__ == "__main__":
    port, upstream = int(sys.argv[1]), sys.argv[2]
    uvicorn.run(
        create_app(upstream),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )
