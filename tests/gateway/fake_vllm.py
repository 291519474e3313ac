"""A fake vLLM OpenAI server: a real HTTP server reproducing vLLM's request and response fields.

vLLM itself cannot run here (no GPU). The fields follow vLLM >= 0.10.2
(``vllm/entrypoints/openai/chat_completion/protocol.py``, ``completion/protocol.py``,
``models/serving.py``):

- chat: request ``return_token_ids`` → response ``prompt_token_ids`` (top level) and
  ``choices[i].token_ids``; ``logprobs: true`` + ``top_logprobs`` → ``choices[i].logprobs.content[j]``
  = ``{token, logprob, bytes, top_logprobs}``; tool calls parsed from ``<tool_call>`` (hermes parser);
- completions: ``choices[i].prompt_token_ids`` and ``choices[i].token_ids``; ``logprobs: N`` →
  ``choices[i].logprobs.token_logprobs``;
- ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` → 200 text, 400 when the name is taken;
  ``POST /v1/unload_lora_adapter {"lora_name"}``; LoRA names appear in ``/v1/models``;
- errors: ``{"error": {"message", "type", "param", "code"}}``; unknown model → 404; prompt over
  ``max_model_len`` → 400 "This model's maximum context length is N tokens...";
- chat streaming (``stream: true``): SSE chunks, one per generated token, each with
  ``choices[0].token_ids`` (that token) and, with ``logprobs``, its ``logprobs.content`` entry; the
  first chunk carries ``prompt_token_ids`` (with ``return_token_ids``) and ``delta.role``; tool calls
  arrive as deltas (``index``/``id``/``type``/``function.name`` first, then ``function.arguments``
  in pieces) while their tokens' content deltas are empty; ``stream_options.include_usage`` adds a
  usage chunk; ``data: [DONE]`` ends it. ``token_delay_s`` paces the tokens (a slow engine), and
  ``stream_cancelled`` is set when the client goes away mid-stream;
- pause and resume for weight updates (``pause_api="keep"``, the default): ``POST /pause`` with query
  ``mode`` = ``abort`` (vLLM's default: the streams in flight end with ``finish_reason: "abort"``) |
  ``wait`` (the reply waits until the calls in flight finish) | ``keep`` (the streams in flight freeze
  between tokens and go on after the resume), the deprecated ``wait_for_inflight_requests=true``
  (= ``wait``) and ``clear_cache``; an unknown mode → 422 (FastAPI's validation); reply
  ``{"status": "paused"}``. ``POST /resume`` → ``{"status": "resumed"}``, ``GET /is_paused`` →
  ``{"is_paused": bool}``. While paused, new generation requests are accepted and wait until the
  resume (vLLM queues them unscheduled). ``pause_api="legacy"``: the first ``/pause`` (vLLM PR
  #28037), whose only options are ``wait_for_inflight_requests`` and ``clear_cache`` (an unknown
  ``mode`` is ignored, so the default aborts); ``pause_api="none"``: no such routes (404), like a
  vLLM without ``VLLM_SERVER_DEV_MODE=1`` or an older one. ``GET /openapi.json`` lists the routes and
  the ``/pause`` query parameters as FastAPI does (``docs=False``: none, like
  ``--disable-fastapi-docs``). ``control`` records pause, resume, adapter loads and unloads and each
  generation's admission, in order.

Prompts are rendered and tokenised with the real SmolLM2 tokenizer; replies come from a list.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from agl.chat.format import parse_tool_calls
from agl.chat.tokenizer import load_default_tokenizer


class FakeVLLM:
    def __init__(
        self,
        replies: list[str],
        *,
        model: str = "Qwen/Qwen2.5-0.5B-Instruct",
        max_model_len: int = 2048,
        token_delay_s: float = 0.0,
        pause_api: str = "keep",
        docs: bool = True,
        root: str | None = None,
        lora_api: bool = True,
    ) -> None:
        if pause_api not in ("keep", "legacy", "none"):
            raise ValueError(f"pause_api is keep, legacy or none, not {pause_api!r}")
        self.token_delay_s = token_delay_s
        self.pause_api = pause_api
        #: (what, details) in the order the server did it: pause, resume, load/unload, generate
        self.control: list[tuple[str, dict[str, Any]]] = []
        self.paused = False
        self.tokens_while_paused = 0  # stream tokens sent while paused (keep mode: none)
        self.aborted_streams = 0
        self.load_delay_s = 0.0  # a slow adapter load (the pause lasts this long)
        self.fail_loads = 0  # the next N adapter loads are refused (400)
        self.refuse_loras: set[str] = set()  # adapter names whose load is refused (400)
        self.fail_resumes = 0  # the next N resumes answer 500
        self._freeze = False  # keep mode: the streams in flight wait for the resume
        self._abort_epoch = 0  # abort mode: streams begun before the pause end
        self._inflight = 0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.stream_cancelled = threading.Event()
        self.streamed_tokens = 0
        self.replies = list(replies)
        self.model = model
        self.lora_api = lora_api  # False: no runtime LoRA routes (no VLLM_ALLOW_RUNTIME_LORA_UPDATING)
        self.root = root or model  # the served folder /v1/models names (a local one: agl renders)
        self.max_model_len = max_model_len
        self.loras: dict[str, str] = {}
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.fail_next = 0
        self.tok = load_default_tokenizer()
        self._i = 0
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
                *self._lora_routes(),
                *self._pause_routes(docs),
            ]
        )

    @staticmethod
    def error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": message, "type": type_, "param": param, "code": status}}, status_code=status
        )

    async def models(self, request: Request) -> Response:
        data = [
            {
                "id": self.model,
                "object": "model",
                "owned_by": "vllm",
                "root": self.root,
                "max_model_len": self.max_model_len,
            }
        ]
        data += [
            {"id": n, "object": "model", "owned_by": "vllm", "root": p, "parent": self.model}
            for n, p in self.loras.items()
        ]
        return JSONResponse({"object": "list", "data": data})

    def _check(self, body: dict[str, Any]) -> JSONResponse | None:
        if self.fail_next:
            self.fail_next -= 1
            return self.error(500, "EngineCore encountered an issue", "InternalServerError")
        model = body.get("model")
        if model not in (self.model, *self.loras):
            return self.error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return None

    def _reply(self) -> str:
        text = self.replies[self._i % len(self.replies)]
        self._i += 1
        return text

    def _generate(
        self, prompt_ids: list[int], max_tokens: int | None
    ) -> tuple[str, list[int], list[float], str] | JSONResponse:
        if len(prompt_ids) + (max_tokens or 0) > self.max_model_len:
            return self.error(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(prompt_ids) + (max_tokens or 0)} tokens ({len(prompt_ids)} in the messages, {max_tokens or 0} "
                "in the completion). Please reduce the length of the messages or completion.",
                "BadRequestError",
            )
        text = self._reply()
        ids = self.tok.encode(text) + [self.tok.eos_token_id]
        finish = "stop"
        if max_tokens is not None and len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
            text = self.tok.decode(ids)
        logprobs = [-0.05 * (k + 1) for k in range(len(ids))]
        return text, ids, logprobs, finish

    async def chat(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.requests.append(("chat", body))
        if (err := self._check(body)) is not None:
            return err
        await self._admit(body)
        prompt_text, prompt_ids = self.tok.encode_chat(body["messages"], body.get("tools"))
        out = self._generate(prompt_ids, body.get("max_completion_tokens") or body.get("max_tokens"))
        if isinstance(out, Response):
            return out
        text, ids, logprobs, finish = out
        content, calls = parse_tool_calls(text) if body.get("tools") else (text, [])
        if body.get("stream"):
            return StreamingResponse(
                self._chat_stream(body, prompt_ids, ids, logprobs, finish, calls),
                media_type="text/event-stream",
            )
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "reasoning": None,
        }
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
            finish = "tool_calls"
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {
                        "token": self.tok.decode([t]),
                        "logprob": lp,
                        "bytes": list(self.tok.decode([t]).encode()),
                        "top_logprobs": [],
                    }
                    for t, lp in zip(ids, logprobs, strict=True)
                ]
            }
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
        resp: dict[str, Any] = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt_ids) + len(ids),
            },
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }
        if body.get("return_token_ids"):
            resp["prompt_token_ids"] = prompt_ids
        return JSONResponse(resp)

    async def _chat_stream(
        self,
        body: dict[str, Any],
        prompt_ids: list[int],
        ids: list[int],
        logprobs: list[float],
        finish: str,
        calls: list[Any],
    ) -> AsyncIterator[bytes]:
        head = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": body["model"],
        }
        want_ids = bool(body.get("return_token_ids"))
        arg_pieces: list[tuple[int, dict[str, Any]]] = []  # (call, delta)
        for k, call in enumerate(calls):
            arg_pieces.append(
                (
                    k,
                    {
                        "index": k,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    },
                )
            )
            args = call.arguments
            third = max(1, len(args) // 3)
            for start in range(0, len(args), third):
                arg_pieces.append((k, {"index": k, "function": {"arguments": args[start : start + third]}}))

        def sse(obj: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        epoch = self._abort_epoch
        self._inflight += 1
        self._idle.clear()
        try:
            first: dict[str, Any] = {
                **head,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            if want_ids:
                first["prompt_token_ids"] = prompt_ids
                first["choices"][0]["token_ids"] = []
            yield sse(first)
            for k, (tid, lp) in enumerate(zip(ids, logprobs, strict=True)):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                if await self._aborted(epoch):  # paused with mode=abort: end the stream as vLLM does
                    yield sse({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]})
                    yield b"data: [DONE]\n\n"
                    return
                last = k == len(ids) - 1
                delta: dict[str, Any] = {}
                if calls:  # the call's pieces ride on the reply's last tokens, the rest at the end
                    j = k - (len(ids) - len(arg_pieces))
                    pieces = arg_pieces[max(j, 0) :] if last else ([arg_pieces[j]] if j >= 0 else [])
                    if pieces:
                        delta = {"tool_calls": [p for _, p in pieces]}
                elif tid != self.tok.eos_token_id:
                    delta = {"content": self.tok.decode(ids[: k + 1])[len(self.tok.decode(ids[:k])) :]}
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": ("tool_calls" if calls else finish) if last else None,
                }
                if body.get("logprobs"):
                    t = self.tok.decode([tid])
                    choice["logprobs"] = {
                        "content": [
                            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        ]
                    }
                if want_ids:
                    choice["token_ids"] = [tid]
                self.streamed_tokens += 1
                yield sse({**head, "choices": [choice]})
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": len(ids),
                    "total_tokens": len(prompt_ids) + len(ids),
                }
                yield sse({**head, "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            self.stream_cancelled.set()
            raise
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    async def completions(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.requests.append(("completions", body))
        if (err := self._check(body)) is not None:
            return err
        await self._admit(body)
        prompt = body["prompt"]  # a text, or token ids (vLLM takes them as they are)
        prompt_ids = list(prompt) if isinstance(prompt, list) else self.tok.encode(prompt)
        out = self._generate(prompt_ids, body.get("max_tokens", 16))
        if isinstance(out, Response):
            return out
        text, ids, logprobs, finish = out
        if body.get("stream"):
            return StreamingResponse(
                self._completion_stream(body, prompt_ids, ids, logprobs, finish),
                media_type="text/event-stream",
            )
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
        if body.get("logprobs") is not None:
            choice["logprobs"] = {
                "text_offset": [],
                "token_logprobs": logprobs,
                "tokens": [self.tok.decode([t]) for t in ids],
                "top_logprobs": [],
            }
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
            choice["prompt_token_ids"] = prompt_ids
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt_ids) + len(ids),
        }
        return JSONResponse(
            {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": 0,
                "model": body["model"],
                "choices": [choice],
                "usage": usage,
            }
        )

    async def _completion_stream(
        self, body: dict[str, Any], prompt_ids: list[int], ids: list[int], logprobs: list[float], finish: str
    ) -> AsyncIterator[bytes]:
        """vLLM's completion stream: one chunk per token (its ``token_ids``, text, log-prob), the first
        with ``prompt_token_ids``, the last with ``finish_reason``."""
        head = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": body["model"]}
        epoch = self._abort_epoch
        self._inflight += 1
        self._idle.clear()
        try:
            for k, (tid, lp) in enumerate(zip(ids, logprobs, strict=True)):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                if await self._aborted(epoch):
                    yield _sse({**head, "choices": [{"index": 0, "text": "", "finish_reason": "abort"}]})
                    break
                choice: dict[str, Any] = {
                    "index": 0,
                    "text": "" if tid == self.tok.eos_token_id else self.tok.decode([tid]),
                    "logprobs": {"token_logprobs": [lp]} if body.get("logprobs") is not None else None,
                    "finish_reason": finish if k == len(ids) - 1 else None,
                    "stop_reason": None,
                }
                if body.get("return_token_ids"):
                    choice["token_ids"] = [tid]
                    if k == 0:
                        choice["prompt_token_ids"] = prompt_ids
                self.streamed_tokens += 1
                yield _sse({**head, "choices": [choice]})
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            self.stream_cancelled.set()
            raise
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    async def load_lora(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.requests.append(("load_lora_adapter", body))
        self.control.append(
            ("load_lora_adapter", {"lora_name": body.get("lora_name"), "paused": self.paused})
        )
        if self.load_delay_s:
            await asyncio.sleep(self.load_delay_s)
        if self.fail_loads or body.get("lora_name") in self.refuse_loras:
            self.fail_loads = max(0, self.fail_loads - 1)
            return self.error(
                400,
                f"Loading lora {body.get('lora_name')} failed: No adapter found for {body.get('lora_path')}",
                "BadRequestError",
            )
        if not body.get("lora_name") or not body.get("lora_path"):
            return self.error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if body["lora_name"] in self.loras and not body.get("load_inplace"):
            return self.error(
                400, f"The lora adapter '{body['lora_name']}' has already been loaded.", "InvalidUserInput"
            )
        self.loras[body["lora_name"]] = body["lora_path"]
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def unload_lora(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.requests.append(("unload_lora_adapter", body))
        self.control.append(
            ("unload_lora_adapter", {"lora_name": body.get("lora_name"), "paused": self.paused})
        )
        if body.get("lora_name") not in self.loras:
            return self.error(
                404, f"The lora adapter '{body.get('lora_name')}' cannot be found.", "NotFoundError"
            )
        del self.loras[body["lora_name"]]
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    # -- pause and resume (vllm/entrypoints/serve/rlhf/api_router.py, VLLM_SERVER_DEV_MODE=1) --

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": "0.32.0-fake"})

    def _lora_routes(self) -> list[Route]:
        if not self.lora_api:
            return []
        return [
            Route("/v1/load_lora_adapter", self.load_lora, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_lora, methods=["POST"]),
        ]

    def _pause_routes(self, docs: bool) -> list[Route]:
        routes = [Route("/openapi.json", self.openapi, methods=["GET"])] if docs else []
        if self.pause_api != "none":
            routes += [
                Route("/pause", self.pause, methods=["POST"]),
                Route("/resume", self.resume, methods=["POST"]),
                Route("/is_paused", self.is_paused, methods=["GET"]),
            ]
        return routes

    async def _admit(self, body: dict[str, Any]) -> None:
        """A generation request waits while the server is paused (vLLM queues it unscheduled)."""
        await self._resumed.wait()
        self.control.append(("generate", {"model": body.get("model")}))

    async def _aborted(self, epoch: int) -> bool:
        """Before each streamed token: frozen while paused with mode=keep; True once a pause with
        mode=abort came after the stream began (``epoch``)."""
        if self._freeze:
            await self._resumed.wait()
        if epoch != self._abort_epoch:
            self.aborted_streams += 1
            return True
        if self.paused:
            self.tokens_while_paused += 1
        return False

    def _pause_mode(self, request: Request) -> str | JSONResponse:
        query = request.query_params
        wait = query.get("wait_for_inflight_requests", "false").lower() in ("1", "true", "yes", "on")
        if self.pause_api == "legacy":  # no mode parameter: an unknown one is ignored
            return "wait" if wait else "abort"
        mode = query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            detail = [
                {
                    "type": "literal_error",
                    "loc": ["query", "mode"],
                    "msg": "Input should be 'abort', 'wait' or 'keep'",
                    "input": mode,
                }
            ]
            return JSONResponse({"detail": detail}, status_code=422)
        return "wait" if wait else mode

    async def pause(self, request: Request) -> Response:
        mode = self._pause_mode(request)
        if isinstance(mode, Response):
            return mode
        self.control.append(("pause", {"mode": mode, **dict(request.query_params)}))
        self.paused = True
        self._resumed.clear()
        if mode == "keep":
            self._freeze = True
        elif mode == "abort":
            self._abort_epoch += 1
        else:
            await self._idle.wait()
        return JSONResponse({"status": "paused"})

    async def resume(self, request: Request) -> Response:
        self.control.append(("resume", {}))
        if self.fail_resumes:
            self.fail_resumes -= 1
            return JSONResponse({"error": "Failed to resume generation: engine busy"}, status_code=500)
        self.paused = False
        self._freeze = False
        self._resumed.set()
        return JSONResponse({"status": "resumed"})

    async def is_paused(self, request: Request) -> Response:
        return JSONResponse({"is_paused": self.paused})

    async def openapi(self, request: Request) -> Response:
        """The part of FastAPI's schema a client reads: the paths, and the query parameters of /pause."""
        paths: dict[str, Any] = {
            "/v1/models": {"get": {"summary": "Show Available Models"}},
            "/v1/chat/completions": {"post": {"summary": "Create Chat Completion"}},
            "/v1/completions": {"post": {"summary": "Create Completion"}},
        }
        if self.lora_api:
            paths["/v1/load_lora_adapter"] = {"post": {"summary": "Load Lora Adapter"}}
            paths["/v1/unload_lora_adapter"] = {"post": {"summary": "Unload Lora Adapter"}}
        if self.pause_api != "none":
            names = ["wait_for_inflight_requests", "clear_cache"]
            if self.pause_api == "keep":
                names.insert(0, "mode")
            params = [{"name": n, "in": "query", "required": False, "schema": {}} for n in names]
            paths["/pause"] = {"post": {"summary": "Pause Generation", "parameters": params}}
            paths["/resume"] = {"post": {"summary": "Resume Generation"}}
            paths["/is_paused"] = {"get": {"summary": "Is Paused"}}
        return JSONResponse(
            {"openapi": "3.1.0", "info": {"title": "FastAPI", "version": "0.1.0"}, "paths": paths}
        )


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
