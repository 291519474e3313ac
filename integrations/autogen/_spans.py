"""How agl shapes AutoGen's own spans, and the few wrappers for what those spans do not carry.

AutoGen already decides *when* an agent turn or a tool call starts and ends: ``BaseChatAgent.run`` /
``run_stream`` and the group-chat container open ``trace_invoke_agent_span`` around every turn, and
``BaseTool.run_json`` opens ``trace_tool_span`` around every tool run, each with the agent/tool name,
id and description. Those helpers take a ``tracer`` argument that AutoGen's call sites leave unset
(so the spans go to the *global* provider, named ``invoke_agent solver``, kind CLIENT). agl hands
them :class:`AglTracer` instead, which makes the very same spans on agl's provider, in agl's shape:
span names ``invoke_agent`` / ``execute_tool`` (``agl.semconv``), kind INTERNAL, ``agl.integration``.
AutoGen's invoke_agent span is current while the agent calls its model client, so the openai
integration's ``chat`` span (and the gateway's span, through ``traceparent``) nest under it.

What AutoGen's spans lack, wrappers add:

- tool arguments and results, and tool failures that never raise (``FunctionExecutionResult`` with
  ``is_error=True``: malformed JSON arguments, an unknown tool, an MCP error result): the wrapper of
  ``AssistantAgent._execute_tool_call`` sees every tool call with its outcome. It leaves AutoGen's
  span open past the tool run (:class:`ToolCall` claims it) to add the result and the ERROR status,
  and makes the ``execute_tool`` span itself where AutoGen made none;
- a turn span for agents called directly through ``on_messages`` / ``on_messages_stream`` (AutoGen
  opens one only in ``run``, ``run_stream`` and teams); never a second one inside an open turn;
- the agent name of a ``SelectorGroupChat``'s speaker-selection LLM calls (the group chat manager
  makes them outside any agent turn).
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from agl import semconv
from agl.instrumentation import guarded
from agl.instrumentation.agent import agent_context

__all__ = ["AglTracer", "Hooks", "ToolCall"]

logger = logging.getLogger(__name__)

INTEGRATION = "autogen"
SYSTEM = "autogen"
SELECTOR_DESCRIPTION = "selects the next speaker of the group chat"

#: name of the agent whose turn span is current: a second turn span for it is never opened
_TURN: contextvars.ContextVar[str | None] = contextvars.ContextVar("agl_autogen_turn", default=None)
#: the tool call AssistantAgent is executing now (set by the ``_execute_tool_call`` wrapper)
_PENDING: contextvars.ContextVar[ToolCall | None] = contextvars.ContextVar("agl_autogen_tool", default=None)


def _reset(var: contextvars.ContextVar[Any], token: contextvars.Token[Any]) -> None:
    try:
        var.reset(token)
    except ValueError:  # exited in another context (an abandoned async generator): nothing to restore
        pass


def _text(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


class ToolCall:
    """One tool call of an ``AssistantAgent``: what the model asked for and, once run, its span.

    AutoGen's ``execute_tool`` span for this call (if it makes one) is *claimed*: it stays open after
    AutoGen's ``with`` block so that :meth:`finish` can record the result before ending it.
    """

    __slots__ = ("call_id", "name", "arguments", "start_ns", "span", "claimed")

    def __init__(self, call_id: Any, name: Any, arguments: Any) -> None:
        self.call_id = call_id if isinstance(call_id, str) and call_id else None
        self.name = _text(name)
        self.arguments = _text(arguments) if arguments is not None else ""
        self.start_ns = time.time_ns()
        self.span: trace.Span | None = None
        self.claimed = False

    def matches(self, attributes: dict[str, Any]) -> bool:
        if self.claimed:
            return False
        call_id = attributes.get(semconv.GEN_AI_TOOL_CALL_ID)
        if self.call_id is not None and call_id is not None:
            return call_id == self.call_id
        return attributes.get(semconv.GEN_AI_TOOL_NAME) == self.name

    def _ensure_span(self, tracer: trace.Tracer) -> trace.Span:
        if self.span is None:  # AutoGen ran no traced tool: the call still gets its span
            attributes: dict[str, Any] = {
                semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL,
                semconv.GEN_AI_SYSTEM: SYSTEM,
                semconv.GEN_AI_TOOL_NAME: self.name,
                semconv.GEN_AI_TOOL_CALL_ARGUMENTS: self.arguments,
                semconv.AGL_INTEGRATION: INTEGRATION,
            }
            if self.call_id is not None:
                attributes[semconv.GEN_AI_TOOL_CALL_ID] = self.call_id
            self.span = tracer.start_span(
                semconv.SPAN_EXECUTE_TOOL,
                kind=SpanKind.INTERNAL,
                attributes=attributes,
                start_time=self.start_ns,
            )
        return self.span

    def finish(self, tracer: trace.Tracer, outcome: Any) -> None:
        """Record ``_execute_tool_call``'s ``(FunctionCall, FunctionExecutionResult)`` and end the span."""
        result = outcome[1] if isinstance(outcome, tuple) and len(outcome) == 2 else outcome
        span = self._ensure_span(tracer)
        try:
            content = getattr(result, "content", None)
            if content is not None:
                span.set_attribute(semconv.GEN_AI_TOOL_CALL_RESULT, _text(content))
            status = getattr(span, "status", None)
            if (
                getattr(result, "is_error", False)
                and getattr(status, "status_code", None) is not StatusCode.ERROR
            ):
                # a tool that raised has its ERROR status from AutoGen already; one that reported an
                # error without raising (bad arguments, unknown tool, MCP error result) gets it here
                span.set_attribute(semconv.ERROR_TYPE, "tool_error")
                span.set_status(Status(StatusCode.ERROR, _text(content)[:1000]))
        finally:
            span.end()

    def fail(self, tracer: trace.Tracer, exc: BaseException) -> None:
        """``_execute_tool_call`` itself raised (a handoff tool failing, cancellation)."""
        span = self._ensure_span(tracer)
        try:
            if span.is_recording():
                span.record_exception(exc)
                span.set_attribute(semconv.ERROR_TYPE, type(exc).__qualname__)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        finally:
            span.end()


class AglTracer(trace.Tracer):
    """The tracer agl gives AutoGen's span helpers: agl's provider, agl's span names and kind.

    Only spans AutoGen's GenAI helpers make pass through here (``trace_invoke_agent_span``,
    ``trace_tool_span``); their attributes are kept as AutoGen sets them and agl's are added.
    """

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def _shape(
        self, name: str, kind: SpanKind, attributes: Any
    ) -> tuple[str, SpanKind, dict[str, Any], ToolCall | None]:
        attrs = dict(attributes or {})
        claim: ToolCall | None = None
        try:
            op = attrs.get(semconv.GEN_AI_OPERATION_NAME)
            if op == semconv.OP_INVOKE_AGENT:
                name, kind = semconv.SPAN_INVOKE_AGENT, SpanKind.INTERNAL
            elif op == semconv.OP_EXECUTE_TOOL:
                name, kind = semconv.SPAN_EXECUTE_TOOL, SpanKind.INTERNAL
                pending = _PENDING.get()
                if pending is not None and pending.matches(attrs):
                    pending.claimed = True
                    claim = pending
                    attrs[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] = pending.arguments
            attrs[semconv.AGL_INTEGRATION] = INTEGRATION
        except Exception as exc:  # noqa: BLE001
            guarded("autogen.span_attributes").failed(exc)
        return name, kind, attrs, claim

    def start_span(
        self,
        name: str,
        context: Any = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Any = None,
        links: Any = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        name, kind, attrs, _ = self._shape(name, kind, attributes)
        return self._tracer.start_span(
            name,
            context=context,
            kind=kind,
            attributes=attrs,
            links=links,
            start_time=start_time,
            record_exception=record_exception,
            set_status_on_exception=set_status_on_exception,
        )

    @contextmanager  # type: ignore[override]
    def start_as_current_span(
        self,
        name: str,
        context: Any = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Any = None,
        links: Any = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        name, kind, attrs, claim = self._shape(name, kind, attributes)
        with self._tracer.start_as_current_span(
            name,
            context=context,
            kind=kind,
            attributes=attrs,
            links=links,
            start_time=start_time,
            record_exception=record_exception,
            set_status_on_exception=set_status_on_exception,
            end_on_exit=end_on_exit and claim is None,  # a claimed tool span ends in ToolCall.finish
        ) as span:
            if claim is not None:
                claim.span = span
            agent = attrs.get(semconv.GEN_AI_AGENT_NAME) if name == semconv.SPAN_INVOKE_AGENT else None
            if not isinstance(agent, str) or not agent:
                yield span
                return
            # the agent's model calls carry its name (W3C baggage): the gateway serves its adapter
            token = otel_context.attach(agent_context(otel_context.get_current(), agent))
            try:
                yield span
            finally:
                otel_context.detach(token)


class Hooks:
    """The replacement helpers and the wrappers, bound to one tracer (one ``instrument()``)."""

    def __init__(self, tracer: trace.Tracer, original_invoke: Any, original_tool: Any) -> None:
        self.tracer = tracer
        self.autogen_tracer = AglTracer(tracer)
        self._original_invoke = original_invoke
        self._original_tool = original_tool
        self.on_tool_call: Callable[[], None] = lambda: None  # the instrumentor's late-patch check
        self.on_first_turn: Callable[[], None] = lambda: None  # the instrumentor's set-up check
        self._first_turn = True
        self._invoke_helper = self.invoke_agent_helper()

    # ------------------------------------------------ replacements for AutoGen's span helpers
    def invoke_agent_helper(self, original: Any = None) -> Callable[..., Any]:
        """``trace_invoke_agent_span`` as AutoGen's call sites see it while instrumented."""
        original = original or self._original_invoke
        autogen_tracer = self.autogen_tracer
        hooks = self

        @contextmanager
        def trace_invoke_agent_span(*args: Any, **kwargs: Any) -> Iterator[Any]:
            if hooks._first_turn:
                hooks._first_turn = False
                try:
                    hooks.on_first_turn()
                except Exception as exc:  # noqa: BLE001
                    guarded("autogen.set_up_check").failed(exc)
            if kwargs.get("tracer") is None:
                kwargs["tracer"] = autogen_tracer
            agent_name = args[0] if args else kwargs.get("agent_name")
            with original(*args, **kwargs) as span:
                token = _TURN.set(agent_name)
                try:
                    yield span
                finally:
                    _reset(_TURN, token)

        trace_invoke_agent_span.__wrapped__ = original  # type: ignore[attr-defined]
        return trace_invoke_agent_span

    def tool_helper(self, original: Any = None) -> Callable[..., Any]:
        """``trace_tool_span`` as AutoGen's call sites see it while instrumented."""
        original = original or self._original_tool
        autogen_tracer = self.autogen_tracer

        def trace_tool_span(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("tracer") is None:
                kwargs["tracer"] = autogen_tracer
            return original(*args, **kwargs)

        trace_tool_span.__wrapped__ = original  # type: ignore[attr-defined]
        return trace_tool_span

    # --------------------------------------------------------------------------- wrappers
    def _turn(self, agent: Any, name: str | None = None, description: str | None = None) -> Any:
        name = name or _text(getattr(agent, "name", type(agent).__name__))
        if description is None:
            description = getattr(agent, "description", None)
        kwargs: dict[str, Any] = {"tracer": self.autogen_tracer}
        if isinstance(description, str):
            kwargs["agent_description"] = description
        return self._invoke_helper(name, **kwargs)

    def execute_tool_call(self) -> Callable[..., Any]:
        """Wrapper of ``AssistantAgent._execute_tool_call``: every tool call with its outcome."""
        tracer = self.tracer
        hooks = self

        async def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            try:
                hooks.on_tool_call()
                call = kwargs["tool_call"] if "tool_call" in kwargs else args[0]
                pending = ToolCall(getattr(call, "id", None), getattr(call, "name", ""), call.arguments)
            except Exception as exc:  # noqa: BLE001
                guarded("autogen.tool_call").failed(exc)
                return await wrapped(*args, **kwargs)
            token = _PENDING.set(pending)
            try:
                outcome = await wrapped(*args, **kwargs)
            except BaseException as exc:
                try:
                    pending.fail(tracer, exc)
                except Exception as err:  # noqa: BLE001
                    guarded("autogen.tool_failure").failed(err)
                raise
            finally:
                _reset(_PENDING, token)
            try:
                pending.finish(tracer, outcome)
            except Exception as exc:  # noqa: BLE001
                guarded("autogen.tool_result").failed(exc)
            return outcome

        return wrapper

    def on_messages(self) -> Callable[..., Any]:
        """Wrapper of an agent's ``on_messages``: a turn span when called outside one (directly)."""
        hooks = self

        async def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if _TURN.get() == getattr(instance, "name", None):
                return await wrapped(*args, **kwargs)
            with hooks._turn(instance):
                return await wrapped(*args, **kwargs)

        return wrapper

    def on_messages_stream(self) -> Callable[..., Any]:
        """Wrapper of an agent's ``on_messages_stream`` (an async generator), as ``on_messages``."""
        hooks = self

        def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            stream = wrapped(*args, **kwargs)
            if _TURN.get() == getattr(instance, "name", None):
                return stream
            return hooks._turn_stream(instance, stream)

        return wrapper

    async def _turn_stream(self, agent: Any, stream: Any) -> AsyncIterator[Any]:
        async with aclosing(stream):
            with self._turn(agent):
                async for item in stream:
                    yield item

    def select_speaker(self) -> Callable[..., Any]:
        """Wrapper of ``SelectorGroupChatManager._select_speaker``: its LLM calls are the manager's turn."""
        hooks = self

        async def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            name = getattr(instance, "_name", None)
            if not isinstance(name, str) or not name:
                name = type(instance).__name__
            with hooks._turn(instance, name=name, description=SELECTOR_DESCRIPTION):
                return await wrapped(*args, **kwargs)

        return wrapper
