"""What the vllm and openai backends share: an OpenAI-compatible upstream over HTTP (httpx).

Both send chat requests to ``/v1/chat/completions`` (Responses-API calls arrive here already
converted to chat messages) and raw completions to ``/v1/completions``, without streaming: the
gateway streams the finished reply itself. Upstream 4xx answers keep their status (bad input stays
bad input, an unknown model stays 404); connection failures and 5xx become backend errors (502).
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from agl.gateway.backends.base import (
    Backend,
    BackendError,
    Choice,
    GenerationRequest,
    GenerationResult,
    ToolCall,
    UpstreamError,
)
from agl.gateway.chat_format import new_tool_call_id

__all__ = ["HttpUpstreamBackend"]

#: fields the gateway handles itself and never forwards
_LOCAL_FIELDS = ("stream", "stream_options", "return_token_ids")


def _error_message(resp: httpx.Response) -> tuple[str, dict[str, Any] | None]:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason_phrase, None
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

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        super().__init__()
        url = base_url.rstrip("/")
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self.root_url = self.base_url[: -len("/v1")]
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(timeout=self.timeout_s, headers=headers)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = await self.client.post(url, json=body)
        except httpx.HTTPError as exc:
            raise BackendError(
                f"{self.name} upstream {url} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
        if resp.status_code >= 400:
            message, payload = _error_message(resp)
            if resp.status_code < 500:
                raise UpstreamError(resp.status_code, f"upstream: {message}", payload)
            raise BackendError(f"{self.name} upstream answered {resp.status_code}: {message}")
        try:
            data = resp.json()
        except ValueError as exc:
            raise BackendError(f"{self.name} upstream sent a body that is not JSON") from exc
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list) or not data["choices"]:
            raise BackendError(f"{self.name} upstream sent no choices")
        return data

    async def _get_models(self) -> list[str]:
        try:
            resp = await self.client.get(self.base_url + "/models")
            resp.raise_for_status()
            return [m["id"] for m in resp.json().get("data", []) if isinstance(m, dict) and "id" in m]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise BackendError(f"cannot list the models of {self.base_url}: {exc}") from exc

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
            ):
                if value is not None:
                    body[key] = value
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
