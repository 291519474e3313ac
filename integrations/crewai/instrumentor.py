"""Instrument CrewAI through its event bus: every crew, task, agent execution, tool use and LLM call.

``instrument()`` wraps ``CrewAIEventsBus.emit`` (one ``wrapt`` wrapper on the class attribute) so each
event, right after the bus has prepared it, also reaches agl's
:class:`~agl.integrations.crewai._listener.AglEventListener` in the emitting thread — why not through
``crewai_event_bus.on(...)`` is explained in ``_listener``. The bus's own handlers, and therefore the
application's listeners, run exactly as before. ``uninstrument()`` restores ``emit`` (the patches go
through the integration's ``PatchLedger``) and ends any span still open.

LLM calls: CrewAI's native OpenAI provider (``LLM(model="openai/...", base_url=...)``) sends through
the ``openai`` package, so with the ``openai`` integration instrumented (``agl.instrument()`` does both)
that integration makes the client ``chat`` span and adds ``traceparent``/``baggage``; this one makes
the calling agent's ``invoke_agent`` span the current context for the call, so the chat span (and
the gateway's span under it) nest under the agent. With the ``openai`` integration *off*, this
integration makes the client ``chat`` span itself from CrewAI's LLM events and adds the W3C headers to
the native OpenAI provider's requests itself (a wrapper on ``OpenAICompletion._prepare_completion_params``
/ ``_prepare_responses_params`` that adds ``extra_headers``; headers the application set win).

CrewAI's own telemetry and tracing are left as they are: agl neither reads nor changes
``CREWAI_DISABLE_TELEMETRY``/``CREWAI_TRACING_ENABLED`` (set them to keep CrewAI offline), never sets
``OTEL_SDK_DISABLED``, and CrewAI's telemetry uses a private TracerProvider that agl does not touch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from agl.instrumentation import Instrumentor, guarded, is_instrumented
from agl.instrumentation.agent import request_context

__all__ = ["CrewAIInstrumentor"]

logger = logging.getLogger(__name__)

_EMIT_TARGET = "crewai.events.event_bus:CrewAIEventsBus.emit"
_HEADER_TARGETS = (
    "crewai.llms.providers.openai.completion:OpenAICompletion._prepare_completion_params",
    "crewai.llms.providers.openai.completion:OpenAICompletion._prepare_responses_params",
)
_TRACECONTEXT = TraceContextTextMapPropagator()
_BAGGAGE = W3CBaggagePropagator()
_HEADERS = guarded("crewai.trace_headers")


def _openai_client_instrumented() -> bool:
    """Whether the ``openai`` client integration makes the LLM calls' client spans and headers."""
    return is_instrumented("openai")


def _event_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    source = kwargs["source"] if "source" in kwargs else (args[0] if args else None)
    event = kwargs["event"] if "event" in kwargs else (args[1] if len(args) > 1 else None)
    return source, event


def _emit_wrapper(listener: Any) -> Callable[..., Any]:
    def wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            source, event = _event_of(args, kwargs)
        except Exception:  # noqa: BLE001 - an unexpected signature: record nothing, change nothing
            return result
        listener.observe(source, event)
        return result

    return wrapper


def _trace_headers() -> dict[str, str]:
    carrier: dict[str, str] = {}
    ctx = request_context(otel_context.get_current())
    _TRACECONTEXT.inject(carrier, context=ctx)
    _BAGGAGE.inject(carrier, context=ctx)
    return carrier


def _headers_wrapper(enabled: Callable[[], bool]) -> Callable[..., Any]:
    """Adds ``traceparent``/``baggage`` as ``extra_headers`` to the request the provider prepares."""

    def wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        params = wrapped(*args, **kwargs)
        try:
            if not enabled() or not isinstance(params, dict):
                return params
            carrier = _trace_headers()
            if not carrier:
                return params
            existing = params.get("extra_headers")
            existing = dict(existing) if isinstance(existing, Mapping) else {}
            present = {str(k).lower() for k in existing}
            present.update(str(k).lower() for k in (getattr(instance, "default_headers", None) or {}))
            extra = {k: v for k, v in carrier.items() if k.lower() not in present}
            if extra:
                params = {**params, "extra_headers": {**existing, **extra}}
        except Exception as exc:  # noqa: BLE001 - the call goes out as the provider prepared it
            _HEADERS.failed(exc)
        return params

    return wrapper


class CrewAIInstrumentor(Instrumentor):
    """agl integration for CrewAI (``pip install 'agl[crewai]'``).

    Spans: ``agl.crew`` per kickoff → ``agl.task`` per task → ``invoke_agent`` per agent execution
    (``gen_ai.agent.name`` = the agent's ``role``) → ``execute_tool`` per tool use (ERROR when the
    tool raised — CrewAI catches that and tells the agent — or CrewAI reported a tool failure, with
    ``gen_ai.tool.call.id`` for native tool calls) and the LLM calls' ``chat`` spans. Sequential and
    hierarchical processes (the manager's delegations nest the coworker's agent span under the
    delegating tool span), ``kickoff``/``kickoff_async``/``akickoff``, streaming crews.
    """

    name: ClassVar[str] = "crewai"
    extra: ClassVar[str] = "crewai"
    instruments: ClassVar[tuple[str, ...]] = ("crewai >= 1.15.30",)

    distributions: ClassVar[tuple[str, ...]] = ("crewai",)

    def __init__(self) -> None:
        super().__init__()
        self._listener: Any = None

    @property
    def listener(self) -> Any:
        """The listener agl attached to CrewAI's event bus (None when not instrumented)."""
        return self._listener

    def _instrument(self, **kwargs: Any) -> None:
        from agl import __version__
        from agl.integrations.crewai._listener import AglEventListener

        tracer = trace.get_tracer(__name__, __version__, tracer_provider=kwargs.get("tracer_provider"))
        fallback = lambda: not _openai_client_instrumented()  # noqa: E731
        listener = AglEventListener(tracer, llm_spans=fallback)
        self.ledger.wrap(_EMIT_TARGET, _emit_wrapper(listener))
        for target in _HEADER_TARGETS:
            self.ledger.wrap(
                target,
                _headers_wrapper(fallback),
                optional="its requests get no trace headers unless the openai integration is instrumented",
            )
        self._listener = listener

    def _uninstrument(self, **kwargs: Any) -> None:
        self.ledger.unpatch_all()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.shutdown()
