"""Instrument LangChain / LangGraph through LangChain's own callback system (no patching).

``langchain_core`` builds a callback manager for every run in ``CallbackManager.configure`` and adds
a handler for every *configure hook* registered with
``langchain_core.tracers.context.register_configure_hook`` whose context variable holds one — the
mechanism LangSmith's tracer and ``collect_runs`` use. agl registers one hook whose context variable
defaults to agl's handler, so every run in every thread and task gets it (inheritably: child runs
too) without the user passing ``callbacks=``. ``uninstrument()`` removes the hook and disables the
handler, so managers built before it (runs in flight) stop making spans too.
"""

from __future__ import annotations

import contextvars
import logging
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from agl.instrumentation import Instrumentor

if TYPE_CHECKING:
    from agl.integrations.langchain._handler import AglCallbackHandler

__all__ = ["LangChainInstrumentor"]

logger = logging.getLogger(__name__)


class LangChainInstrumentor(Instrumentor):
    """``invoke_agent`` / ``execute_tool`` spans for LangChain and LangGraph runs (see ``_handler``)."""

    name = "langchain"
    extra = "langchain"
    instruments = ("langchain-core >= 0.3",)

    distributions = ("langchain-core", "langchain", "langchain-openai", "langgraph")

    def __init__(self) -> None:
        super().__init__()
        self._hook: contextvars.ContextVar[Any] | None = None
        self._handler: AglCallbackHandler | None = None

    def _problems(self) -> list[str]:
        """The configure hook must still be registered, and its variable still hold agl's handler."""
        try:
            from langchain_core.tracers import context as lc_context

            hooks = lc_context._configure_hooks
        except (ImportError, AttributeError):
            return ["cannot read LangChain's configure hooks (changed in this langchain-core?)"]
        if not any(entry[0] is self._hook for entry in hooks):
            return ["agl's LangChain configure hook was removed: runs get no spans"]
        if self._hook is not None and self._hook.get() is not self._handler:
            return ["agl's LangChain handler was replaced in this context: runs here get no spans"]
        return []

    @property
    def handler(self) -> AglCallbackHandler | None:
        """The callback handler while instrumented: pass it as ``callbacks=[...]`` where a run's
        callbacks are built without ``CallbackManager.configure`` (rare)."""
        return self._handler

    def _instrument(self, **kwargs: Any) -> None:
        from langchain_core.tracers.context import register_configure_hook

        from agl import __version__
        from agl.integrations.langchain._handler import AglCallbackHandler

        if self._hook is not None:
            return
        tracer = trace.get_tracer(
            "agl.integrations.langchain", __version__, tracer_provider=kwargs.get("tracer_provider")
        )
        handler = AglCallbackHandler(tracer)
        hook: contextvars.ContextVar[Any] = contextvars.ContextVar("agl_langchain_handler", default=handler)
        register_configure_hook(hook, True)
        self._hook, self._handler = hook, handler

    def _uninstrument(self, **kwargs: Any) -> None:
        hook, handler = self._hook, self._handler
        self._hook = self._handler = None
        if handler is not None:
            handler.enabled = False  # runs in flight keep the handler in their managers: make it inert
        if hook is None:
            return
        try:
            from langchain_core.tracers import context as lc_context

            hooks = lc_context._configure_hooks
            hooks[:] = [entry for entry in hooks if entry[0] is not hook]
        except (ImportError, AttributeError, TypeError, IndexError):
            # langchain_core has no public way to unregister; the disabled handler is inert anyway
            logger.warning("agl: could not remove the LangChain configure hook; its handler is disabled")
