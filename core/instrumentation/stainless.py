"""Client-side ``chat`` spans for the LLM SDKs Stainless generates (``openai``, ``anthropic``): the
wrappers and the span ending both integrations share.

The SDKs are generated alike: every resource method funnels into ``SyncAPIClient.request`` /
``AsyncAPIClient.request`` (``_base_client``), and every stream iterates ``Stream.__stream__`` /
``AsyncStream.__stream__`` (``_streaming``). :func:`instrument_client` wraps those into an
integration's ``PatchLedger``; a :class:`Dialect` says what differs per SDK (which requests are LLM
calls, their request attributes, the span object that records the reply). While instrumented it

- opens a ``chat`` span (kind CLIENT) for the requests the dialect classifies as LLM calls, made
  current for the duration of the HTTP call, and records request and response;
- adds W3C ``traceparent`` and ``baggage`` headers to every request it sends (rollout id and attempt
  travel as baggage), so the gateway's server-side span becomes the client span's child; headers the
  caller set explicitly are left alone;
- for streams, assembles the output from the chunks and ends the span when the stream is exhausted,
  closed, fails or is garbage-collected.

:class:`ClientChatSpan` is the span object's shared half: idempotent ending, and agl's own failure
while recording logged (debug) instead of reaching the caller; a dialect's span subclass says what a
whole reply, a chunk and a finished stream record. Imports neither SDK.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.trace import SpanKind, Status, StatusCode
from pydantic import BaseModel

from agl import semconv
from agl.instrumentation.agent import request_context
from agl.instrumentation.toolkit import guarded
from agl.tracing.provider import current_rollout

__all__ = ["ClientChatSpan", "Dialect", "instrument_client"]

logger = logging.getLogger(__name__)

_STATE_ATTR = "_agl_chat_span"  # set on the httpx.Response of a streamed call
_BAGGAGE = W3CBaggagePropagator()


class ClientChatSpan:
    """One in-flight client ``chat`` span of an SDK call: :meth:`finish_response` (a whole reply),
    :meth:`on_chunk` then :meth:`finish_stream` (a stream), :meth:`fail`, :meth:`end`.

    Ending is idempotent, so exhausting, closing and garbage-collecting a stream end the span exactly
    once; a failure of agl's own while recording is logged at debug and the span still ends (recording
    must never break the user's call). Subclasses set ``sdk`` (for the log) and implement
    :meth:`response_attributes`, :meth:`record_chunk` and :meth:`stream_attributes`.
    """

    __slots__ = ("api", "span", "_ended")
    sdk = "sdk"

    def __init__(self, api: str, span: trace.Span) -> None:
        self.api, self.span, self._ended = api, span, False

    def response_attributes(self, resp: Any) -> dict[str, Any]:
        """The attributes of a whole reply."""
        raise NotImplementedError

    def record_chunk(self, chunk: Any) -> None:
        """Take in one stream chunk (or event)."""
        raise NotImplementedError

    def stream_attributes(self) -> dict[str, Any]:
        """The attributes of the reply assembled from the chunks so far."""
        raise NotImplementedError

    def finish_response(self, resp: Any) -> None:
        if self._ended:
            return
        try:
            self.span.set_attributes(self.response_attributes(resp))
        except Exception as exc:  # noqa: BLE001 - recording must never break the user's call
            logger.debug("agl: cannot record %s response: %r", self.sdk, exc)
        self.end()

    def on_chunk(self, chunk: Any) -> None:
        try:
            self.record_chunk(chunk)
        except Exception as exc:  # noqa: BLE001
            logger.debug("agl: cannot record %s stream chunk: %r", self.sdk, exc)

    def finish_stream(self) -> None:
        if self._ended:
            return
        try:
            self.span.set_attributes(self.stream_attributes())
        except Exception as exc:  # noqa: BLE001
            logger.debug("agl: cannot record %s stream output: %r", self.sdk, exc)
        self.end()

    def fail(self, exc: BaseException) -> None:
        if self._ended:
            return
        self.span.record_exception(exc)
        self.span.set_attribute(semconv.ERROR_TYPE, type(exc).__qualname__)
        self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        self.end()

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.span.end()


class Dialect(NamedTuple):
    """What differs between SDKs generated alike (openai, anthropic): which requests are LLM calls, the
    request's span attributes, and the span object that records the reply (``finish_response``,
    ``on_chunk``, ``finish_stream``, ``fail``, ``end``)."""

    classify: Callable[[str, str], str | None]
    request_attributes: Callable[[str, Any], dict[str, Any]]
    span: Callable[[str, trace.Span], Any]


_TARGETS = (
    ("_base_client", "SyncAPIClient", "request", "sync_request"),
    ("_base_client", "AsyncAPIClient", "request", "async_request"),
    ("_streaming", "Stream", "__stream__", "sync_stream"),
    ("_streaming", "AsyncStream", "__stream__", "async_stream"),
    ("_streaming", "Stream", "close", "sync_close"),
    ("_streaming", "AsyncStream", "close", "async_close"),
)


# ------------------------------------------------------------------------------------ helpers


def _is_options(arg: Any) -> bool:
    return not isinstance(arg, type) and hasattr(arg, "json_data") and hasattr(arg, "url")


def _find_options(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int | str | None]:
    """The FinalRequestOptions argument of ``request(cast_to, options, ...)`` and where it is."""
    if "options" in kwargs:
        return kwargs["options"], "options"
    if len(args) > 1 and _is_options(args[1]):  # the signature of openai 1.x/2.x
        return args[1], 1
    for i, arg in enumerate(args):
        if _is_options(arg):
            return arg, i
    return None, None


def _client_headers(client: Any) -> Any:
    headers = getattr(client, "_custom_headers", None)
    if headers is None:
        headers = getattr(client, "default_headers", None)
    return headers or {}


_W3C_FIELDS = frozenset({semconv.HEADER_TRACEPARENT, semconv.HEADER_TRACESTATE, semconv.HEADER_BAGGAGE})


_w3c_textmap: tuple[Any, bool] = (None, True)  # (global propagator last checked, only W3C fields?)


def _only_w3c(textmap: Any) -> bool:
    """Whether the global propagator injects nothing beyond traceparent/tracestate/baggage (cached)."""
    global _w3c_textmap
    cached = _w3c_textmap
    if cached[0] is textmap:
        return cached[1]
    only = _W3C_FIELDS.issuperset(textmap.fields)
    _w3c_textmap = (textmap, only)
    return only


def _carrier(ctx: otel_context.Context) -> dict[str, str]:
    """The trace headers for ``ctx``: W3C traceparent + baggage always (the gateway reads them), plus
    whatever else the application's global propagator adds (B3, Jaeger...). The baggage names the
    calling agent only while its scope is live (``agl.instrumentation.agent.request_context``)."""
    ctx = request_context(ctx)
    carrier: dict[str, str] = {}
    textmap = propagate.get_global_textmap()
    if not _only_w3c(textmap):
        textmap.inject(carrier, context=ctx)
    span_ctx = trace.get_current_span(ctx).get_span_context()
    if span_ctx.is_valid:  # fast path of TraceContextTextMapPropagator.inject
        carrier[semconv.HEADER_TRACEPARENT] = (
            f"00-{span_ctx.trace_id:032x}-{span_ctx.span_id:016x}-{span_ctx.trace_flags:02x}"
        )
        if span_ctx.trace_state:
            carrier[semconv.HEADER_TRACESTATE] = span_ctx.trace_state.to_header()
    header = _baggage_header(ctx)
    if header:
        carrier[semconv.HEADER_BAGGAGE] = header
    return carrier


_BAGGAGE_KEY = getattr(baggage, "_BAGGAGE_KEY", None)
_baggage_cache: tuple[Any, str] = (None, "")  # (the baggage dict last encoded, kept alive; its header)


def _baggage_header(ctx: otel_context.Context) -> str:
    """The W3C baggage header; encoded once per baggage (one per rollout_context), not per call."""
    global _baggage_cache
    raw = ctx.get(_BAGGAGE_KEY) if _BAGGAGE_KEY is not None else None
    cached = _baggage_cache  # one read: another thread may replace it
    if raw is not None and raw is cached[0]:
        return cached[1]
    if not baggage.get_all(ctx):
        return ""
    carrier: dict[str, str] = {}
    _BAGGAGE.inject(carrier, context=ctx)
    header = carrier.get(semconv.HEADER_BAGGAGE, "")
    if raw is not None:
        _baggage_cache = (raw, header)
    return header


def _with_headers(options: Any, ctx: otel_context.Context, client: Any) -> Any:
    """A copy of the request options with traceparent/baggage added (headers the caller set, on the
    call or as the client's default headers, win)."""
    carrier = _carrier(ctx)
    if not carrier:
        return options
    existing = options.headers or {}
    present = {str(k).lower() for k in existing}
    present.update(str(k).lower() for k in _client_headers(client))
    extra = {k: v for k, v in carrier.items() if k.lower() not in present}
    if not extra:
        return options
    headers = {**existing, **extra}
    if hasattr(options, "model_copy"):  # one shallow copy with the field replaced, no __setattr__
        return options.model_copy(update={"headers": headers})
    copy = options.copy()
    copy.headers = headers
    return copy


def _replace(args: tuple[Any, ...], kwargs: dict[str, Any], where: int | str, value: Any) -> tuple[Any, ...]:
    if isinstance(where, str):
        kwargs[where] = value
        return args
    return (*args[:where], value, *args[where + 1 :])


def _is_raw(result: Any) -> bool:
    return hasattr(result, "http_response") and hasattr(result, "parse")


class _Call:
    """Per-call work shared by the sync and async wrappers."""

    __slots__ = ("state", "token", "stream")

    def __init__(self, tracer: trace.Tracer, options: Any, kwargs: dict[str, Any], dialect: Dialect) -> None:
        self.state: Any = None
        self.token: object | None = None
        self.stream = bool(kwargs.get("stream", False))
        api = dialect.classify(str(getattr(options, "method", "")), str(getattr(options, "url", "")))
        if api is not None:
            attributes = dialect.request_attributes(api, getattr(options, "json_data", None))
            rollout = current_rollout()
            if rollout is not None:  # set here rather than by the stamping processor: one lock less
                attributes[semconv.AGL_ROLLOUT_ID], attributes[semconv.AGL_ATTEMPT] = rollout
            span = tracer.start_span(semconv.SPAN_CHAT, kind=SpanKind.CLIENT, attributes=attributes)
            self.state = dialect.span(api, span)
            self.token = otel_context.attach(trace.set_span_in_context(span))

    def context(self) -> otel_context.Context:
        return otel_context.get_current()

    def detach(self) -> None:
        if self.token is not None:
            otel_context.detach(self.token)
            self.token = None

    def on_result(self, result: Any) -> None:
        try:
            self._on_result(result)
        except Exception as exc:  # noqa: BLE001
            _GUARD.failed(exc)
            if self.state is not None:
                self.state.end()

    def _on_result(self, result: Any) -> None:
        state = self.state
        if state is None:
            return
        if not self.stream and isinstance(result, BaseModel):
            # the common case, a parsed completion: skip the probes below, which on a pydantic
            # model each cost a failed __getattr__ (an exception) per call
            state.finish_response(result)
            return
        if _is_raw(result):
            response = result.http_response
            if self.stream:
                self._attach_stream(response)
                return
            try:
                content = response.content  # already read for non-streamed raw responses
            except Exception:  # noqa: BLE001 - body not read (with_streaming_response): no output to record
                state.end()
                return
            try:
                state.finish_response(json.loads(content))
            except ValueError:
                state.end()
            return
        response = getattr(result, "response", None)
        if self.stream and response is not None:
            self._attach_stream(response)
            return
        state.finish_response(result)

    def _attach_stream(self, response: Any) -> None:
        state = self.state
        assert state is not None
        try:
            setattr(response, _STATE_ATTR, state)
            weakref.finalize(response, state.finish_stream)  # never iterated: still end the span
        except Exception:  # noqa: BLE001
            state.end()


# ------------------------------------------------------------------------------------ wrappers


def _begin(
    tracer: trace.Tracer, dialect: Dialect, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[_Call | None, tuple[Any, ...], dict[str, Any]]:
    """Open the span and add the headers; on any failure of agl's own, the call goes out untouched."""
    call: _Call | None = None
    try:
        options, where = _find_options(args, kwargs)
        if options is None:
            return None, args, kwargs
        call = _Call(tracer, options, kwargs, dialect)
        new_kwargs = dict(kwargs)
        new_args = _replace(args, new_kwargs, where, _with_headers(options, call.context(), instance))  # type: ignore[arg-type]
        return call, new_args, new_kwargs
    except Exception as exc:  # noqa: BLE001 - agl must never break the user's LLM call
        _GUARD.failed(exc)
        if call is not None:
            call.detach()
            if call.state is not None:
                call.state.end()
        return None, args, kwargs


_GUARD = guarded("openai.request")  # agl's failure: the call goes out untraced, logged once, counted


def _sync_request(tracer: trace.Tracer, dialect: Dialect) -> Callable[..., Any]:
    def wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        call, args, kwargs = _begin(tracer, dialect, instance, args, kwargs)
        if call is None:
            return wrapped(*args, **kwargs)
        try:
            result = wrapped(*args, **kwargs)
        except BaseException as exc:
            if call.state is not None:
                call.state.fail(exc)
            raise
        finally:
            call.detach()
        call.on_result(result)
        return result

    return wrapper


def _async_request(tracer: trace.Tracer, dialect: Dialect) -> Callable[..., Any]:
    async def wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        call, args, kwargs = _begin(tracer, dialect, instance, args, kwargs)
        if call is None:
            return await wrapped(*args, **kwargs)
        try:
            result = await wrapped(*args, **kwargs)
        except BaseException as exc:
            if call.state is not None:
                call.state.fail(exc)
            raise
        finally:
            call.detach()
        call.on_result(result)
        return result

    return wrapper


def _state_of(stream: Any) -> Any:
    return getattr(getattr(stream, "response", None), _STATE_ATTR, None)


def _sync_stream(_: trace.Tracer, __: Dialect) -> Callable[..., Any]:
    def wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        return _observe(wrapped(*args, **kwargs), instance)

    return wrapper


def _observe(gen: Any, stream: Any) -> Any:
    state = _state_of(stream)  # looked up at the first next(): the request wrapper sets it after return
    if state is None:
        yield from gen
        return
    try:
        for item in gen:
            state.on_chunk(item)
            yield item
    except GeneratorExit:
        gen.close()
        state.finish_stream()
        raise
    except BaseException as exc:
        state.fail(exc)
        raise
    state.finish_stream()


def _async_stream(_: trace.Tracer, __: Dialect) -> Callable[..., Any]:
    def wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        return _aobserve(wrapped(*args, **kwargs), instance)

    return wrapper


async def _aobserve(gen: Any, stream: Any) -> Any:
    state = _state_of(stream)
    if state is None:
        async for item in gen:
            yield item
        return
    try:
        async for item in gen:
            state.on_chunk(item)
            yield item
    except GeneratorExit:
        await gen.aclose()
        state.finish_stream()
        raise
    except BaseException as exc:
        state.fail(exc)
        raise
    state.finish_stream()


def _sync_close(_: trace.Tracer, __: Dialect) -> Callable[..., Any]:
    def wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        try:
            return wrapped(*args, **kwargs)
        finally:
            state = _state_of(instance)
            if state is not None:
                state.finish_stream()

    return wrapper


def _async_close(_: trace.Tracer, __: Dialect) -> Callable[..., Any]:
    async def wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        try:
            return await wrapped(*args, **kwargs)
        finally:
            state = _state_of(instance)
            if state is not None:
                state.finish_stream()

    return wrapper


_FACTORIES: dict[str, Callable[[trace.Tracer, Dialect], Callable[..., Any]]] = {
    "sync_request": _sync_request,
    "async_request": _async_request,
    "sync_stream": _sync_stream,
    "async_stream": _async_stream,
    "sync_close": _sync_close,
    "async_close": _async_close,
}


def instrument_client(ledger: Any, tracer: trace.Tracer, package: str, dialect: Dialect) -> None:
    """Wrap the request and stream methods of a Stainless-generated SDK (``openai``, ``anthropic``:
    the same ``_base_client`` / ``_streaming`` classes) into ``ledger``, recording per ``dialect``."""
    for module_name, class_name, attr, key in _TARGETS:
        ledger.wrap(
            f"{package}.{module_name}:{class_name}.{attr}",
            _FACTORIES[key](tracer, dialect),
            optional=f"renamed in this {package} version? that part is not instrumented",
        )
