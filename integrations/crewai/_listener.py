"""Turns CrewAI's event-bus events into agl's OpenTelemetry spans, in the thread that emits them.

CrewAI reports every crew kickoff, task, agent execution, tool use and LLM call on its event bus, so
that is where agl listens. It does not register through ``crewai_event_bus.on(...)`` though: the bus
runs such handlers later, in a 10-thread ``ThreadPoolExecutor`` (only LLM stream chunks run inline),
which gives a listener three problems agl cannot live with:

- it can never make the agent's span *current* in the thread that then sends the LLM request, so
  the ``openai`` integration's client ``chat`` span (and the gateway span under it, linked by
  ``traceparent``) would not nest under the agent that made the call;
- a "finished" handler may run before its "started" handler (they are separate pool jobs);
- ``CrewKickoffCompletedEvent`` is emitted *after* the bus's final ``flush()`` in ``kickoff``, so its
  handler may run after ``kickoff()`` has returned and the runner has already flushed the attempt.

So the instrumentor wraps ``CrewAIEventsBus.emit`` (reversibly) and hands each event to
:meth:`AglEventListener.observe` right after the bus has prepared it, in the emitting thread and
context. Spans are paired and parented with CrewAI's own event scope ids (``started_event_id``,
``parent_event_id``), so the tree follows CrewAI's structure even across its worker threads. The
``invoke_agent``, ``execute_tool`` and (fallback) ``chat`` spans are also *attached* as the current
OTel context between their start and end events; they are detached only in the very context that
attached them (checked with a marker contextvar), so an end seen elsewhere never corrupts a context
it does not own.
"""

from __future__ import annotations

import contextvars
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from agl import semconv
from agl.instrumentation import guarded, safe_json
from agl.instrumentation.agent import agent_context

__all__ = ["AglEventListener"]

logger = logging.getLogger(__name__)

_OBSERVE = guarded("crewai.event")  # an event agl failed to record; the crew's run goes on

INTEGRATION = "crewai"

#: The entry this contextvars context attached last; tells an end event whether it may detach here.
_ATTACHED: contextvars.ContextVar[object | None] = contextvars.ContextVar("agl_crewai_attached", default=None)

# event type -> kind of span it starts
_STARTS: dict[str, str] = {
    "crew_kickoff_started": "crew",
    "task_started": "task",
    "agent_execution_started": "agent",
    "lite_agent_execution_started": "agent",
    "tool_usage_started": "tool",
    "llm_call_started": "llm",
}
# event type -> (kind of span it ends, failed?)
_ENDS: dict[str, tuple[str, bool]] = {
    "crew_kickoff_completed": ("crew", False),
    "crew_kickoff_failed": ("crew", True),
    "task_completed": ("task", False),
    "task_failed": ("task", True),
    "agent_execution_completed": ("agent", False),
    "agent_execution_error": ("agent", True),
    "lite_agent_execution_completed": ("agent", False),
    "lite_agent_execution_error": ("agent", True),
    "tool_usage_finished": ("tool", False),
    "tool_usage_error": ("tool", True),
    "llm_call_completed": ("llm", False),
    "llm_call_failed": ("llm", True),
}
# tool failures CrewAI reports without a started/finished pair (the model named a missing tool, or
# gave arguments the tool's schema refuses): an instant ERROR execute_tool span each
_INSTANT_TOOL_ERRORS = frozenset({"tool_selection_error", "tool_validate_input_error"})
_ATTACHING = frozenset({"agent", "tool", "llm"})
_MAX_SCOPES = 10_000  # untracked CrewAI scopes remembered (flows, memory, knowledge...); oldest dropped


def _scope_sets() -> tuple[frozenset[str], frozenset[str]]:
    try:
        from crewai.events.event_context import SCOPE_ENDING_EVENTS, SCOPE_STARTING_EVENTS
    except ImportError:  # an older/newer crewai without them: only tracked kinds nest
        return frozenset(), frozenset()
    return frozenset(SCOPE_STARTING_EVENTS), frozenset(SCOPE_ENDING_EVENTS)


@dataclass(eq=False)
class _Entry:
    kind: str
    event_id: str  # the CrewAI event that started it
    key: tuple[Any, ...]
    span: trace.Span | None
    ctx: otel_context.Context  # the context children of this entry start from
    parent: _Entry | None
    agent: _Entry | None  # the nearest agent entry (itself for an agent)
    agent_id: str | None = None
    children: list[_Entry] = field(default_factory=list)
    tokens: tuple[object, contextvars.Token[object | None]] | None = None
    calls: list[tuple[str, str, Any]] = field(default_factory=list)  # agent: tool calls not yet run
    open: bool = True
    # tool: (attributes, error, exception, end time) of a failure not yet settled (see _defer_failure)
    failure: tuple[dict[str, Any], str, BaseException | None, int] | None = None
    failed_tool: _Entry | None = None  # agent: its tool entry whose failure is not settled yet
    instant: bool = False  # tool: a call CrewAI refused without running it
    role: str | None = None  # agent: its gen_ai.agent.name (the role), which its calls' baggage carries


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def _tool_calls(response: Any) -> list[tuple[str, str, Any]]:
    """(call id, tool name, parsed arguments) of the native tool calls an LLM response issued."""
    if not isinstance(response, (list, tuple)):
        return []
    calls: list[tuple[str, str, Any]] = []
    for call in response:
        function = _get(call, "function")
        call_id, name = _get(call, "id"), _get(function, "name") if function is not None else None
        if not call_id or not name:
            continue
        calls.append((str(call_id), str(name), _parse_args(_get(function, "arguments"))))
    return calls


def _parse_args(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _agent_id(event: Any) -> str | None:
    agent = getattr(event, "agent", None)
    if agent is not None and getattr(agent, "id", None) is not None:
        return str(agent.id)
    found = getattr(event, "agent_id", None)
    if found:
        return str(found)
    info = getattr(event, "agent_info", None)
    if isinstance(info, Mapping) and info.get("id"):
        return str(info["id"])
    return None


def _agent_role(event: Any) -> str | None:
    agent = getattr(event, "agent", None)
    role = getattr(agent, "role", None) if agent is not None else None
    if not role:
        role = getattr(event, "agent_role", None)
    if not role:
        info = getattr(event, "agent_info", None)
        if isinstance(info, Mapping):
            role = info.get("role")
    return str(role) if role else None


def _task_id(event: Any) -> str | None:
    found = getattr(event, "task_id", None)
    if found:
        return str(found)
    task = getattr(event, "task", None)
    task_id = getattr(task, "id", None) if task is not None else None
    return str(task_id) if task_id is not None else None


def _key(kind: str, event: Any, source: Any) -> tuple[Any, ...]:
    """A fallback pairing key for when CrewAI's ``started_event_id`` does not name the start."""
    if kind == "crew":
        return ("crew", id(getattr(event, "crew", None) or source))
    if kind == "task":
        return ("task", _task_id(event))
    if kind == "agent":
        return ("agent", _agent_id(event), _task_id(event))
    if kind == "tool":
        return ("tool", _agent_id(event), getattr(event, "tool_name", None))
    return ("llm", getattr(event, "call_id", None))


def _usage(attrs: dict[str, Any], usage: Any) -> None:
    if not isinstance(usage, Mapping):
        return
    for keys, name in (
        (("prompt_tokens", "input_tokens"), semconv.GEN_AI_USAGE_INPUT_TOKENS),
        (("completion_tokens", "output_tokens"), semconv.GEN_AI_USAGE_OUTPUT_TOKENS),
    ):
        for k in keys:
            value = usage.get(k)
            if isinstance(value, int) and not isinstance(value, bool):
                attrs[name] = value
                break


def _assistant_message(response: Any) -> dict[str, Any]:
    calls = [c for c in (response if isinstance(response, (list, tuple)) else ()) if _get(c, "function")]
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": json.loads(safe_json(list(calls)))}
    return {"role": "assistant", "content": response if isinstance(response, str) else safe_json(response)}


class AglEventListener:
    """Mirrors CrewAI's events as agl spans: ``agl.crew`` → ``agl.task`` → ``invoke_agent`` (name =
    the agent's ``role``) → ``execute_tool`` (ERROR when the tool raised or CrewAI reported a tool
    failure), with the LLM calls' ``chat`` spans under the agent that made them.

    ``llm_spans`` says, per LLM call, whether this listener makes the client-side ``chat`` span itself
    (only when the ``openai`` client integration, which makes it with the gateway headers, is off), so
    a call never gets two client spans.
    """

    def __init__(self, tracer: trace.Tracer, *, llm_spans: Callable[[], bool] = lambda: False) -> None:
        self._tracer = tracer
        self._llm_spans = llm_spans
        self._lock = threading.Lock()
        self._by_event: dict[str, _Entry] = {}  # CrewAI start event id -> entry
        self._by_key: dict[tuple[Any, ...], list[_Entry]] = {}
        self._agents: dict[str, list[_Entry]] = {}  # CrewAI agent id -> its open agent entries
        self._scopes: dict[str, str | None] = {}  # untracked scope start id -> its parent event id
        self._unsettled: dict[int, _Entry] = {}  # failed tool entries awaiting _settle, by id()
        self._scope_starts, self._scope_ends = _scope_sets()
        self.enabled = True

    # --------------------------------------------------------------------------------------- entry
    def observe(self, source: Any, event: Any) -> None:
        """Record one event the bus has just prepared; never raises."""
        if not self.enabled:
            return
        try:
            etype = getattr(event, "type", None)
            if not isinstance(etype, str):
                return
            kind = _STARTS.get(etype)
            if kind is not None:
                self._start(kind, source, event)
                return
            end = _ENDS.get(etype)
            if end is not None:
                self._end(end[0], end[1], source, event)
                return
            if etype in _INSTANT_TOOL_ERRORS:
                self._instant_tool_error(source, event)
            elif etype in self._scope_starts:
                with self._lock:
                    if len(self._scopes) >= _MAX_SCOPES:
                        self._scopes.pop(next(iter(self._scopes)))
                    self._scopes[event.event_id] = event.parent_event_id
            elif etype in self._scope_ends:
                started = getattr(event, "started_event_id", None)
                if started:
                    with self._lock:
                        self._scopes.pop(started, None)
        except Exception as exc:  # noqa: BLE001 - never break the user's crew
            _OBSERVE.failed(exc)

    def shutdown(self) -> None:
        """Stop recording and end every span still open (nothing is left half-recorded)."""
        self.enabled = False
        with self._lock:
            entries = [*self._by_event.values(), *self._unsettled.values()]
            self._unsettled.clear()
            self._by_event.clear()
            self._by_key.clear()
            self._agents.clear()
            self._scopes.clear()
        for entry in entries:
            if entry.open and entry.span is not None:
                entry.open = False
                try:
                    entry.span.end()
                except Exception:  # noqa: BLE001
                    pass

    def open_spans(self) -> int:
        """How many spans are open now (tests: nothing may leak after a run)."""
        with self._lock:
            return len(self._by_event) + len(self._unsettled)

    # ------------------------------------------------------------------------------------ internals
    def _parent(self, kind: str, event: Any) -> _Entry | None:
        """The nearest tracked entry above ``event`` in CrewAI's own event scopes, else the open agent
        with the event's agent id (tools run in worker threads without CrewAI's scope stack)."""
        with self._lock:
            pid = getattr(event, "parent_event_id", None)
            seen = 0
            while pid is not None and seen < 1000:
                entry = self._by_event.get(pid)
                if entry is not None:
                    return entry
                pid = self._scopes.get(pid)
                seen += 1
            if kind in ("tool", "llm"):
                agent_id = _agent_id(event)
                if agent_id is not None:
                    agents = self._agents.get(agent_id)
                    if agents:
                        return agents[-1]
        return None

    def _start(self, kind: str, source: Any, event: Any) -> None:
        parent = self._parent(kind, event)
        agent = parent.agent if parent is not None else None
        if agent is not None and agent.failed_tool is not None and kind in ("tool", "llm"):
            failed = agent.failed_tool
            retried = (
                kind == "tool"
                and (getattr(event, "run_attempts", None) or 1) > 1
                and failed.key[2] == getattr(event, "tool_name", None)
            )
            self._settle(failed, retried=retried)
        if kind == "llm" and not self._llm_spans():
            return  # the openai integration makes the client span; the agent's context is current
        current = otel_context.get_current()
        parent_ctx = parent.ctx if parent is not None else current
        name, span_kind, attrs = self._describe(kind, source, event)
        span = self._tracer.start_span(name, context=parent_ctx, kind=span_kind, attributes=attrs)
        agent_id = _agent_id(event) if kind == "agent" else None
        entry = _Entry(
            kind=kind,
            event_id=event.event_id,
            key=_key(kind, event, source),
            span=span,
            # children inherit the emitting context's values (baggage, crewai's crew_context) too
            ctx=trace.set_span_in_context(span, current),
            parent=parent,
            agent=None,
            agent_id=agent_id,
        )
        entry.agent = entry if kind == "agent" else (parent.agent if parent is not None else None)
        if kind == "agent":
            role = attrs.get(semconv.GEN_AI_AGENT_NAME)
            entry.role = role if isinstance(role, str) and role else None
        if entry.agent is not None and entry.agent.role is not None:
            # the agent's (and its tools') LLM calls carry its role: the gateway serves its adapter
            entry.ctx = agent_context(entry.ctx, entry.agent.role)
        if kind == "tool" and entry.agent is not None:
            call_id = self._match_call(entry.agent, getattr(event, "tool_name", None), event)
            if call_id is not None:
                span.set_attribute(semconv.GEN_AI_TOOL_CALL_ID, call_id)
        with self._lock:
            self._by_event[event.event_id] = entry
            self._by_key.setdefault(entry.key, []).append(entry)
            if parent is not None:
                parent.children.append(entry)
            if agent_id is not None:
                self._agents.setdefault(agent_id, []).append(entry)
        if kind in _ATTACHING:
            entry.tokens = (otel_context.attach(entry.ctx), _ATTACHED.set(entry))

    def _describe(self, kind: str, source: Any, event: Any) -> tuple[str, SpanKind, dict[str, Any]]:
        attrs: dict[str, Any] = {semconv.AGL_INTEGRATION: INTEGRATION}
        if kind == "crew":
            crew = getattr(event, "crew", None) or source
            name = getattr(event, "crew_name", None) or getattr(crew, "name", None)
            if name:
                attrs[semconv.AGL_CREW_NAME] = str(name)
            process = getattr(crew, "process", None)
            if process is not None:
                attrs[semconv.AGL_CREW_PROCESS] = str(getattr(process, "value", process))
            return semconv.SPAN_CREW, SpanKind.INTERNAL, attrs
        if kind == "task":
            task_id = _task_id(event)
            if task_id:
                attrs[semconv.AGL_TASK_ID] = task_id
            task_name = getattr(event, "task_name", None)
            if task_name:
                attrs[semconv.AGL_TASK_NAME] = str(task_name)
            return semconv.SPAN_TASK, SpanKind.INTERNAL, attrs
        if kind == "agent":
            attrs[semconv.GEN_AI_OPERATION_NAME] = semconv.OP_INVOKE_AGENT
            role = _agent_role(event)
            if role:
                attrs[semconv.GEN_AI_AGENT_NAME] = role
            agent_id = _agent_id(event)
            if agent_id:
                attrs[semconv.GEN_AI_AGENT_ID] = agent_id
            task_id = _task_id(event)
            if task_id:
                attrs[semconv.AGL_TASK_ID] = task_id
            return semconv.SPAN_INVOKE_AGENT, SpanKind.INTERNAL, attrs
        if kind == "tool":
            attrs[semconv.GEN_AI_OPERATION_NAME] = semconv.OP_EXECUTE_TOOL
            attrs[semconv.GEN_AI_TOOL_NAME] = str(getattr(event, "tool_name", "") or "")
            args = getattr(event, "tool_args", None)
            if args is not None:
                attrs[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] = safe_json(args)
            return semconv.SPAN_EXECUTE_TOOL, SpanKind.INTERNAL, attrs
        # llm (fallback client span)
        attrs[semconv.GEN_AI_OPERATION_NAME] = semconv.OP_CHAT
        attrs[semconv.AGL_SIDE] = semconv.SIDE_CLIENT
        model = getattr(event, "model", None)
        if model:
            attrs[semconv.GEN_AI_REQUEST_MODEL] = str(model)
        messages = getattr(event, "messages", None)
        if messages is not None:
            if isinstance(messages, str):
                messages = [{"role": "user", "content": messages}]
            attrs[semconv.GEN_AI_INPUT_MESSAGES] = safe_json(messages)
        tools = getattr(event, "tools", None)
        if tools:
            attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = safe_json(tools)
        for key, name in (
            ("temperature", semconv.GEN_AI_REQUEST_TEMPERATURE),
            ("top_p", semconv.GEN_AI_REQUEST_TOP_P),
        ):
            value = getattr(event, key, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                attrs[name] = float(value)
        return semconv.SPAN_CHAT, SpanKind.CLIENT, attrs

    def _lookup(self, kind: str, source: Any, event: Any) -> _Entry | None:
        with self._lock:
            started = getattr(event, "started_event_id", None)
            entry = self._by_event.get(started) if started else None
            if entry is not None and entry.kind == kind and entry.open:
                return entry
            stack = self._by_key.get(_key(kind, event, source))
            if stack:
                for candidate in reversed(stack):
                    if candidate.open:
                        return candidate
        return None

    def _end(self, kind: str, failed: bool, source: Any, event: Any) -> None:
        if kind == "llm":
            self._record_calls(event)
        entry = self._lookup(kind, source, event)
        if entry is None:
            if kind == "tool" and failed:  # an error with no start seen: still an error of that call
                self._instant_tool_error(source, event)
            return
        attrs: dict[str, Any] = {}
        error: str | None = None
        exception: BaseException | None = None
        if kind == "tool":
            if failed:
                raw = getattr(event, "error", None)
                exception = raw if isinstance(raw, BaseException) else None
                if exception is not None:
                    attrs[semconv.ERROR_TYPE] = type(exception).__name__
                self._defer_failure(entry, attrs, str(raw) if raw is not None else "tool error", exception)
                return
            else:
                output = getattr(event, "output", None)
                if output is not None:
                    attrs[semconv.GEN_AI_TOOL_CALL_RESULT] = safe_json(output)
                failure = getattr(event, "failure", None)
                if failure is not None:  # CrewAI's own report that the tool did not do its job
                    error = str(getattr(failure, "message", None) or failure)
                    code = getattr(failure, "code", None)
                    if code:
                        attrs[semconv.ERROR_TYPE] = str(code)
        elif kind == "llm":
            if failed:
                error = str(getattr(event, "error", None) or "LLM call failed")
            else:
                response = getattr(event, "response", None)
                attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = safe_json([_assistant_message(response)])
                _usage(attrs, getattr(event, "usage", None))
                finish = getattr(event, "finish_reason", None)
                if finish:
                    attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = [str(finish)]
                response_id = getattr(event, "response_id", None)
                if response_id:
                    attrs[semconv.GEN_AI_RESPONSE_ID] = str(response_id)
        elif failed:
            error = str(getattr(event, "error", None) or f"{kind} failed")
            error_type = getattr(event, "error_type", None)
            if isinstance(error_type, type):
                attrs[semconv.ERROR_TYPE] = error_type.__name__
        self._finish(entry, attrs, error, exception)

    def _finish(
        self,
        entry: _Entry,
        attrs: dict[str, Any],
        error: str | None,
        exception: BaseException | None = None,
    ) -> None:
        if entry.failure is not None:
            self._settle(entry, retried=False)
            return
        with self._lock:
            if not entry.open:
                return
            entry.open = False
            leftovers = [c for c in entry.children if c.open]
        # spans CrewAI never closed (an exception it let through without an end event): end them
        # with their parent, innermost first, so no span and no attached context is left behind
        for child in reversed(leftovers):
            self._finish(child, {}, error and f"ended with its {entry.kind}: {error}")
        self._forget(entry)
        span = entry.span
        try:
            if span is not None:
                if attrs:
                    span.set_attributes(attrs)
                if exception is not None:
                    span.record_exception(exception)
                if error is not None:
                    span.set_status(Status(StatusCode.ERROR, error))
                span.end()
        finally:
            self._detach(entry)

    def _forget(self, entry: _Entry) -> None:
        with self._lock:
            if self._by_event.get(entry.event_id) is entry:
                del self._by_event[entry.event_id]
            stack = self._by_key.get(entry.key)
            if stack is not None:
                stack[:] = [e for e in stack if e is not entry]
                if not stack:
                    del self._by_key[entry.key]
            if entry.agent_id is not None:
                agents = self._agents.get(entry.agent_id)
                if agents is not None:
                    agents[:] = [e for e in agents if e is not entry]
                    if not agents:
                        del self._agents[entry.agent_id]
            if entry.parent is not None:
                entry.parent.children[:] = [c for c in entry.parent.children if c is not entry]
            entry.calls.clear()

    def _defer_failure(
        self, entry: _Entry, attrs: dict[str, Any], error: str, exception: BaseException | None
    ) -> None:
        """A tool execution failed: end its span once it is known whether CrewAI retries the call.

        CrewAI's text-protocol ``ToolUsage`` runs a failing call again by itself (``run_attempts`` 1,
        2, 3) before the model hears of it. The model made one mistake, so only the attempt whose
        failure reaches the model gets ERROR (one AIR penalty per failing call, as with native tool
        calls); an attempt CrewAI retried keeps its exception event and ``agl.tool.retried``. The next
        tool start or LLM call of the same agent (or the agent's end) settles it.
        """
        with self._lock:
            if not entry.open or entry.failure is not None:
                return
            entry.failure = (attrs, error, exception, time.time_ns())
            if self._by_event.get(entry.event_id) is entry:  # no later end event may pair with it
                del self._by_event[entry.event_id]
            stack = self._by_key.get(entry.key)
            if stack is not None:
                stack[:] = [e for e in stack if e is not entry]
                if not stack:
                    del self._by_key[entry.key]
            agent = entry.agent
            previous = agent.failed_tool if agent is not None else None
            if agent is not None:
                agent.failed_tool = entry
            self._unsettled[id(entry)] = entry
        self._detach(entry)
        if previous is not None and previous is not entry:
            self._settle(previous, retried=False)
        if agent is None:
            self._settle(entry, retried=False)

    def _settle(self, entry: _Entry, *, retried: bool) -> None:
        with self._lock:
            failure, entry.failure = entry.failure, None
            if failure is None or not entry.open:
                return
            entry.open = False
            self._unsettled.pop(id(entry), None)
            if entry.agent is not None and entry.agent.failed_tool is entry:
                entry.agent.failed_tool = None
        self._forget(entry)
        attrs, error, exception, end_ns = failure
        span = entry.span
        if span is None:
            return
        if retried:
            attrs[semconv.AGL_TOOL_RETRIED] = True
        span.set_attributes(attrs)
        if exception is not None:
            span.record_exception(exception)
        if not retried:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end_ns)

    @staticmethod
    def _detach(entry: _Entry) -> None:
        tokens, entry.tokens = entry.tokens, None
        if tokens is None:
            return
        otel_token, mark_token = tokens
        try:
            _ATTACHED.reset(mark_token)
        except (ValueError, RuntimeError):
            # ended in another context than it started in: the attaching context owns its copy and
            # drops it when it finishes; detaching here would corrupt this one
            return
        otel_context.detach(otel_token)  # type: ignore[arg-type]

    # ----------------------------------------------------------------------------- tool call ids
    def _record_calls(self, event: Any) -> None:
        """Remember the native tool calls an LLM response issued, on the agent that made the call."""
        calls = _tool_calls(getattr(event, "response", None))
        if not calls:
            return
        parent = self._parent("llm", event)
        agent = parent.agent if parent is not None else None
        if agent is None:
            return
        with self._lock:
            agent.calls[:] = calls

    def _match_call(self, agent: _Entry, name: Any, event: Any) -> str | None:
        args = _parse_args(getattr(event, "tool_args", None))
        with self._lock:
            candidates = [i for i, c in enumerate(agent.calls) if c[1] == name]
            exact = [i for i in candidates if agent.calls[i][2] == args]
            chosen = (exact or candidates or [None])[0]
            if chosen is None:
                return None
            return agent.calls.pop(chosen)[0]

    def _instant_tool_error(self, source: Any, event: Any) -> None:
        """A tool call CrewAI refused before running anything (unknown tool, invalid input), or an
        error whose start was never seen: an ERROR ``execute_tool`` span, settled like a failure.

        CrewAI reports one refused call several times (its ``ToolUsage`` retries the selection), so
        repeats of the same refusal before the agent's next step are the same call: one span.
        """
        parent = self._parent("tool", event)
        agent = parent.agent if parent is not None else None
        name = getattr(event, "tool_name", None)
        with self._lock:
            failed = agent.failed_tool if agent is not None else None
            if failed is not None and failed.instant and failed.key[2] == name:
                return
        ctx = parent.ctx if parent is not None else otel_context.get_current()
        _, span_kind, attrs = self._describe("tool", source, event)
        span = self._tracer.start_span(
            semconv.SPAN_EXECUTE_TOOL, context=ctx, kind=span_kind, attributes=attrs
        )
        entry = _Entry(
            kind="tool",
            event_id=event.event_id,
            key=("tool", _agent_id(event), name),
            span=span,
            ctx=trace.set_span_in_context(span, ctx),
            parent=parent,
            agent=agent,
            instant=True,
        )
        if parent is not None:
            with self._lock:
                parent.children.append(entry)
        raw = getattr(event, "error", None)
        exception = raw if isinstance(raw, BaseException) else None
        failure_attrs = {semconv.ERROR_TYPE: type(exception).__name__} if exception is not None else {}
        self._defer_failure(entry, failure_attrs, str(raw) if raw is not None else str(event.type), exception)
