"""``agl.agent`` and ``agl.tool``: agent and tool spans for code that uses no agent framework.

A plain-client agent (the ``openai`` client in a loop) gets from these the spans the framework
integrations make, so it is trained like a framework app: ``invoke_agent`` with ``gen_ai.agent.name``
(the LLM calls made inside belong to that agent: transitions carry its name and
``Adapter(agents=[...])`` selects them) and ``execute_tool`` with the tool's name, arguments, result
and call id (ERROR when it raised or returned an error the caller marked, so AIR's ``tool_error``
penalises the LLM call that issued it, matched by the call id when given)::

    @agl.tool                                   # or agl.tool("count_words", is_error=...)
    def count_words(text: str) -> int: ...

    with agl.agent("counter"):                  # or @agl.agent("counter") on the agent function
        reply = client.chat.completions.create(...)
        for call in reply.choices[0].message.tool_calls or []:
            with agl.tool(call.function.name, call_id=call.id, arguments=call.function.arguments) as t:
                t.result(run(call))             # t.error("...") marks a returned error

Both work as context managers (``with`` / ``async with``) and as decorators of sync and async
functions. The spans are made with agl's tracer provider, so they carry the rollout like every other
span; they carry no ``agl.integration``: they are the application's own, not a framework's.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.trace import Status, StatusCode

from agl import semconv as sc
from agl.names import display_name

__all__ = ["SpanHandle", "agent", "agent_context", "request_context", "tool"]

F = TypeVar("F", bound=Callable[..., Any])

#: tool arguments and results longer than this are truncated on the span (with ``…``)
MAX_ATTRIBUTE_CHARS = 16_000


class _AgentScope:
    """Who set the agent baggage of a context: ``name`` (None: removed it) while ``live()``; ``before``
    was the name in the context it was made from, ``outer`` the scope that context had."""

    __slots__ = ("name", "before", "outer", "live")

    def __init__(
        self, name: str | None, before: str | None, outer: _AgentScope | None, live: Callable[[], bool]
    ) -> None:
        self.name, self.before, self.outer, self.live = name, before, outer, live


_SCOPE_KEY = otel_context.create_key("agl.agent_scope")


def _always() -> bool:
    return True


def agent_context(
    ctx: otel_context.Context, name: str | None, *, live: Callable[[], bool] | None = None
) -> otel_context.Context:
    """``ctx`` with the calling agent in its baggage (``agl.agent`` = ``name``), or without one (None).

    Every place that opens an ``invoke_agent`` span (``agl.agent`` here, and each framework
    integration) makes the context the agent's code runs in with this, ``name`` exactly the span's
    ``gen_ai.agent.name``: the instrumented clients send the baggage on each request, and the gateway
    serves the call with that agent's adapter. None removes a name inherited from an enclosing agent
    (code that runs outside any agent is served by the base model). The baggage ends with the context:
    detaching it (when the span ends) restores the enclosing agent's name.

    ``live`` is for an integration that cannot always detach the context it attached (LangChain ends
    async runs in a copy of the caller's context): once ``live()`` is false, :func:`request_context`
    sends the name that was there before, so a leaked context never names a finished agent.
    """
    name = display_name(name)  # the name people see (agl.names): what the spans and the adapter say
    before = baggage.get_baggage(sc.BAGGAGE_AGENT, ctx)
    outer = otel_context.get_value(_SCOPE_KEY, ctx)
    if name:
        if before != name:
            ctx = baggage.set_baggage(sc.BAGGAGE_AGENT, name, ctx)
    elif before is not None:
        ctx = baggage.remove_baggage(sc.BAGGAGE_AGENT, ctx)
    if live is None and outer is None:
        return ctx  # nothing can go stale: no scope to record
    kept = before if isinstance(before, str) else None
    scope = _AgentScope(
        name or None, kept, outer if isinstance(outer, _AgentScope) else None, live or _always
    )
    return otel_context.set_value(_SCOPE_KEY, scope, ctx)


def request_context(ctx: otel_context.Context) -> otel_context.Context:
    """The context whose baggage an outgoing request carries: ``ctx``, unless the agent scope that set
    its ``agl.agent`` has ended (a leaked context, see :func:`agent_context`); then the name of the
    nearest scope still live around it, or of none."""
    scope = otel_context.get_value(_SCOPE_KEY, ctx)
    if scope is None or scope.live():  # type: ignore[attr-defined]
        return ctx
    name: str | None = None
    while isinstance(scope, _AgentScope) and not scope.live():
        name, scope = scope.before, scope.outer
    if name:
        return baggage.set_baggage(sc.BAGGAGE_AGENT, name, ctx)
    return baggage.remove_baggage(sc.BAGGAGE_AGENT, ctx)


class SpanHandle:
    """One open agent or tool span: what ``with agl.tool(...) as t`` gives."""

    def __init__(self, span: Any, token: object) -> None:
        self.span = span
        self._token = token
        self._error: str | None = None

    def result(self, value: Any) -> None:
        """Record the tool's result (``gen_ai.tool.call.result``)."""
        from agl.instrumentation.toolkit import safe_json

        self.span.set_attribute(sc.GEN_AI_TOOL_CALL_RESULT, safe_json(value, MAX_ATTRIBUTE_CHARS))

    def error(self, message: str, error_type: str = "ToolError") -> None:
        """Mark the span failed without an exception (a tool that returned an error message)."""
        if not isinstance(message, str):
            raise TypeError(f"error() takes the error message as a str, got {type(message).__name__}")
        self._error = message
        self.span.set_attribute(sc.ERROR_TYPE, error_type)

    def _close(self, exc: BaseException | None) -> None:
        try:
            if exc is not None and isinstance(exc, Exception):
                self.span.record_exception(exc)
                self.span.set_attribute(sc.ERROR_TYPE, type(exc).__qualname__)
                self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            elif self._error is not None:
                self.span.set_status(Status(StatusCode.ERROR, self._error))
        finally:
            otel_context.detach(self._token)  # type: ignore[arg-type]
            self.span.end()


class _Spec:
    """What span to open: a context manager (one open span per ``with``) and a decorator."""

    def __init__(self, span_name: str, name: str | None, attributes: dict[str, Any]) -> None:
        self.span_name = span_name
        self.name = name
        self.attributes = attributes
        self._open: list[SpanHandle] = []

    def _start(self, name: str, extra: dict[str, Any] | None = None) -> SpanHandle:
        from agl.tracing.provider import get_tracer

        attrs = {**self.attributes, **(extra or {})}
        attrs[sc.GEN_AI_AGENT_NAME if self.span_name == sc.SPAN_INVOKE_AGENT else sc.GEN_AI_TOOL_NAME] = name
        span = get_tracer("agl").start_span(self.span_name, attributes=attrs)
        ctx = trace.set_span_in_context(span)
        if self.span_name == sc.SPAN_INVOKE_AGENT:
            # the calls inside carry the agent's name to the gateway, which serves them with its adapter
            ctx = agent_context(ctx, name)
        return SpanHandle(span, otel_context.attach(ctx))

    # ------------------------------------------------------------------------- context manager
    def __enter__(self) -> SpanHandle:
        if not self.name:
            raise TypeError(f"{self.span_name}: a name is needed when used as a context manager")
        handle = self._start(self.name)
        self._open.append(handle)
        return handle

    def __exit__(self, tp: Any, exc: BaseException | None, tb: Any) -> None:
        self._open.pop()._close(exc)

    async def __aenter__(self) -> SpanHandle:
        return self.__enter__()

    async def __aexit__(self, tp: Any, exc: BaseException | None, tb: Any) -> None:
        self.__exit__(tp, exc, tb)

    # ------------------------------------------------------------------------------- decorator
    def _call_attributes(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        return {}

    def _finish(self, handle: SpanHandle, value: Any) -> None:
        pass

    def __call__(self, fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"{self.span_name} decorates a function, got {fn!r}")
        name = self.name or getattr(fn, "__name__", "") or type(fn).__name__

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                handle = self._start(name, self._call_attributes(fn, args, kwargs))
                try:
                    value = await fn(*args, **kwargs)
                    self._finish(handle, value)
                except BaseException as exc:
                    handle._close(exc)
                    raise
                handle._close(None)
                return value

            return run_async  # type: ignore[return-value]

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            handle = self._start(name, self._call_attributes(fn, args, kwargs))
            try:
                value = fn(*args, **kwargs)
                self._finish(handle, value)
            except BaseException as exc:
                handle._close(exc)
                raise
            handle._close(None)
            return value

        return run  # type: ignore[return-value]


class _ToolSpec(_Spec):
    def __init__(
        self, name: str | None, attributes: dict[str, Any], is_error: Callable[[Any], Any] | None
    ) -> None:
        super().__init__(sc.SPAN_EXECUTE_TOOL, name, attributes)
        self.is_error = is_error

    def _call_attributes(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        from agl.instrumentation.toolkit import safe_json

        try:
            bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
        except (TypeError, ValueError):
            bound = {"args": list(args), **kwargs}
        return {sc.GEN_AI_TOOL_CALL_ARGUMENTS: safe_json(dict(bound), MAX_ATTRIBUTE_CHARS)}

    def _finish(self, handle: SpanHandle, value: Any) -> None:
        handle.result(value)
        if self.is_error is not None:
            marked = self.is_error(value)
            if marked:
                handle.error(marked if isinstance(marked, str) else str(value))


def agent(name: str | Callable[..., Any], *, agent_id: str | None = None) -> Any:
    """An ``invoke_agent`` span named ``name``: the LLM calls inside are that agent's.

    ``with agl.agent("planner"):``, ``@agl.agent("planner")`` or bare ``@agl.agent`` (the function's
    name). ``agent_id`` sets ``gen_ai.agent.id``.
    """
    attrs: dict[str, Any] = {sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT}
    if agent_id is not None:
        attrs[sc.GEN_AI_AGENT_ID] = str(agent_id)
    if callable(name):
        return _Spec(sc.SPAN_INVOKE_AGENT, None, attrs)(name)
    if not isinstance(name, str) or not name:
        raise ValueError(f"agl.agent needs the agent's name as a non-empty str, got {name!r}")
    return _Spec(sc.SPAN_INVOKE_AGENT, name, attrs)


def tool(
    name: str | Callable[..., Any] | None = None,
    *,
    call_id: str | None = None,
    arguments: Any = None,
    is_error: Callable[[Any], Any] | None = None,
) -> Any:
    """An ``execute_tool`` span for one tool call.

    As a context manager it needs ``name``; ``call_id`` (the ``tool_calls[i].id`` of the LLM reply)
    lets AIR credit the call that issued it, ``arguments`` is recorded as given (a JSON string or an
    object), and the handle's ``result(value)`` / ``error(message)`` record the outcome. As a
    decorator (``@agl.tool`` or ``@agl.tool("name", is_error=...)``) the arguments and the return
    value are recorded from the call; ``is_error(result)`` returning true (or an error message) marks
    a returned error. A raised exception always marks the span ERROR and propagates.
    """
    if callable(name):
        return _ToolSpec(None, {sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL}, None)(name)
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"agl.tool's name must be a non-empty str, got {name!r}")
    attrs: dict[str, Any] = {sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL}
    if call_id is not None:
        attrs[sc.GEN_AI_TOOL_CALL_ID] = str(call_id)
    if arguments is not None:
        from agl.instrumentation.toolkit import safe_json

        attrs[sc.GEN_AI_TOOL_CALL_ARGUMENTS] = safe_json(arguments, MAX_ATTRIBUTE_CHARS)
    return _ToolSpec(name, attrs, is_error)
