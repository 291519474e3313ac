"""Server-side ``chat`` spans: one :class:`CallRecorder` records every gateway call, built per call,
stored in batches (``SpanWriter``, in :mod:`agl.gateway.span_writer`).

Every route (Chat Completions, Completions, Responses, Anthropic Messages), streamed or not, records
its call through :class:`CallRecorder`: it counts the call once, builds its span(s) once (drift checked)
and chooses between waiting for the store and queueing. The routes keep HTTP only.

The gateway builds :class:`agl.types.Span` objects directly (without validation, from values it made or
checked itself) instead of going through an OTel ``TracerProvider``: no per-span validation, no span
processors. By default (``span_writes="before_reply"``) each span is stored before its reply is sent,
so a runner that finishes its attempt right after the agent returns never loses the last call's span.
With ``span_writes="after_reply"`` the reply leaves first and the span follows within milliseconds.
Either way the spans of calls that finish together are written in one ``add_spans`` call: on the event
loop for in-process stores (memory; SQLite while a call is alone), from a writer thread batching by
the load for SQLite while calls overlap and for stores behind a network round trip. ``POST /agl/v1/flush`` (or ``Gateway.flush()``) waits until every span of the calls answered so
far is stored, and shutdown drains the queue; whoever reads the spans must flush first. The parent
comes from the incoming W3C ``traceparent`` (parsed by OTel's own propagator); rollout and attempt
from the URL path or the W3C ``baggage`` header.

Calls that belong to no rollout are served but their spans are **not** stored (a stored span needs a
rollout); they are counted in ``Gateway.stats["unattributed_calls"]``.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Optional

from agl import semconv as sc
from agl.chat.format import flatten_content
from agl.gateway.backends.base import Backend, Choice, GenerationRequest, GenerationResult
from agl.gateway.span_writer import SpanWriter
from agl.types import Span, SpanEvent, SpanStatus, _construct

__all__ = [
    "CallRecord",
    "CallRecorder",
    "DriftTracker",
    "SpanWriter",
    "build_chat_spans",
    "parse_trace_headers",
]

log = logging.getLogger("agl.gateway")


def _random_hex(nbytes: int) -> str:
    """A non-zero random trace/span id, drawn the way OTel's own id generator draws them (``random``,
    reseeded in a forked child): ids must be unique, not secret, and ``os.urandom`` is a syscall."""
    bits = nbytes * 8
    while True:
        value = random.getrandbits(bits)
        if value:
            return f"{value:0{nbytes * 2}x}"


def parse_trace_headers(
    traceparent: str | None, baggage: str | None
) -> tuple[str | None, str | None, dict[str, str]]:
    """(trace_id, parent span id, baggage entries) from W3C headers, via OTel's propagators."""
    trace_id = parent_id = None
    entries: dict[str, str] = {}
    if traceparent:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        ctx = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
        sctx = trace.get_current_span(ctx).get_span_context()
        if sctx.is_valid:
            trace_id, parent_id = f"{sctx.trace_id:032x}", f"{sctx.span_id:016x}"
    if baggage:
        from opentelemetry.baggage import get_all
        from opentelemetry.baggage.propagation import W3CBaggagePropagator

        ctx = W3CBaggagePropagator().extract({"baggage": baggage})
        entries = {k: str(v) for k, v in get_all(ctx).items()}
    return trace_id, parent_id, entries


def _message_key(msg: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a message for drift detection: role, text, tool calls (not their ids)."""
    content = msg.get("content")
    text = (content if isinstance(content, str) else flatten_content(content)).strip()
    if not msg.get("tool_calls"):
        return (msg.get("role"), text, ())
    calls = []
    for tc in msg["tool_calls"]:
        fn = tc.get("function", {}) if isinstance(tc, dict) else {}
        args = fn.get("arguments")
        try:
            args = (
                json.dumps(json.loads(args), sort_keys=True)
                if isinstance(args, str)
                else json.dumps(args, sort_keys=True)
            )
        except ValueError:
            pass
        calls.append((fn.get("name"), args))
    return (msg.get("role"), text, tuple(calls))


def _tools_key(tools: Sequence[dict[str, Any]] | None) -> tuple[Any, ...]:
    """Tools are part of the rendered prompt: a conversation continues only under the same tools."""
    return ("tools", json.dumps(tools, sort_keys=True) if tools else "")


class DriftTracker:
    """Remembers each conversation's last prompt+response ids to check the next prompt against.

    For every call of a rollout attempt it stores (the tools, the conversation's messages plus the
    reply, the prompt ids plus the response ids). When a later request has the same tools and its
    messages start with a stored conversation — the agent re-sends the earlier turns — the new prompt ids must start with the stored
    ids; ``check`` returns whether they do (``None`` when the request continues no known conversation).
    """

    def __init__(self, max_attempts: int = 4096, per_attempt: int = 64) -> None:
        # per attempt: conversation key (tools, messages..., reply) -> prompt+response ids, oldest first
        self._by_attempt: OrderedDict[tuple[str, int], dict[tuple[Any, ...], list[int]]] = OrderedDict()
        self.max_attempts = max_attempts
        self.per_attempt = per_attempt

    def observe(
        self,
        rollout: tuple[str, int],
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        prompt_ids: Sequence[int],
        reply: dict[str, Any] | None,
        response_ids: Sequence[int] | None,
    ) -> bool | None:
        """Check this call's prompt ids against the conversation it continues, then remember it."""
        keys = (_tools_key(tools), *(_message_key(m) for m in messages))
        result: bool | None = None
        known = self._by_attempt.get(rollout)
        if known:
            # the longest earlier conversation this one extends: it ends with an assistant turn
            for end in range(len(keys) - 1, 1, -1):
                if keys[end - 1][0] != "assistant":
                    continue
                ids = known.get(keys[:end])
                if ids is not None:
                    result = list(prompt_ids[: len(ids)]) == ids
                    break
        if reply is not None and response_ids is not None:
            if known is None:
                known = self._by_attempt[rollout] = {}
            else:
                self._by_attempt.move_to_end(rollout)
            known[(*keys, _message_key(reply))] = [*prompt_ids, *response_ids]
            if len(known) > self.per_attempt:
                del known[next(iter(known))]
            while len(self._by_attempt) > self.max_attempts:
                self._by_attempt.popitem(last=False)
        return result


#: (trace id, parent span id) of a call, from its W3C ``traceparent`` (both None without one)
Trace = tuple[Optional[str], Optional[str]]


class CallRecorder:
    """Records the gateway's calls, streamed or not, of every route, in one place.

    :meth:`open` counts a call once (``stats["calls"]``; ``unattributed_calls`` when it names no
    rollout: served, span not stored) and starts its clock; the returned :class:`CallRecord` builds
    its span(s) once and stores them once. :meth:`call` is the same for a call answered whole: it also
    knows whether the call was alone in flight (then an in-process commit store is written on the
    loop, no thread hop; see :mod:`agl.gateway.span_writer`). ``span_writes="before_reply"`` awaits the
    store before the reply leaves; ``"after_reply"`` queues. ``writer`` None: nothing is stored.
    """

    def __init__(
        self,
        writer: SpanWriter | None,
        stats: dict[str, int],
        *,
        span_writes: str,
        policy: Backend,
        backends: Sequence[Backend],
    ) -> None:
        self.writer = writer
        self.stats = stats
        self.wait = span_writes == "before_reply"
        self.drift = DriftTracker()
        #: one drift tracker per backend: each renders and tokenises conversations its own way
        self._drifts = {id(b): (self.drift if b is policy else DriftTracker()) for b in backends}
        self._in_flight = 0  # calls answered whole between their request and their span

    def drift_for(self, backend: Backend) -> DriftTracker:
        """The drift tracker of the backend that served a call."""
        return self._drifts.get(id(backend), self.drift)

    def open(self, gen: GenerationRequest, backend: Backend, trace: Trace, response_id: str) -> CallRecord:
        """Count the call ``backend`` serves and start recording it (a stream: ended by its writer)."""
        self.stats["calls"] += 1
        if gen.rollout is None:
            self.stats["unattributed_calls"] += 1
        return CallRecord(self, gen, backend, trace, response_id)

    @asynccontextmanager
    async def call(
        self, gen: GenerationRequest, backend: Backend, trace: Trace, response_id: str
    ) -> AsyncIterator[CallRecord]:
        """A call answered whole: the block sets ``result`` (or ``error``); its span(s) are stored
        when the block ends, however it ends, before the reply is built."""
        record = self.open(gen, backend, trace, response_id)
        self._in_flight += 1
        try:
            yield record
        finally:
            alone, self._in_flight = self._in_flight == 1, self._in_flight - 1  # alone: no call overlaps
            await record.store(alone=alone)


class CallRecord:
    """One call being recorded: whoever serves it sets ``result``, or ``error`` when it failed (an
    ERROR span); neither set (bad input refused): no span. Stored once, however often asked."""

    __slots__ = (
        "_recorder",
        "backend",
        "error",
        "gen",
        "response_id",
        "result",
        "start_ns",
        "trace",
        "_done",
    )

    def __init__(
        self, recorder: CallRecorder, gen: GenerationRequest, backend: Backend, trace: Trace, response_id: str
    ) -> None:
        self._recorder = recorder
        self.gen, self.backend, self.trace, self.response_id = gen, backend, trace, response_id
        self.start_ns = time.time_ns()
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self._done = False

    def cancelled(self, error: BaseException) -> None:
        """The client went away: counted (``cancelled_calls``), recorded as an ERROR span."""
        self._recorder.stats["cancelled_calls"] += 1
        self.error = error

    async def store(self, *, alone: bool = True) -> None:
        """Store the span(s): awaited with ``span_writes="before_reply"``, else queued."""
        spans = self._take()
        if spans and self._recorder.wait:
            await self._recorder.writer.write(spans, alone=alone)  # type: ignore[union-attr]
        elif spans:
            self._recorder.writer.submit(spans)  # type: ignore[union-attr]

    def submit(self) -> None:
        """Queue the span(s) without waiting: where nothing may wait (a stream closed mid-way, a
        stream refused before its 200)."""
        spans = self._take()
        if spans:
            self._recorder.writer.submit(spans)  # type: ignore[union-attr]

    def _take(self) -> list[Span]:
        if self._done or (self.result is None and self.error is None):
            return []
        self._done = True
        return self.spans()

    def spans(self) -> list[Span]:
        """The call's span(s) (drift checked); none when it has no rollout or nothing stores them."""
        gen, rollout = self.gen, self.gen.rollout
        if rollout is None or self._recorder.writer is None:
            return []
        result = self.result if self.error is None else None
        prefix = None
        if result is not None and result.prompt_ids is not None and gen.messages is not None:
            choice = result.choices[0]
            prefix = self._recorder.drift_for(self.backend).observe(
                rollout, gen.messages, gen.tools, result.prompt_ids, choice.message(), choice.response_ids
            )
        return build_chat_spans(
            request=gen,
            result=result,
            rollout=rollout,
            trace_id=self.trace[0],
            parent_id=self.trace[1],
            start_ns=self.start_ns,
            backend_name=self.backend.name,
            response_id=self.response_id,
            prefix_match=prefix,
            error=self.error,
        )


try:  # orjson is several times faster where installed; the stdlib writes the same JSON
    import orjson

    def _dumps(value: Any) -> str:
        return orjson.dumps(value).decode()

except ImportError:  # pragma: no cover

    def _dumps(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


_STATUS_UNSET = SpanStatus()


def build_chat_spans(
    *,
    request: GenerationRequest,
    result: GenerationResult | None,
    rollout: tuple[str, int],
    trace_id: str | None,
    parent_id: str | None,
    start_ns: int,
    backend_name: str,
    response_id: str,
    prefix_match: bool | None = None,
    error: BaseException | None = None,
    input_messages: list[dict[str, Any]] | None = None,
) -> list[Span]:
    """One span per choice (``agl.llm.choice_index`` tells them apart when n > 1); one ERROR span when
    the call failed (``error``) or produced nothing (``result`` None)."""
    end_ns = time.time_ns()
    trace_id = trace_id or _random_hex(16)
    base = _request_attrs(request, rollout, backend_name, response_id, input_messages)
    ids = (trace_id, parent_id, start_ns, end_ns)
    if error is not None or result is None:
        return [_error_span(ids, base, rollout, error)]
    _result_attrs(base, result, prefix_match)
    many = len(result.choices) > 1
    spans = []
    for i, choice in enumerate(result.choices):
        attrs = dict(base)
        _choice_attrs(attrs, choice)
        if choice.response_ids is None and result.reported_completion_tokens is not None and not many:
            attrs[sc.GEN_AI_USAGE_OUTPUT_TOKENS] = int(result.reported_completion_tokens)
        if many:
            attrs[sc.AGL_LLM_CHOICE_INDEX] = i
        spans.append(_choice_span(ids, attrs, rollout))
    return spans


def _request_attrs(
    request: GenerationRequest,
    rollout: tuple[str, int],
    backend_name: str,
    response_id: str,
    input_messages: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """The attributes every span of the call shares: what was asked, of which backend, in which rollout.
    ``input_messages`` (when given) are recorded instead of the request's messages."""
    base: dict[str, Any] = {
        sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT,
        sc.AGL_SIDE: sc.SIDE_SERVER,
        sc.AGL_ROLLOUT_ID: rollout[0],
        sc.AGL_ATTEMPT: rollout[1],
        sc.AGL_LLM_BACKEND: backend_name,
        sc.AGL_LLM_API: request.api,
        # the name the program asked for; gen_ai.response.model says which model served it
        sc.GEN_AI_REQUEST_MODEL: request.requested_model or request.model,
        sc.GEN_AI_RESPONSE_ID: response_id,
    }
    if request.agent:
        base[sc.AGL_LLM_AGENT] = request.agent
    if request.seed is not None:  # reproducible runs: the seed the call was sampled with (agl.gateway.seeds)
        base[sc.AGL_LLM_SEED] = int(request.seed)
        base[sc.AGL_LLM_SEED_SOURCE] = request.seed_source or sc.SEED_SOURCE_AGENT
    if request.call_index is not None:
        base[sc.AGL_LLM_CALL_INDEX] = int(request.call_index)
    if request.replay is not None:  # a branch rollout's call answered from its parent's (agl.gateway.replay)
        base[sc.AGL_LLM_REPLAYED] = True
    if request.branch_point:
        base[sc.AGL_LLM_BRANCH_POINT] = True
    if request.temperature is not None:
        base[sc.GEN_AI_REQUEST_TEMPERATURE] = float(request.temperature)
        if request.temperature_source:  # forced by the rollout (a greedy held-out one)
            base[sc.AGL_LLM_TEMPERATURE_SOURCE] = request.temperature_source
    if request.top_p is not None:
        base[sc.GEN_AI_REQUEST_TOP_P] = float(request.top_p)
    if request.max_tokens is not None:
        base[sc.GEN_AI_REQUEST_MAX_TOKENS] = int(request.max_tokens)
    msgs = input_messages if input_messages is not None else request.messages
    if msgs is not None:
        base[sc.GEN_AI_INPUT_MESSAGES] = _dumps(msgs)
    if request.prompt is not None:
        base[sc.AGL_LLM_PROMPT_TEXT] = request.prompt
    if request.tools:
        base[sc.GEN_AI_TOOL_DEFINITIONS] = _dumps(request.tools)
    return base


def _result_attrs(base: dict[str, Any], result: GenerationResult, prefix_match: bool | None) -> None:
    """Add what every choice of a result shares: the serving model, exactness, weight version, prompt."""
    base[sc.GEN_AI_RESPONSE_MODEL] = result.model
    base[sc.AGL_LLM_EXACT] = bool(result.exact)
    if result.weight_version is not None:
        base[sc.AGL_LLM_WEIGHT_VERSION] = int(result.weight_version)
    if getattr(result, "weight_versions", None):
        base[sc.AGL_LLM_WEIGHT_VERSIONS] = [int(x) for run in result.weight_versions for x in run]
    if getattr(result, "adapter", None) is not None:
        base[sc.AGL_LLM_ADAPTER] = str(result.adapter)
    if result.prompt_ids is not None:
        base[sc.AGL_LLM_PROMPT_TOKEN_IDS] = list(result.prompt_ids)
    if getattr(result, "forced_tokens", 0):
        base[sc.AGL_LLM_FORCED_TOKENS] = int(result.forced_tokens)
    if result.prompt_tokens is not None:
        base[sc.GEN_AI_USAGE_INPUT_TOKENS] = int(result.prompt_tokens)
    if prefix_match is not None:
        base[sc.AGL_LLM_PREFIX_MATCH] = prefix_match


#: (trace id, parent span id, start ns, end ns) of a call's spans
_SpanIds = tuple[str, "str | None", int, int]


def _error_span(
    ids: _SpanIds, attrs: dict[str, Any], rollout: tuple[str, int], error: BaseException | None
) -> Span:
    """The ERROR span of a failed call, with an ``exception`` event naming the error when there is one."""
    trace_id, parent_id, start_ns, end_ns = ids
    status = SpanStatus(code="ERROR", message=f"{type(error).__name__}: {error}" if error else "no result")
    events: tuple[SpanEvent, ...] = ()
    if error is not None:
        events = (
            SpanEvent(
                name="exception",
                time_ns=end_ns,
                attributes={
                    sc.AGL_EXCEPTION_TYPE: type(error).__name__,
                    sc.AGL_EXCEPTION_MESSAGE: str(error),
                },
            ),
        )
    return Span(
        trace_id=trace_id,
        span_id=_random_hex(8),
        parent_id=parent_id,
        name=sc.SPAN_CHAT,
        kind="SERVER",
        start_ns=start_ns,
        end_ns=end_ns,
        status=status,
        attributes=attrs,
        events=events,
        rollout_id=rollout[0],
        attempt=rollout[1],
    )


def _choice_span(ids: _SpanIds, attrs: dict[str, Any], rollout: tuple[str, int]) -> Span:
    """One choice's span. Every value here is made by the gateway from checked input (ids matched at the
    route, hex ids generated or parsed by OTel, attribute values of OTel types, logprobs checked
    finite), so the per-value validation of the model is skipped on this hot path."""
    trace_id, parent_id, start_ns, end_ns = ids
    return _construct(
        Span,
        {
            "trace_id": trace_id,
            "span_id": _random_hex(8),
            "parent_id": parent_id,
            "name": sc.SPAN_CHAT,
            "kind": "SERVER",
            "start_ns": start_ns,
            "end_ns": end_ns,
            "status": _STATUS_UNSET,
            "attributes": attrs,
            "events": (),
            "resource": {},
            "rollout_id": rollout[0],
            "attempt": rollout[1],
            "seq": None,
            "stale": False,
        },
    )


def _choice_attrs(attrs: dict[str, Any], choice: Choice) -> None:
    attrs[sc.GEN_AI_RESPONSE_FINISH_REASONS] = [choice.finish_reason]
    if choice.tool_call_repairs:
        attrs[sc.AGL_LLM_TOOL_CALL_REPAIRS] = choice.tool_call_repairs
    attrs[sc.GEN_AI_OUTPUT_MESSAGES] = _dumps([choice.message()])
    if choice.response_ids is not None:
        attrs[sc.AGL_LLM_RESPONSE_TOKEN_IDS] = list(choice.response_ids)
        attrs[sc.GEN_AI_USAGE_OUTPUT_TOKENS] = len(choice.response_ids)
    if choice.logprobs is not None:
        logprobs = [float(x) for x in choice.logprobs]
        if all(map(math.isfinite, logprobs)):
            attrs[sc.AGL_LLM_RESPONSE_LOGPROBS] = logprobs
        else:  # not storable (and useless for a ratio); the ids are still exact
            log.warning("agl gateway: dropped non-finite response logprobs")
