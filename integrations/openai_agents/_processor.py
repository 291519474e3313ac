"""A ``TracingProcessor`` that turns the Agents SDK's own spans into agl's OpenTelemetry spans.

The SDK already knows every agent turn, tool call, handoff and guardrail and reports them to its
trace processors, so agl listens there instead of patching the run loop. Two things callbacks alone
do not give, and this module adds:

- **Nesting of the LLM calls.** The ``openai`` client integration makes the client-side ``chat`` span
  from whatever OTel context is current when the request is sent. The SDK calls ``on_span_start`` in
  the same contextvars context that then runs the span's body (``with function_span(...)``, the model
  call inside ``with response_span(...)``/``generation_span(...)``, and ``agent_span.start(
  mark_as_current=True)`` in the run loop), so the processor *attaches* the new OTel span there and
  detaches it in ``on_span_end``. Detaching happens only when the end runs in the very context that
  attached (checked with a marker contextvar), so a span finished elsewhere never corrupts a context
  it does not own; that context is a task's copy that ends with the task.
- **The tool call id.** ``FunctionSpanData`` has no call id, but the LLM response that issued the call
  (the generation/response span that ended just before, under the same agent) does; tool spans are
  matched to those calls by name and arguments, so AIR can penalise the exact transition.

Parents come from the SDK's own ``parent_id`` (not from whatever is current), so a span started in
another task still lands under the right agent. SDK spans agl has no name for (task, turn, custom,
MCP listing, speech) are transparent: their children attach to the nearest mapped ancestor.
"""

from __future__ import annotations

import contextvars
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agents.tracing import Span as SdkSpan
from agents.tracing import Trace as SdkTrace
from agents.tracing import TracingProcessor
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from agl import semconv
from agl.instrumentation import guarded, safe_json
from agl.instrumentation.agent import agent_context

__all__ = ["AglTracingProcessor"]

logger = logging.getLogger(__name__)

INTEGRATION = "openai_agents"

#: The SDK span (id) this contextvars context attached last; tells ``on_span_end`` it may detach.
_ATTACHED: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "agl_openai_agents_attached", default=None
)

# SDK span types (``span_data.type``) whose body the SDK runs while the span is current.
_ATTACHING = frozenset({"agent", "function", "generation", "response", "handoff", "guardrail"})
_LLM_TYPES = frozenset({"generation", "response"})
_ON_START = guarded(f"{INTEGRATION}.on_span_start")
_ON_END = guarded(f"{INTEGRATION}.on_span_end")


@dataclass
class _Entry:
    otel: trace.Span | None  # None for a transparent SDK span
    ctx: otel_context.Context  # the context children of this SDK span start from
    agent: str | None  # SDK span id of the nearest agent span (itself for an agent span)
    trace_id: str
    tokens: tuple[object, contextvars.Token[str | None]] | None = None
    start_ns: int = 0  # when the SDK span started (a tripped turn's discard window begins here)
    windows: list[int] = field(default_factory=list)  # an agent's discard windows (agl.discarded.windows)


@dataclass
class _TraceState:
    ctx: otel_context.Context
    open_spans: set[str] = field(default_factory=set)


def _usage(attrs: dict[str, Any], usage: Mapping[str, Any] | Any | None) -> None:
    if usage is None:
        return
    get = usage.get if isinstance(usage, Mapping) else lambda k: getattr(usage, k, None)
    for key, name in (
        ("input_tokens", semconv.GEN_AI_USAGE_INPUT_TOKENS),
        ("output_tokens", semconv.GEN_AI_USAGE_OUTPUT_TOKENS),
    ):
        value = get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            attrs[name] = value


def _error_status(error: Mapping[str, Any]) -> Status:
    """The OTel status of an SDK span error: ERROR with its message (and the error's detail, if any)."""
    data = error.get("data")
    detail = data.get("error") if isinstance(data, Mapping) else None
    message = str(error.get("message") or "error")
    return Status(StatusCode.ERROR, f"{message}: {detail}" if detail else message)


def _input_trip(error: Mapping[str, Any], *, named: bool = False) -> bool:
    """Whether an SDK span error is an input guardrail's tripwire: on a turn span, any guardrail's
    trip but an output guardrail's (whose trip is about the output it judged: that call stays a
    transition, its low reward is about it); with ``named`` (an agent span, where output guardrails'
    trips land too) only one the SDK names ``input_guardrail`` (the streamed run's)."""
    data = error.get("data")
    kind = data.get("type") if isinstance(data, Mapping) else None
    if not str(error.get("message", "")).startswith("Guardrail tripwire"):
        return False
    return kind == "input_guardrail" if named else kind != "output_guardrail"


def _handoff_tool_name(agent_name: str) -> str:
    """The SDK's default handoff tool name (``Handoff.default_tool_name``) for an agent name."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", re.sub(r"\s", "_", f"transfer_to_{agent_name}")).lower()


def _function_calls(items: Any) -> list[tuple[str, str, str | None]]:
    """Function calls among Responses-API output items (objects or their dumps)."""
    calls: list[tuple[str, str, str | None]] = []
    for item in items or ():
        get = item.get if isinstance(item, Mapping) else lambda k, item=item: getattr(item, k, None)
        if get("type") == "function_call" and get("call_id"):
            calls.append((str(get("call_id")), str(get("name") or ""), get("arguments")))
    return calls


def _tool_calls(span_type: str, data: Any) -> list[tuple[str, str, str | None]]:
    """(call id, tool name, arguments) of every function call an LLM response issued.

    Generation spans hold Chat Completions messages, or (when streamed) a dump of the Responses-shaped
    final response the SDK assembles; response spans hold the ``Response`` itself.
    """
    if span_type == "response":
        return _function_calls(getattr(getattr(data, "response", None), "output", None))
    calls: list[tuple[str, str, str | None]] = []
    for message in data.output or ():
        if not isinstance(message, Mapping):
            continue
        calls.extend(_function_calls(message.get("output")))
        for call in message.get("tool_calls") or ():
            if not isinstance(call, Mapping):
                continue
            function = call.get("function") or {}
            if call.get("id") and function.get("name"):
                calls.append((str(call["id"]), str(function["name"]), function.get("arguments")))
    return calls


class AglTracingProcessor(TracingProcessor):
    """Receives the SDK's traces and spans and mirrors them as agl OTel spans.

    ``llm_spans`` says, per LLM call, whether this processor should make the client-side ``chat``
    span itself: only when the ``openai`` client integration (which makes it, with ``traceparent``
    for the gateway) is not instrumented, so an LLM call never gets two client spans.
    """

    def __init__(self, tracer: trace.Tracer, *, llm_spans: Callable[[], bool] = lambda: True) -> None:
        self._tracer = tracer
        self._llm_spans = llm_spans
        self._spans: dict[str, _Entry] = {}
        self._traces: dict[str, _TraceState] = {}
        self._pending_calls: dict[str, list[tuple[str, str, str | None]]] = {}
        self._lock = threading.Lock()
        self.enabled = True

    # ------------------------------------------------------------------------------------ traces
    def on_trace_start(self, trace_: SdkTrace) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._traces[trace_.trace_id] = _TraceState(otel_context.get_current())

    def on_trace_end(self, trace_: SdkTrace) -> None:
        with self._lock:
            state = self._traces.pop(trace_.trace_id, None)
            leftovers = (
                [self._spans.pop(sid) for sid in state.open_spans if sid in self._spans] if state else []
            )
            for entry in leftovers:
                if entry.agent is not None:
                    self._pending_calls.pop(entry.agent, None)
        for entry in leftovers:  # spans the SDK never finished: end them so nothing leaks
            if entry.otel is not None:
                try:
                    entry.otel.end()
                except Exception:  # noqa: BLE001
                    pass

    # ------------------------------------------------------------------------------------- spans
    def on_span_start(self, span: SdkSpan[Any]) -> None:
        if not self.enabled:
            return
        with _ON_START:  # never break the user's run
            self._start(span)

    def on_span_end(self, span: SdkSpan[Any]) -> None:
        with _ON_END:
            self._end(span)

    def shutdown(self) -> None:
        self.enabled = False
        with self._lock:
            entries = list(self._spans.values())
            self._spans.clear()
            self._traces.clear()
            self._pending_calls.clear()
        for entry in entries:
            if entry.otel is not None:
                entry.otel.end()

    def force_flush(self) -> None:
        pass  # spans go to the OTel provider, which agl flushes itself

    # ---------------------------------------------------------------------------------- internals
    def _parent(self, span: SdkSpan[Any]) -> tuple[otel_context.Context, str | None]:
        with self._lock:
            parent = self._spans.get(span.parent_id) if span.parent_id else None
            if parent is not None:
                return parent.ctx, parent.agent
            state = self._traces.get(span.trace_id)
        return (state.ctx if state is not None else otel_context.get_current()), None

    def _start(self, span: SdkSpan[Any]) -> None:
        data = span.span_data
        kind = data.type
        parent_ctx, agent = self._parent(span)
        name: str | None = None
        attrs: dict[str, Any] = {semconv.AGL_INTEGRATION: INTEGRATION}
        if kind == "agent":
            name = semconv.SPAN_INVOKE_AGENT
            attrs[semconv.GEN_AI_OPERATION_NAME] = semconv.OP_INVOKE_AGENT
            attrs[semconv.GEN_AI_AGENT_NAME] = data.name
            agent = span.span_id
        elif kind == "function":
            name = semconv.SPAN_EXECUTE_TOOL
            attrs[semconv.GEN_AI_OPERATION_NAME] = semconv.OP_EXECUTE_TOOL
            attrs[semconv.GEN_AI_TOOL_NAME] = data.name
        elif kind == "handoff":
            name = semconv.SPAN_HANDOFF
            if data.from_agent:
                attrs[semconv.AGL_HANDOFF_FROM] = data.from_agent
        elif kind == "guardrail":
            name = semconv.SPAN_GUARDRAIL
            attrs[semconv.AGL_GUARDRAIL_NAME] = data.name
        elif kind in _LLM_TYPES and self._llm_spans():
            name = semconv.SPAN_CHAT
            attrs[semconv.GEN_AI_OPERATION_NAME] = semconv.OP_CHAT
            attrs[semconv.AGL_SIDE] = semconv.SIDE_CLIENT
            model = getattr(data, "model", None)
            if model:
                attrs[semconv.GEN_AI_REQUEST_MODEL] = str(model)

        otel_span = None
        ctx = parent_ctx
        if name is not None:
            span_kind = SpanKind.CLIENT if name == semconv.SPAN_CHAT else SpanKind.INTERNAL
            otel_span = self._tracer.start_span(name, context=parent_ctx, kind=span_kind, attributes=attrs)
            ctx = trace.set_span_in_context(otel_span, parent_ctx)
            if kind == "agent":  # the agent's model calls carry its name: the gateway serves its adapter
                ctx = agent_context(ctx, data.name)
        entry = _Entry(otel=otel_span, ctx=ctx, agent=agent, trace_id=span.trace_id, start_ns=time.time_ns())
        if kind in _ATTACHING:
            entry.tokens = (otel_context.attach(ctx), _ATTACHED.set(span.span_id))
        with self._lock:
            self._spans[span.span_id] = entry
            state = self._traces.get(span.trace_id)
            if state is not None:
                state.open_spans.add(span.span_id)

    def _end(self, span: SdkSpan[Any]) -> None:
        with self._lock:
            entry = self._spans.pop(span.span_id, None)
            state = self._traces.get(span.trace_id)
            if state is not None:
                state.open_spans.discard(span.span_id)
        if entry is None:
            return
        data = span.span_data
        kind = data.type
        try:
            if kind in _LLM_TYPES and entry.agent is not None:
                calls = _tool_calls(kind, data)
                with self._lock:
                    self._pending_calls[entry.agent] = calls
            elif kind == "agent":
                with self._lock:
                    self._pending_calls.pop(span.span_id, None)
            if entry.otel is not None:
                self._finish(entry, span, kind, data)
            elif span.error:
                self._lift_error(entry, span)
        finally:
            self._detach(entry, span.span_id)

    def _finish(self, entry: _Entry, span: SdkSpan[Any], kind: str, data: Any) -> None:
        otel = entry.otel
        assert otel is not None
        attrs: dict[str, Any] = {}
        if kind == "function":
            if data.input is not None:
                attrs[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] = safe_json(data.input)
            if data.output is not None:
                attrs[semconv.GEN_AI_TOOL_CALL_RESULT] = safe_json(data.output)
            call_id = self._match_call(entry.agent, data.name, data.input)
            if call_id is not None:
                attrs[semconv.GEN_AI_TOOL_CALL_ID] = call_id
        elif kind == "handoff":
            if data.to_agent:
                attrs[semconv.AGL_HANDOFF_TO] = data.to_agent
                call_id = self._match_call(entry.agent, _handoff_tool_name(data.to_agent), None)
                if call_id is not None:
                    attrs[semconv.GEN_AI_TOOL_CALL_ID] = call_id
        elif kind == "guardrail":
            attrs[semconv.AGL_GUARDRAIL_TRIGGERED] = bool(data.triggered)
        elif kind == "generation":
            if data.input is not None:
                attrs[semconv.GEN_AI_INPUT_MESSAGES] = safe_json(list(data.input))
            if data.output is not None:
                attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = safe_json(list(data.output))
            _usage(attrs, data.usage)
        elif kind == "response":
            response = data.response
            if response is not None:
                attrs[semconv.GEN_AI_RESPONSE_ID] = str(response.id)
                if getattr(response, "model", None):
                    attrs[semconv.GEN_AI_RESPONSE_MODEL] = str(response.model)
                    attrs.setdefault(semconv.GEN_AI_REQUEST_MODEL, str(response.model))
                attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = safe_json(list(response.output or ()))
                _usage(attrs, getattr(response, "usage", None))
            if data.input is not None:
                attrs[semconv.GEN_AI_INPUT_MESSAGES] = safe_json(data.input)
        if attrs:
            otel.set_attributes(attrs)
        if span.error:
            otel.set_status(_error_status(span.error))
            if kind == "agent" and _input_trip(
                span.error, named=True
            ):  # streamed: the SDK marks the agent itself
                self._discard(entry, entry.start_ns)
        otel.end()

    def _lift_error(self, entry: _Entry, span: SdkSpan[Any]) -> None:
        """An error the SDK set on a span agl does not map (its turn span: where an input guardrail's trip
        lands) marks the nearest mapped ancestor, the agent, as the SDK marks it for an output guardrail's
        trip, so a trip reads the same either way; an input guardrail's trip also discards the turn's
        calls (their reply never reached the app)."""
        assert span.error is not None
        target = trace.get_current_span(entry.ctx)
        if target.is_recording():
            target.set_status(_error_status(span.error))
        if span.span_data.type == "turn" and _input_trip(span.error):
            with self._lock:
                agent = self._spans.get(entry.agent) if entry.agent else None
            if agent is not None:
                self._discard(agent, entry.start_ns)

    @staticmethod
    def _discard(agent: _Entry, start_ns: int) -> None:
        """The agent's calls started from ``start_ns`` until now were thrown away by the SDK: add the
        window to the agent span's ``agl.discarded.windows`` (the adapter leaves them out)."""
        if agent.otel is None:
            return
        agent.windows += [start_ns, time.time_ns()]
        agent.otel.set_attributes(
            {
                semconv.AGL_DISCARDED_WINDOWS: list(agent.windows),
                semconv.AGL_DISCARDED_REASON: semconv.DISCARDED_INPUT_GUARDRAIL,
            }
        )

    def _match_call(self, agent: str | None, name: str, arguments: str | None) -> str | None:
        if agent is None:
            return None
        with self._lock:
            calls = self._pending_calls.get(agent)
            if not calls:
                return None
            candidates = [i for i, c in enumerate(calls) if c[1] == name]
            exact = [i for i in candidates if arguments is not None and calls[i][2] == arguments]
            chosen = (exact or candidates or [None])[0]
            if chosen is None:
                return None
            return calls.pop(chosen)[0]

    @staticmethod
    def _detach(entry: _Entry, span_id: str) -> None:
        if entry.tokens is None:
            return
        otel_token, mark_token = entry.tokens
        entry.tokens = None
        try:
            _ATTACHED.reset(mark_token)
        except (ValueError, RuntimeError):
            # ended in another context than it started in: the attaching context owns its own
            # copy and drops it when it finishes; detaching here would corrupt this one
            return
        otel_context.detach(otel_token)  # type: ignore[arg-type]
