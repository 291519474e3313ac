"""Instrument the OpenAI Agents SDK through its own extension point: trace processors.

``instrument()`` registers one :class:`~agl.integrations.openai_agents._processor.AglTracingProcessor`
with the SDK's trace provider (``agents.add_trace_processor``); ``uninstrument()`` takes exactly that
processor out again and restores the processor list it changed. Nothing in the SDK is patched.

The SDK's own exporter (a ``BatchTraceProcessor`` uploading to OpenAI's tracing backend) is left in
place by default: agl does not change what the application already sends. Offline it cannot reach
the backend, so when asked — ``instrument(replace_exporter=True)`` or the environment variable
``AGL_OPENAI_AGENTS_REPLACE_EXPORTER=1`` — agl *replaces* the SDK's processors with its own
(``set_trace_processors([agl])``) and puts the previous ones back on ``uninstrument()``. Do not use
``OPENAI_AGENTS_DISABLE_TRACING`` or ``RunConfig(tracing_disabled=True)`` for that: they switch off
every processor, agl's included.

An application that replaces the SDK's processors itself after ``agl.instrument()`` —
``agents.set_trace_processors([...])``, typically to drop OpenAI's uploader offline — would silently
remove agl's processor too (every agent turn would lose its span). So while instrumented, agl wraps
the trace provider's ``set_processors`` (what ``set_trace_processors`` calls, however it was imported)
and keeps its own processor registered after the application's list; the application's processors
are exactly the ones it set. ``uninstrument()`` removes the wrapper. ``agl doctor`` reports the
processor missing if a custom trace provider (``set_trace_provider``) dropped it anyway.
"""

from __future__ import annotations

import logging
import os
from typing import Any, ClassVar

from opentelemetry import trace

from agl.instrumentation import Instrumentor, guarded, is_instrumented

__all__ = ["REPLACE_EXPORTER_ENV", "OpenAIAgentsInstrumentor"]

logger = logging.getLogger(__name__)

REPLACE_EXPORTER_ENV = "AGL_OPENAI_AGENTS_REPLACE_EXPORTER"
_TRUE = frozenset({"1", "true", "yes", "on"})


def _env_replace() -> bool:
    return os.environ.get(REPLACE_EXPORTER_ENV, "").strip().lower() in _TRUE


def _openai_client_instrumented() -> bool:
    """Whether the ``openai`` client integration makes the LLM calls' client spans itself."""
    return is_instrumented("openai")


def _processors(provider: Any) -> tuple[Any, ...] | None:
    """The provider's current processor list, where the SDK lets us read it (it has no public getter)."""
    multi = getattr(provider, "_multi_processor", None)
    found = getattr(multi, "_processors", None)
    return tuple(found) if isinstance(found, (tuple, list)) else None


def _keep_registered(processor: Any, owner: OpenAIAgentsInstrumentor) -> Any:
    """A wrapper for ``TraceProvider.set_processors`` that keeps ``processor`` after the new list.

    The application's list is its choice from then on: ``uninstrument()`` leaves it (minus agl's
    processor) instead of restoring the list a ``replace_exporter`` instrument replaced.
    """

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        owner._replaced = None
        with guarded("openai_agents.set_processors"):
            if processor.enabled and instance is not None:
                current = _processors(instance)
                if current is not None and not any(p is processor for p in current):
                    instance.register_processor(processor)
                    logger.info(
                        "agl: the application replaced the Agents SDK's trace processors; agl kept its "
                        "own processor registered after them"
                    )
        return result

    return wrapper


class OpenAIAgentsInstrumentor(Instrumentor):
    """agl integration for the OpenAI Agents SDK (``pip install 'agl[openai-agents]'``).

    Spans: ``invoke_agent`` per agent (``gen_ai.agent.name`` = ``Agent.name``), ``execute_tool`` per
    function tool call (ERROR when the tool raised, even though the SDK hands the model an error
    message instead of raising), ``agl.handoff``, ``agl.guardrail``. LLM calls are the ``openai``
    client integration's ``chat`` spans, nested under the calling agent; if that integration is not
    instrumented, the SDK's generation/response spans become the client ``chat`` spans instead.
    """

    name: ClassVar[str] = "openai_agents"
    extra: ClassVar[str] = "openai-agents"
    instruments: ClassVar[tuple[str, ...]] = ("openai-agents >= 0.20.0",)
    distributions: ClassVar[tuple[str, ...]] = ("openai-agents", "openai")

    def __init__(self) -> None:
        super().__init__()
        self._processor: Any = None
        self._replaced: tuple[Any, ...] | None = None  # processor list before a replace_exporter instrument

    @property
    def processor(self) -> Any:
        """The SDK trace processor agl registered (None when not instrumented)."""
        return self._processor

    def _instrument(self, **kwargs: Any) -> None:
        from agents.tracing import get_trace_provider

        from agl.integrations.openai_agents._processor import AglTracingProcessor

        tracer_provider = kwargs.get("tracer_provider")
        tracer = trace.get_tracer(__name__, tracer_provider=tracer_provider)
        processor = AglTracingProcessor(tracer, llm_spans=lambda: not _openai_client_instrumented())
        replace = kwargs.get("replace_exporter")
        if replace is None:
            replace = _env_replace()
        provider = get_trace_provider()
        if replace:
            self._replaced = _processors(provider)
            provider.set_processors([processor])
        else:
            self._replaced = None
            provider.register_processor(processor)
        self._processor = processor
        self.ledger.wrap(
            (type(provider), "set_processors"),
            _keep_registered(processor, self),
            optional="an application that replaces the SDK's processors will drop agl's",
        )

    def _problems(self) -> list[str]:
        from agents.tracing import get_trace_provider

        problems = self.ledger.problems()
        current = _processors(get_trace_provider())
        if current is not None and not any(p is self._processor for p in current):
            problems.append(
                "agl's trace processor is no longer registered with the Agents SDK: agent and tool "
                "spans are lost (a custom trace provider?)"
            )
        return problems

    def _uninstrument(self, **kwargs: Any) -> None:
        from agents.tracing import get_trace_provider

        self.ledger.unpatch_all()  # before set_processors below: that must not re-add agl's

        processor, self._processor = self._processor, None
        replaced, self._replaced = self._replaced, None
        if processor is None:
            return
        processor.enabled = False
        provider = get_trace_provider()
        current = _processors(provider)
        if current is None:
            if replaced is not None:
                provider.set_processors(list(replaced))
            else:
                logger.warning(
                    "agl: cannot read the Agents SDK's processor list (%s); agl's processor stays "
                    "registered but inactive",
                    type(provider).__name__,
                )
            return
        if not any(p is processor for p in current):
            processor.shutdown()  # the app set its own processor list since: leave it as it is
            return
        rest = [p for p in current if p is not processor]
        if replaced is not None:  # put back what was there, plus anything the app added since
            rest = [*replaced, *(p for p in rest if not any(p is r for r in replaced))]
        provider.set_processors(rest)
        processor.shutdown()
