"""Instrument the ``anthropic`` package: one client-side ``chat`` span per Messages call + trace headers.

The anthropic SDK is generated like the openai one (``SyncAPIClient.request`` / ``AsyncAPIClient
.request``, ``Stream.__stream__``), so the same wrappers serve it (:func:`agl.instrumentation.stainless.instrument_client`): ``messages.create`` (sync, async, ``stream=True``),
``messages.stream`` and raw responses all open a span (kind CLIENT) for a ``POST .../v1/messages``,
carry ``traceparent`` and ``baggage`` on every request (so the gateway's span is the client span's
child and lands in the rollout), and streams are recorded when they end. ``uninstrument()`` restores
every patched method.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from agl.instrumentation import Instrumentor
from agl.instrumentation.stainless import Dialect, instrument_client
from agl.integrations.anthropic._spans import MessagesSpan, classify, request_attributes

__all__ = ["AnthropicInstrumentor"]

_ANTHROPIC = Dialect(classify, request_attributes, MessagesSpan)


class AnthropicInstrumentor(Instrumentor):
    """Client-side ``chat`` spans and trace headers for every Messages call made through anthropic."""

    name = "anthropic"
    extra = "anthropic"
    instruments = ("anthropic >= 0.40",)

    distributions = ("anthropic",)

    def _instrument(self, **kwargs: Any) -> None:
        from agl import __version__

        tracer = trace.get_tracer(__name__, __version__, tracer_provider=kwargs.get("tracer_provider"))
        instrument_client(self.ledger, tracer, "anthropic", _ANTHROPIC)

    def _uninstrument(self, **kwargs: Any) -> None:
        self.ledger.unpatch_all()
