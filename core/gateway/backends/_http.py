"""What the vllm and openai backends share: an OpenAI-compatible upstream over HTTP (aiohttp).

Both send chat requests to ``/v1/chat/completions`` (Responses-API calls arrive here already
converted to chat messages) and raw completions to ``/v1/completions``. ``forward`` makes one
non-streaming call; ``stream_chat`` streams from the upstream and yields each chunk as it arrives
(content and tool-call deltas, per-chunk token ids and logprobs) while assembling the same
:class:`GenerationResult` a non-streaming call returns. Upstream 4xx answers keep their status (bad
input stays bad input, an unknown model stays 404); connection failures and 5xx become backend
errors (502).

The client is aiohttp: against a local upstream it spent ~0.3 ms of CPU per request where httpx
spent 1.7-2.8 ms (connection-pool bookkeeping that grows with concurrency), measured by
``bench/gateway.py``. Closing a streamed response closes its connection, which is how vLLM learns
that the client went away and aborts the generation.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from agl.chat.format import new_tool_call_id
from agl.gateway.backends.base import (
    Backend,
    BackendError,
    Choice,
    GenerationRequest,
    GenerationResult,
    ToolCall,
    UpstreamError,
)

try:  # orjson is several times faster where installed; the stdlib reads and writes the same JSON
    import orjson

    _dumps = orjson.dumps
    _loads = orjson.loads
except ImportError:  # pragma: no cover

    def _dumps(obj: Any) -> bytes:  # type: ignore[misc]
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()

    _loads = json.loads

__all__ = ["HttpUpstreamBackend"]

#: fields the gateway handles itself and never forwards
_LOCAL_FIELDS = ("stream", "stream_options", "return_token_ids")
_JSON = {"Content-Type": "application/json"}
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def _error_message(status: int, raw: bytes) -> tuple[str, dict[str, Any] | None]:
    try:
        body = _loads(raw)
    except ValueError:
        return raw[:500].decode(errors="replace") or f"HTTP {status}", None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"]), body
        if isinstance(body.get("message"), str):  # older vLLM: {"object": "error", "message": ...}
            return body["message"], body
        if isinstance(err, str):
            return err, body
    return json.dumps(body)[:500], None


class HttpUpstreamBackend(Backend):
    """Base for backends that forward to an OpenAI-compatible server at ``base_url`` (its ``/v1`` URL)."""

    #: seconds an idle pooled connection is kept: shorter than the upstream's own keep-alive, or a
    #: request may go out on a connection the server is closing and fail with "Server disconnected"
    keepalive_s: float = 60.0

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        super().__init__()
        url = base_url.rstrip("/")
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self.root_url = self.base_url[: -len("/v1")]
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """One pooled keep-alive session, made on first use inside the serving event loop."""
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s),
                auto_decompress=True,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _unreachable(self, url: str, exc: BaseException) -> BackendError:
        what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return BackendError(f"{self.name} upstream {url} unreachable: {what}")

    async def request(self, method: str, url: str, body: Any = None) -> tuple[int, bytes]:
        """(status, body bytes) of one control call; transport failures become BackendError. A pooled
        connection the server closed while idle ("Server disconnected" before any answer) is retried
        once on a fresh one: the server never saw that request."""
        for attempt in (1, 2):
            try:
                async with self.session.request(
                    method, url, data=None if body is None else _dumps(body), headers=_JSON
                ) as resp:
                    return resp.status, await resp.read()
            except aiohttp.ServerDisconnectedError as exc:
                if attempt == 2:
                    raise self._unreachable(url, exc) from exc
            except _TRANSPORT_ERRORS as exc:
                raise self._unreachable(url, exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _refused(self, status: int, raw: bytes) -> BackendError:
        message, payload = _error_message(status, raw)
        if status < 500:
            return UpstreamError(status, f"upstream: {message}", payload)
        return BackendError(f"{self.name} upstream answered {status}: {message}")

    async def _post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        status, raw = await self.request("POST", url, body)
        if status >= 400:
            raise self._refused(status, raw)
        try:
            data = _loads(raw)
        except ValueError as exc:
            raise BackendError(f"{self.name} upstream sent a body that is not JSON") from exc
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list) or not data["choices"]:
            raise BackendError(f"{self.name} upstream sent no choices")
        return data

    async def _get_models(self) -> list[str]:
        """The upstream's model ids; BackendError saying what it answered when it lists none."""
        url = self.base_url + "/models"
        status, raw = await self.request("GET", url)
        if status >= 400:
            message, _ = _error_message(status, raw)
            raise BackendError(f"{url} answered {status}: {message}")
        try:
            data = _loads(raw)
            items = data.get("data") if isinstance(data, dict) else None
        except ValueError:
            items = None
        if not isinstance(items, list):
            raise BackendError(f"{url} answers but its body is not a model list: {raw[:200]!r}")
        return [m["id"] for m in items if isinstance(m, dict) and isinstance(m.get("id"), str)]

    # ------------------------------------------------------------------------ request bodies
    def chat_body(self, request: GenerationRequest, model: str) -> dict[str, Any]:
        if request.api == "chat":
            body = {k: v for k, v in request.raw.items() if k not in _LOCAL_FIELDS}
        else:
            body = {"messages": request.messages}
            if request.tools:
                body["tools"] = request.tools
            for key, value in (
                ("tool_choice", request.tool_choice),
                ("parallel_tool_calls", request.parallel_tool_calls),
                ("response_format", request.response_format),
                ("temperature", request.temperature),
                ("top_p", request.top_p),
                ("max_tokens", request.max_tokens),
                ("seed", request.seed),
                ("stop", request.stop or None),
            ):
                if value is not None:
                    body[key] = value
            if request.api == "messages" and isinstance(request.raw.get("top_k"), int):
                body["top_k"] = request.raw["top_k"]  # vLLM takes it as an extra field
        body["model"] = model
        body["stream"] = False
        return body

    def completion_body(self, request: GenerationRequest, model: str) -> dict[str, Any]:
        body = {k: v for k, v in request.raw.items() if k not in _LOCAL_FIELDS}
        body["model"] = model
        body["stream"] = False
        return body

    # ------------------------------------------------------------------------------ parsing
    @staticmethod
    def parse_chat_choice(raw: dict[str, Any]) -> Choice:
        msg = raw.get("message") or {}
        calls = []
        for tc in msg.get("tool_calls") or ():
            fn = tc.get("function") or {}
            args = fn.get("arguments")
            calls.append(
                ToolCall(
                    name=fn.get("name", ""),
                    arguments=args if isinstance(args, str) else json.dumps(args or {}),
                    id=tc.get("id") or new_tool_call_id(),
                )
            )
        content = msg.get("content")
        ids = raw.get("token_ids")
        logprobs = None
        lp = raw.get("logprobs")
        if isinstance(lp, dict) and isinstance(lp.get("content"), list):
            logprobs = [float(x.get("logprob", 0.0)) for x in lp["content"]]
        return Choice(
            text=content or "",
            content=content,
            tool_calls=calls,
            response_ids=list(ids) if isinstance(ids, list) else None,
            logprobs=logprobs,
            finish_reason=raw.get("finish_reason") or "stop",
        )

    @staticmethod
    def parse_completion_choice(raw: dict[str, Any]) -> Choice:
        text = raw.get("text") or ""
        ids = raw.get("token_ids")
        logprobs = None
        lp = raw.get("logprobs")
        if isinstance(lp, dict) and isinstance(lp.get("token_logprobs"), list):
            logprobs = [float(x) if x is not None else 0.0 for x in lp["token_logprobs"]]
        return Choice(
            text=text,
            content=text,
            response_ids=list(ids) if isinstance(ids, list) else None,
            logprobs=logprobs,
            finish_reason=raw.get("finish_reason") or "stop",
        )

    async def forward(self, request: GenerationRequest, model: str) -> GenerationResult:
        if request.api == "completions":
            data = await self._post(self.base_url + "/completions", self.completion_body(request, model))
            choices = [self.parse_completion_choice(c) for c in data["choices"]]
            first = data["choices"][0]
            prompt_ids = first.get("prompt_token_ids")
        else:
            data = await self._post(self.base_url + "/chat/completions", self.chat_body(request, model))
            choices = [self.parse_chat_choice(c) for c in data["choices"]]
            prompt_ids = data.get("prompt_token_ids")
        usage = data.get("usage") or {}
        exact = isinstance(prompt_ids, list) and all(c.response_ids is not None for c in choices)
        if exact:
            for c in choices:
                if c.logprobs is not None and len(c.logprobs) != len(c.response_ids or ()):
                    c.logprobs = None
        else:
            prompt_ids = None
            for c in choices:
                c.response_ids = c.logprobs = None
        return GenerationResult(
            model=request.model,
            choices=choices,
            prompt_ids=list(prompt_ids) if prompt_ids is not None else None,
            prompt_tokens=usage.get("prompt_tokens", len(prompt_ids) if prompt_ids else None),
            weight_version=self.weight_version,
            exact=exact,
            raw=data,
            reported_completion_tokens=None if exact else usage.get("completion_tokens"),
        )

    # ---------------------------------------------------------------------------- streaming
    async def sse(self, url: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST ``body`` and yield each server-sent JSON chunk until ``[DONE]``. Refusals raise as in
        :meth:`forward`, an error chunk or a broken stream as BackendError; cancelling closes the
        connection (vLLM then aborts the generation)."""
        try:
            async with self.session.post(url, data=_dumps(body), headers=_JSON) as resp:
                if resp.status >= 400:
                    raise self._refused(resp.status, await resp.read())
                if not resp.content_type.startswith("text/event-stream"):
                    raise BackendError(
                        f"{self.name} upstream answered a stream request with {resp.content_type}"
                    )
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        return
                    chunk = _loads(payload)
                    if isinstance(chunk, dict) and chunk.get("error") is not None:
                        err = chunk["error"]
                        msg = err.get("message") if isinstance(err, dict) else err
                        raise BackendError(f"{self.name} upstream failed mid-stream: {msg}")
                    if isinstance(chunk, dict):
                        yield chunk
                raise BackendError(f"{self.name} upstream ended the stream without [DONE]")
        except _TRANSPORT_ERRORS as exc:
            raise self._unreachable(url, exc) from exc
        except ValueError as exc:
            raise BackendError(f"{self.name} upstream sent a chunk that is not JSON: {exc}") from exc

    async def stream_chat(self, request: GenerationRequest, model: str) -> AsyncIterator[dict[str, Any]]:
        """Stream a chat completion from the upstream; yields the gateway's stream events.

        ``{"type": "start", "prompt_ids"}`` once the upstream accepted the request (before its first
        chunk); ``{"type": "delta", "index", "delta", "token_ids", "logprobs", "finish_reason"}`` per
        upstream chunk (``delta`` is the OpenAI delta: content / tool-call pieces; ``logprobs`` the
        OpenAI per-token entries); ``{"type": "end", "result"}`` with the assembled result, exactly
        what :meth:`forward` returns for the same reply. Refusals before the stream starts raise like
        :meth:`forward`; a stream that breaks raises BackendError. Cancelling closes the connection.
        """
        body = self.chat_body(request, model)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        url = self.base_url + "/chat/completions"
        acc = _StreamAssembler()
        try:
            async with self.session.post(url, data=_dumps(body), headers=_JSON) as resp:
                if resp.status >= 400:
                    raise self._refused(resp.status, await resp.read())
                if not resp.content_type.startswith("text/event-stream"):  # a server that ignored stream
                    data = _loads(await resp.read())
                    acc.prompt_ids = data.get("prompt_token_ids")
                    yield {"type": "start", "prompt_ids": acc.prompt_ids}
                    for delta in _deltas_of_body(data):
                        acc.add(delta)
                        yield delta
                    acc.usage = data.get("usage")
                else:
                    started = False
                    async for line in resp.content:
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            break
                        chunk = _loads(payload)
                        if isinstance(chunk, dict) and chunk.get("error") is not None:
                            err = chunk["error"]
                            msg = err.get("message") if isinstance(err, dict) else err
                            raise BackendError(f"{self.name} upstream failed mid-stream: {msg}")
                        if acc.prompt_ids is None and chunk.get("prompt_token_ids") is not None:
                            acc.prompt_ids = chunk["prompt_token_ids"]
                        if not started:
                            started = True
                            yield {"type": "start", "prompt_ids": acc.prompt_ids}
                        if chunk.get("usage"):
                            acc.usage = chunk["usage"]
                        for c in chunk.get("choices") or ():
                            delta = {
                                "type": "delta",
                                "index": c.get("index", 0),
                                "delta": c.get("delta") or {},
                                "token_ids": c.get("token_ids"),
                                "logprobs": (c.get("logprobs") or {}).get("content"),
                                "finish_reason": c.get("finish_reason"),
                            }
                            acc.add(delta)
                            yield delta
                    if not started:
                        raise BackendError(f"{self.name} upstream ended the stream without a chunk")
        except _TRANSPORT_ERRORS as exc:
            raise self._unreachable(url, exc) from exc
        except ValueError as exc:
            raise BackendError(f"{self.name} upstream sent a chunk that is not JSON: {exc}") from exc
        yield {"type": "end", "result": acc.result(request.model, self.weight_version)}


def _deltas_of_body(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole (non-streamed) chat completion as stream deltas: one per choice."""
    out = []
    for c in data.get("choices") or ():
        msg = dict(c.get("message") or {})
        delta = {"role": "assistant", "content": msg.get("content")}
        if msg.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(msg["tool_calls"])]
        out.append(
            {
                "type": "delta",
                "index": c.get("index", 0),
                "delta": delta,
                "token_ids": c.get("token_ids"),
                "logprobs": (c.get("logprobs") or {}).get("content"),
                "finish_reason": c.get("finish_reason"),
            }
        )
    return out


class _StreamAssembler:
    """Collects a streamed reply into the choices a non-streamed call would have returned."""

    def __init__(self) -> None:
        self.prompt_ids: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self.choices: dict[int, dict[str, Any]] = {}

    def add(self, event: dict[str, Any]) -> None:
        c = self.choices.setdefault(
            event["index"],
            {
                "content": [],
                "calls": {},
                "ids": [],
                "no_ids": False,
                "lps": [],
                "no_lps": False,
                "finish": None,
            },
        )
        delta = event["delta"]
        if delta.get("content"):
            c["content"].append(delta["content"])
        for tc in delta.get("tool_calls") or ():
            slot = c["calls"].setdefault(
                tc.get("index", len(c["calls"])), {"id": None, "name": "", "args": []}
            )
            if tc.get("id"):
                slot["id"] = tc["id"]
            fn = tc.get("function") or {}
            if fn.get("name"):
                slot["name"] += fn["name"]
            args = fn.get("arguments")
            if args:
                slot["args"].append(args if isinstance(args, str) else json.dumps(args))
        ids = event.get("token_ids")
        if isinstance(ids, list):
            c["ids"].extend(ids)
        elif ids is None and (delta.get("content") or delta.get("tool_calls")):
            c["no_ids"] = True
        lps = event.get("logprobs")
        if isinstance(lps, list):
            c["lps"].extend(float(x.get("logprob", 0.0)) for x in lps)
        if event.get("finish_reason"):
            c["finish"] = event["finish_reason"]

    def result(self, model: str, weight_version: int) -> GenerationResult:
        choices = []
        exact = isinstance(self.prompt_ids, list) and bool(self.choices)
        for _, c in sorted(self.choices.items()):
            content = "".join(c["content"])
            calls = [
                ToolCall(name=s["name"], arguments="".join(s["args"]), id=s["id"] or new_tool_call_id())
                for _, s in sorted(c["calls"].items())
            ]
            has_ids = not c["no_ids"] and bool(c["ids"])
            exact = exact and has_ids
            choices.append(
                Choice(
                    text=content,
                    content=content if content or not calls else None,
                    tool_calls=calls,
                    response_ids=list(c["ids"]) if has_ids else None,
                    logprobs=list(c["lps"]) if len(c["lps"]) == len(c["ids"]) and has_ids else None,
                    finish_reason=c["finish"] or "stop",
                )
            )
        if not choices:
            raise BackendError("the upstream stream carried no choice")
        usage = self.usage or {}
        if not exact:
            for ch in choices:
                ch.response_ids = ch.logprobs = None
        return GenerationResult(
            model=model,
            choices=choices,
            prompt_ids=list(self.prompt_ids) if exact and self.prompt_ids is not None else None,
            prompt_tokens=usage.get(
                "prompt_tokens", len(self.prompt_ids) if exact and self.prompt_ids else None
            ),
            weight_version=weight_version,
            exact=exact,
            raw={"usage": usage} if usage else None,
            reported_completion_tokens=None if exact else usage.get("completion_tokens"),
        )
