"""The gateway's ASGI app: OpenAI-compatible routes in front of one backend, a span per call.

Routes (each also under ``/rollouts/{rollout_id}/attempts/{n}/v1/...``, the per-rollout base URL):
``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``, ``GET /v1/models``, and
the Anthropic Messages API: ``POST /v1/messages``, ``POST /v1/messages/count_tokens`` (key as
``Authorization: Bearer`` or ``x-api-key``).
Outside a per-rollout path the rollout comes from the W3C ``baggage`` header (``agl.rollout.id``,
``agl.attempt``). Admin: ``GET /agl/v1/status``, ``POST /agl/v1/weights`` ``{"path", "version"}``,
``POST /agl/v1/adapters`` ``{"path", "name", "version"}`` (weight swaps between requests).

Streaming: backends with ``streams`` (vllm, openai) stream chat completions for real — each upstream
chunk is forwarded as it arrives (content and tool-call deltas; token ids and logprobs when the client
asks), while the backend collects ids and logprobs for the span, which is recorded when the stream
ends. Other backends' replies (and the completions / Responses routes) are streamed after generation
finishes as real SSE chunks. A client that disconnects cancels the generation and leaves an ERROR
span. Spans are stored in batches (:mod:`agl.gateway.span_writer`) before the reply is sent
(``span_writes="before_reply"``, the default: a runner finishes its attempt as soon as the agent
returns, and training reads the finished attempt's spans, so the last call's span must be there) or
just after it (``span_writes="after_reply"``; ``POST /agl/v1/flush`` waits, shutdown drains them).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from agl import semconv as sc
from agl.chat.format import content_chars
from agl.gateway import anthropic, sse
from agl.gateway.backends.base import (
    Backend,
    BackendError,
    ContextWindowError,
    GenerationRequest,
    GenerationResult,
    UnknownModelError,
    UpstreamError,
)
from agl.gateway.disconnect import ClientGone, cancel_on_disconnect
from agl.gateway.model_names import ModelNames, Served
from agl.gateway.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    chat_completion_body,
    completion_body,
    new_id,
    parse_request,
    responses_body,
    responses_to_generation,
)
from agl.gateway.replay import Replays
from agl.gateway.sampling import SamplingLimits
from agl.gateway.seeds import CallSeeds
from agl.gateway.spans import CallRecord, CallRecorder, SpanWriter, parse_trace_headers
from agl.names import display_name

__all__ = ["Gateway", "create_app"]

log = logging.getLogger("agl.gateway")
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}$")


def _error(exc: ApiError) -> Response:
    return Response(sse.dumps(exc.body()), status_code=exc.status, media_type="application/json")


class Gateway:
    """Serves the policy ``backend`` (and the backends ``serve`` maps names to); records a server-side
    ``chat`` span per call into ``store`` (optional).

    Model names (:mod:`agl.gateway.model_names`): any name a program asks for is served by the policy,
    unless ``only_model_names`` (then only the backends' names, ``model_names`` and the ``serve`` names
    are); ``serve`` maps names to other backends or to the policy's adapters. ``sampling``
    (:class:`~agl.gateway.sampling.SamplingLimits`): the ``max_tokens`` default and cap and the
    ``temperature`` default every request gets.

    ``stats`` counts calls, unattributed calls (no rollout: served, span not stored), cancelled
    calls, backend errors and span writes.
    """

    def __init__(
        self,
        backend: Backend,
        store: Any = None,
        *,
        api_key: str | None = None,
        max_body_bytes: int = 32 * 1024 * 1024,
        span_writes: str = "before_reply",
        model_names: Iterable[str] = (),
        only_model_names: bool = False,
        serve: Mapping[str, Backend | str] | None = None,
        sampling: SamplingLimits | None = None,
    ) -> None:
        if span_writes not in ("after_reply", "before_reply"):
            raise ValueError(f"span_writes must be 'after_reply' or 'before_reply', got {span_writes!r}")
        if sampling is not None and not isinstance(sampling, SamplingLimits):
            raise TypeError(f"sampling must be an agl.gateway.sampling.SamplingLimits, got {sampling!r}")
        self.span_writes = span_writes
        self.backend = backend
        self.names = ModelNames(backend, names=model_names, serve=serve, only=only_model_names)
        self.sampling = sampling or SamplingLimits()
        self.store = store
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.stats: dict[str, int] = defaultdict(int)
        self.writer = SpanWriter(store, self.stats) if store is not None else None
        #: counts each call and records its span(s), streamed or not (agl.gateway.spans)
        self.recorder = CallRecorder(
            self.writer, self.stats, span_writes=span_writes, policy=backend, backends=self.names.backends
        )
        self.drift = self.recorder.drift  # the policy's drift tracker
        #: each call of a seeded rollout gets a seed from the rollout's and its place (agl.gateway.seeds)
        self.seeds = CallSeeds(store)
        #: a branch rollout's calls before its branch call are answered from its parent's record
        self.replays = Replays(store)
        self._swap_lock = asyncio.Lock()
        #: why the app's startup failed (a backend that would not start, a --serve target that names
        #: no adapter), for the one who started it: uvicorn itself reports only that it failed
        self.startup_error: BaseException | None = None

    # ------------------------------------------------------------------------------ plumbing
    def _auth(self, request: Request) -> None:
        if self.api_key is not None:
            auth = request.headers.get("authorization", "")
            key = request.headers.get("x-api-key")  # the Anthropic SDK's header
            if key is not None and not auth:
                auth = f"Bearer {key}"
            if not hmac.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode()):
                raise ApiError(
                    401,
                    "missing or wrong API key (Authorization: Bearer ...)",
                    type="authentication_error",
                    code="invalid_api_key",
                )

    def body_limit(self) -> int:
        """The largest request body read: ``max_body_bytes``, lowered to what a prompt that fits the
        backend's context window can take (12 bytes per content character, the longest JSON escape,
        plus 1 MiB for everything else), so a huge body is refused before it is even parsed."""
        limits = [b.max_prompt_chars() for b in self.names.backends]
        if any(chars is None for chars in limits):
            return self.max_body_bytes
        return min(self.max_body_bytes, 12 * max(limits) + (1 << 20))  # type: ignore[type-var]

    async def _number(self, gen: GenerationRequest) -> None:
        """Index and seed (agl.gateway.seeds); replayed or branch call (agl.gateway.replay)."""
        await self.seeds.assign(gen)
        await self.replays.prepare(gen)

    def _streams(self, gen: GenerationRequest) -> bool:  # a replayed call has nothing to stream
        return self._backend(gen).streams and gen.replay is None

    def _backend(self, gen: GenerationRequest) -> Backend:
        """The backend that serves ``gen`` (chosen by :meth:`_route`)."""
        return gen.served_by or self.backend

    def _admit(self, gen: GenerationRequest) -> Backend:
        """The backend that serves ``gen``, once it knows the model and the prompt can fit its context
        window; checked before a call is counted or recorded, streamed or not (a refusal here is a
        plain 4xx, no span). The size is checked before anything is rendered or tokenised
        (tokenising megabytes takes seconds of CPU)."""
        backend = self._backend(gen)
        try:
            backend.check_model(gen.model)
        except UnknownModelError as exc:
            raise ApiError(404, str(exc), param="model", code="model_not_found") from None
        limit = backend.max_prompt_chars()
        if limit is None:
            return backend
        chars = content_chars(gen.messages, gen.prompt)
        if chars > limit:
            what = "messages" if gen.messages is not None else "prompt"
            raise ApiError(
                400,
                f"the {what} hold {chars} characters: more than this model's context window can take "
                f"(at most {limit} characters); shorten the {what}",
                param=what,
                code="context_length_exceeded",
            )
        return backend

    async def _body(self, request: Request) -> Any:
        self._auth(request)
        limit = self.body_limit()
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        try:
            raw = await request.body()
        except ClientDisconnect:
            raise ClientGone("the client went away while sending the body") from None
        if len(raw) > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        try:
            return sse.loads(raw)
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None

    def _context(self, request: Request) -> tuple[tuple[str, int] | None, str | None, str | None]:
        """(rollout, trace id, parent span id) of a call."""
        headers = request.headers
        trace_id, parent_id, bag = parse_trace_headers(
            headers.get(sc.HEADER_TRACEPARENT), headers.get(sc.HEADER_BAGGAGE)
        )
        request.state.agl_agent = display_name(bag.get(sc.BAGGAGE_AGENT))  # for _route: parsed once
        params = request.path_params
        if "rollout_id" in params:
            rid, attempt = params["rollout_id"], params["attempt"]
            if not _ID_RE.match(rid):
                raise ApiError(400, f"invalid rollout id {rid!r} in the URL path", param="rollout_id")
            if attempt < 1:
                raise ApiError(
                    400, f"invalid attempt {attempt} in the URL path: attempts start at 1", param="attempt"
                )
            return (rid, attempt), trace_id, parent_id
        rid = bag.get(sc.BAGGAGE_ROLLOUT_ID)
        if rid is None:
            return None, trace_id, parent_id
        raw_attempt = bag.get(sc.BAGGAGE_ATTEMPT)
        if not _ID_RE.match(rid):
            raise ApiError(400, f"invalid rollout id {rid!r} in the baggage header", param="baggage")
        if raw_attempt is None or not raw_attempt.isdigit() or int(raw_attempt) < 1:
            raise ApiError(
                400,
                f"baggage names rollout {rid!r} but no valid {sc.BAGGAGE_ATTEMPT} (got {raw_attempt!r})",
                param="baggage",
            )
        return (rid, int(raw_attempt)), trace_id, parent_id

    def _route(self, request: Request, gen: GenerationRequest) -> GenerationRequest:
        """Who serves ``gen``: the backend its model name goes to (:mod:`agl.gateway.model_names`; the
        backend then sees the name it knows), and on a backend with named adapters (one per agent) the
        adapter: the one the name maps to, else the one a model name ``"<base>:<adapter>"`` picks, else
        the calling agent's (W3C baggage ``agl.agent``). The calling agent is recorded on every backend
        (the server span's ``agl.llm.agent``). The gateway's sampling defaults and cap apply last."""
        gen.agent = getattr(request.state, "agl_agent", None)  # set by _context, which runs first
        served = self._served(gen.model)
        gen.requested_model, gen.served_by = gen.model, served.backend
        if served.model is not None:
            gen.model = served.model
        if served.backend.agent_loras():
            served.backend.route(gen)
            if served.forces_adapter:
                gen.adapter = served.adapter
        self.sampling.apply(gen)
        return gen

    def _served(self, model: str) -> Served:
        try:
            return self.names.resolve(model)
        except UnknownModelError as exc:
            raise ApiError(404, str(exc), param="model", code="model_not_found") from None

    async def _run(self, request: Request, backend: Backend, gen: GenerationRequest) -> GenerationResult:
        """Generate; a client that disconnects first cancels the generation."""
        if gen.replay is not None or not backend.cancellable:  # replayed: the parent's response
            return gen.replay or await backend.generate(gen)
        # generate in this task; a watcher cancels it when the client disconnects (one extra task,
        # not two: this is on every request's path)
        me = asyncio.current_task()
        gone: list[bool] = []
        watch = asyncio.get_running_loop().create_task(cancel_on_disconnect(request, me, gone))
        try:
            return await backend.generate(gen)
        except asyncio.CancelledError:
            if not gone:
                raise
            if hasattr(me, "uncancel"):  # Python >= 3.11: this cancellation is handled here
                me.uncancel()  # type: ignore[union-attr]
            raise ClientGone("the client disconnected before the reply; generation cancelled") from None
        finally:
            watch.cancel()

    async def _call(
        self,
        request: Request,
        gen: GenerationRequest,
        *,
        trace: tuple[str | None, str | None],
        response_id: str,
    ) -> GenerationResult:
        """Generate, recorded by the recorder (agl.gateway.spans); map backend failures to API errors."""
        backend = self._admit(gen)
        async with self.recorder.call(gen, backend, trace, response_id) as call:
            try:
                call.result = result = await self._run(request, backend, gen)
            except ClientGone as exc:  # cancelled: recorded as an ERROR span
                call.cancelled(exc)
                raise
            except ApiError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to an API error; backend failures get an ERROR span
                api_error, call.error = self._api_error(exc, gen)
                raise api_error from None
        if gen.requested_model:  # the reply names the model as the client asked for it (the span has both)
            result.model = gen.requested_model
        return result

    def _api_error(self, exc: Exception, gen: GenerationRequest) -> tuple[ApiError, BaseException | None]:
        """The API error for a backend failure, and the error to record (None: bad input, no span)."""
        if isinstance(exc, ContextWindowError):
            param = "messages" if gen.messages is not None else "prompt"
            return ApiError(400, str(exc), param=param, code="context_length_exceeded"), None
        if isinstance(exc, UpstreamError) and 400 <= exc.status < 500:
            # the upstream refused bad input: passed on, nothing recorded
            self.stats["upstream_refusals"] += 1
            code = "context_length_exceeded" if "context length" in str(exc).lower() else "upstream_error"
            return ApiError(exc.status, str(exc), type="invalid_request_error", code=code), None
        self.stats["backend_errors"] += 1
        name = self._backend(gen).name
        if not isinstance(exc, BackendError):
            log.error("agl gateway: backend %s failed", name, exc_info=exc)
        message = f"the {name} backend failed: {exc}"
        return ApiError(502, message, type="backend_error", code="backend_error"), exc

    async def flush(self, timeout_s: float | None = 60.0) -> bool:
        """Wait until the spans of every call answered so far are stored; False on timeout."""
        if self.writer is None:
            return True
        return await asyncio.to_thread(self.writer.flush, timeout_s)

    # --------------------------------------------------------------------------------- routes
    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            req = parse_request(ChatCompletionRequest, body)
            rollout, trace_id, parent_id = self._context(request)
            gen = self._route(request, req.to_generation(rollout, body))
            await self._number(gen)
            response_id = new_id("chatcmpl")
            if req.stream and self._streams(gen):
                events, first, call = await self._open_stream(gen, (trace_id, parent_id), response_id)
                tracked = self._tracked(gen, events, call)
                return StreamingResponse(
                    self._chat_stream(req, gen, tracked, first, response_id), media_type="text/event-stream"
                )
            result = await self._call(request, gen, trace=(trace_id, parent_id), response_id=response_id)
        except ApiError as exc:
            return _error(exc)
        except ClientGone:
            return Response(status_code=499)
        tokens = None
        if req.logprobs:
            tokens = [self._token_strings(self._backend(gen), c.response_ids) for c in result.choices]
        if not req.stream:
            return Response(
                sse.dumps(
                    chat_completion_body(
                        result, response_id, tokens=tokens, return_token_ids=req.return_token_ids
                    )
                ),
                media_type="application/json",
            )
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        return StreamingResponse(
            sse.chat_chunks(result, response_id, include_usage, req.return_token_ids),
            media_type="text/event-stream",
        )

    async def _open_stream(
        self, gen: GenerationRequest, trace: tuple[str | None, str | None], response_id: str
    ) -> tuple[AsyncIterator[dict[str, Any]], dict[str, Any], CallRecord]:
        """Start a true stream: (events, first event, its record).

        The backend's first event comes before the 200 is committed, so a refusal (bad input, unknown
        model, upstream down) is still a plain HTTP error, with an ERROR span where the backend failed.
        """
        backend = self._admit(gen)
        call = self.recorder.open(gen, backend, trace, response_id)
        events = backend.stream(gen)
        try:
            first = await anext(events)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - mapped like a non-streamed call's failure
            api_error, call.error = self._api_error(exc, gen)
            call.submit()
            raise api_error from None
        return events, first, call

    async def _tracked(
        self, gen: GenerationRequest, events: AsyncIterator[dict[str, Any]], call: CallRecord
    ) -> AsyncIterator[dict[str, Any]]:
        """The backend's events, with the call's span recorded when the stream ends.

        The ``end`` event is passed on after the span is recorded (stored first with
        ``before_reply``). A backend failure mid-stream becomes an ``error`` event carrying the
        ApiError (the 200 is already sent) and an ERROR span; a client that disconnects cancels the
        stream (the backend's iterator is closed) and leaves an ERROR span.
        """
        result: GenerationResult | None = None
        end: dict[str, Any] | None = None
        try:
            async for ev in events:
                if ev["type"] == "end":
                    end, result = ev, ev["result"]
                else:
                    yield ev
            if result is None:
                raise BackendError("the backend's stream ended without a result")
        except (asyncio.CancelledError, GeneratorExit):
            call.cancelled(ClientGone("the client disconnected mid-stream; generation cancelled"))
            raise
        except Exception as exc:  # noqa: BLE001 - the 200 is sent: the error goes into the stream
            api_error, error = self._api_error(exc, gen)
            call.error = error or exc
            yield {"type": "error", "error": api_error}
            return
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()  # type: ignore[attr-defined]
            call.submit()  # a stream that failed or was cancelled: its ERROR span, queued
        call.result = result
        await call.store()
        yield end  # type: ignore[misc]

    def _chat_stream(
        self,
        req: ChatCompletionRequest,
        gen: GenerationRequest,
        events: AsyncIterator[dict[str, Any]],
        first: dict[str, Any],
        response_id: str,
    ) -> AsyncIterator[bytes]:
        """Chat-completion chunks from the tracked events, as they come."""
        head = {"id": response_id, "object": "chat.completion.chunk", "created": int(time.time())}
        head["model"] = gen.requested_model or gen.model
        return sse.chat_stream(
            events,
            head,
            prompt_ids=first.get("prompt_ids") if req.return_token_ids else None,
            want_ids=req.return_token_ids,
            want_logprobs=bool(req.logprobs),
            include_usage=bool((req.stream_options or {}).get("include_usage")),
        )

    @staticmethod
    def _token_strings(backend: Backend, ids: list[int] | None) -> list[str] | None:
        tok = getattr(backend, "tokenizer", None)
        if ids is None or tok is None:
            return None
        return [tok.decode([i]) for i in ids]

    async def completions(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            req = parse_request(CompletionRequest, body)
            rollout, trace_id, parent_id = self._context(request)
            gen = self._route(request, req.to_generation(rollout, body))
            await self._number(gen)
            response_id = new_id("cmpl")
            result = await self._call(request, gen, trace=(trace_id, parent_id), response_id=response_id)
        except ApiError as exc:
            return _error(exc)
        except ClientGone:
            return Response(status_code=499)
        payload = completion_body(result, response_id, return_token_ids=req.return_token_ids)
        if not req.stream:
            return Response(sse.dumps(payload), media_type="application/json")

        include_usage = bool((req.stream_options or {}).get("include_usage"))
        return StreamingResponse(
            sse.completion_chunks(payload, include_usage), media_type="text/event-stream"
        )

    async def responses(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            req = parse_request(ResponsesRequest, body)
            rollout, trace_id, parent_id = self._context(request)
            gen = self._route(request, responses_to_generation(req, rollout))
            await self._number(gen)
            response_id = new_id("resp")
            created = time.time()
            if req.stream and self._streams(gen):
                events, _, call = await self._open_stream(gen, (trace_id, parent_id), response_id)
                tracked = self._tracked(gen, events, call)
                return StreamingResponse(
                    sse.response_stream(req, response_id, created, tracked), media_type="text/event-stream"
                )
            result = await self._call(request, gen, trace=(trace_id, parent_id), response_id=response_id)
        except ApiError as exc:
            return _error(exc)
        except ClientGone:
            return Response(status_code=499)
        if not req.stream:
            return Response(
                sse.dumps(responses_body(req, response_id, created, result=result)),
                media_type="application/json",
            )
        return StreamingResponse(
            sse.response_stream(req, response_id, created, sse.result_events(result)),
            media_type="text/event-stream",
        )

    async def messages(self, request: Request) -> Response:
        """``POST /v1/messages``: the Anthropic Messages API, rendered as chat (see agl.gateway.anthropic)."""
        try:
            body = await self._body(request)
            req = anthropic.parse(body)
            rollout, trace_id, parent_id = self._context(request)
            gen = self._route(request, anthropic.to_generation(req, body, rollout))
            await self._number(gen)
            message_id = new_id("msg")
            trace = (trace_id, parent_id)
            if req.stream and self._streams(gen):
                events, first, call = await self._open_stream(gen, trace, message_id)
                tracked = self._tracked(gen, events, call)
                prompt_tokens = len(first.get("prompt_ids") or ()) or None
                model = gen.requested_model or gen.model
                stream = anthropic.message_stream(model, message_id, tracked, prompt_tokens)
                return StreamingResponse(stream, media_type="text/event-stream")
            result = await self._call(request, gen, trace=trace, response_id=message_id)
        except ApiError as exc:
            return anthropic.error_response(exc)
        except ClientGone:
            return Response(status_code=499)
        if not req.stream:
            return Response(
                sse.dumps(anthropic.message_body(result, message_id)), media_type="application/json"
            )
        events = sse.result_events(result)
        stream = anthropic.message_stream(result.model, message_id, events, result.prompt_tokens)
        return StreamingResponse(stream, media_type="text/event-stream")

    async def count_tokens(self, request: Request) -> Response:
        """``POST /v1/messages/count_tokens``: the prompt's length in tokens, as the chat template renders it
        (backends without a local tokenizer answer 404: the count would be a guess)."""
        try:
            body = await self._body(request)
            req = anthropic.parse(body, counting=True)
            backend = self._served(req.model).backend
            tok = getattr(backend, "tokenizer", None)
            if tok is None:
                raise ApiError(404, f"the {backend.name} backend has no local tokenizer to count with")
            messages = anthropic.chat_messages(body)
            _, ids = await tok.aencode_chat(messages, anthropic.chat_tools(body.get("tools")))
        except ApiError as exc:
            return anthropic.error_response(exc)
        except ClientGone:
            return Response(status_code=499)
        return Response(sse.dumps({"input_tokens": len(ids)}), media_type="application/json")

    async def list_models(self, request: Request) -> Response:
        try:
            self._auth(request)
        except ApiError as exc:
            return _error(exc)
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "agl"} for m in self.names.listed()
        ]
        return Response(sse.dumps({"object": "list", "data": data}), media_type="application/json")

    async def status(self, request: Request) -> Response:
        try:
            self._auth(request)
        except ApiError as exc:
            return _error(exc)
        b, names = self.backend, self.names
        body = {"backend": b.name, "models": names.listed(), "model_names": names.describe()}
        body.update(weight_version=b.weight_version, exact=b.exact, stats=dict(self.stats))
        return Response(sse.dumps(body), media_type="application/json")

    async def _swap(
        self,
        request: Request,
        fn: Callable[[dict[str, Any]], Awaitable[int]],
        what: str,
        *,
        per_agent: bool = False,
    ) -> Response:
        """A weight swap; ``per_agent``: the body may name ``adapters`` instead of one ``path``."""
        try:
            body = await self._body(request)
            many = per_agent and isinstance(body, dict) and "adapters" in body
            if not isinstance(body, dict) or not (many or isinstance(body.get("path"), str)):
                raise ApiError(400, f"{what}: the body needs a 'path' string", param="path")
            version = body.get("version")
            if version is not None and (
                not isinstance(version, int) or isinstance(version, bool) or version < 0
            ):
                raise ApiError(400, f"{what}: 'version' must be a non-negative integer", param="version")
            async with self._swap_lock:
                new_version = await fn(body)
        except ApiError as exc:
            return _error(exc)
        except ClientGone:
            return Response(status_code=499)
        except (BackendError, FileNotFoundError, ValueError) as exc:
            return _error(ApiError(400, f"{what} failed: {exc}", code="swap_failed"))
        return Response(sse.dumps({"weight_version": new_version}), media_type="application/json")

    async def load_weights(self, request: Request) -> Response:
        return await self._swap(
            request, lambda b: self.backend.load_weights(b["path"], version=b.get("version")), "load weights"
        )

    async def load_adapter(self, request: Request) -> Response:
        return await self._swap(
            request,
            lambda b: self._load_adapter(b),
            "load adapter",
            per_agent=True,
        )

    async def _load_adapter(self, body: dict[str, Any]) -> int:
        """``{"path", "name", "version"}``: one adapter; ``{"adapters": {name: path}, "version"}``: an
        adapter per agent, swapped together as one version."""
        adapters = body.get("adapters")
        if adapters is None:
            return await self.backend.load_adapter(
                body["path"], name=body.get("name"), version=body.get("version")
            )
        if (
            not isinstance(adapters, dict)
            or not adapters
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in adapters.items())
        ):
            raise ApiError(400, "adapters must be a non-empty object {adapter name: path}", param="adapters")
        return await self.backend.load_agent_loras(adapters, version=body.get("version"))

    async def flush_spans(self, request: Request) -> Response:
        """``POST /agl/v1/flush``: answers once the spans of every call answered so far are stored."""
        try:
            self._auth(request)
        except ApiError as exc:
            return _error(exc)
        ok = await self.flush()
        if not ok:
            return _error(ApiError(503, "spans are still being written; try again", type="server_error"))
        return Response(
            sse.dumps({"flushed": True, "stats": dict(self.stats)}), media_type="application/json"
        )

    async def not_found(self, request: Request) -> Response:
        return _error(ApiError(404, f"no route {request.method} {request.url.path}", code="unknown_url"))


def create_app(backend: Backend, store: Any = None, **kwargs: Any) -> Starlette:
    """The ASGI app; ``app.state.gateway`` is the :class:`Gateway` (stats, drift tracker, backend)."""
    gw = Gateway(backend, store, **kwargs)
    # flat routes, per-rollout chat first: a Mount is one more router and exception layer per request
    v1 = [
        Route(prefix + path, handler, methods=[method])
        for prefix in ("/rollouts/{rollout_id}/attempts/{attempt:int}/v1", "/v1")
        for path, handler, method in (
            ("/chat/completions", gw.chat_completions, "POST"),
            ("/completions", gw.completions, "POST"),
            ("/responses", gw.responses, "POST"),
            ("/messages", gw.messages, "POST"),
            ("/messages/count_tokens", gw.count_tokens, "POST"),
            ("/models", gw.list_models, "GET"),
        )
    ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        backends = gw.names.backends
        started: list[Backend] = []
        try:
            try:
                for b in backends:
                    await b.start()
                    started.append(b)
                gw.names.check()  # --serve targets name adapters the started policy has
            except Exception as exc:  # uvicorn only says "startup failed": keep the reason to report
                gw.startup_error = exc
                raise
            yield
        finally:
            try:
                for b in reversed(started):
                    await b.close()
            finally:
                if gw.writer is not None:  # requests are done: store what is queued, lose nothing
                    await asyncio.to_thread(gw.writer.close)

    async def on_404(request: Request, exc: Exception) -> Response:
        return await gw.not_found(request)

    async def on_405(request: Request, exc: Exception) -> Response:
        what = f"method {request.method} not allowed on {request.url.path}"
        return _error(ApiError(405, what, code="method_not_allowed"))

    async def on_500(request: Request, exc: Exception) -> Response:
        log.exception("agl gateway: internal error on %s", request.url.path, exc_info=exc)
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    app = Starlette(
        routes=[
            *v1,
            Route("/agl/v1/status", gw.status, methods=["GET"]),
            Route("/agl/v1/flush", gw.flush_spans, methods=["POST"]),
            Route("/agl/v1/weights", gw.load_weights, methods=["POST"]),
            Route("/agl/v1/adapters", gw.load_adapter, methods=["POST"]),
        ],
        exception_handlers={404: on_404, 405: on_405, Exception: on_500},
        lifespan=lifespan,
    )
    app.state.gateway = gw
    return app
