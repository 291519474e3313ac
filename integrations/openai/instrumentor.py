"""Instrument the ``openai`` package: one client-side ``chat`` span per LLM call + trace headers.

One patch point per client flavour covers every call (chat completions, responses, ``.parse``,
``.stream`` helpers, ``with_raw_response``), every retry and every framework that talks through the
openai package: ``SyncAPIClient.request`` / ``AsyncAPIClient.request``, the method all resource
methods funnel into. While instrumented it

- opens a ``chat`` span (kind CLIENT) for POSTs to ``/chat/completions`` and ``/responses``, made
  current for the duration of the HTTP call, and records request and response (``_spans``);
- adds W3C ``traceparent`` and ``baggage`` headers to every request it sends (rollout id and attempt
  travel as baggage), so the gateway's server-side span becomes the client span's child; headers the
  caller set explicitly are left alone;
- for streams, wraps ``Stream.__stream__`` / ``AsyncStream.__stream__`` (the generators every stream
  iterates) to assemble the output from the chunks, and ends the span when the stream is exhausted,
  closed, fails or is garbage-collected.

The wrappers are shared with the anthropic integration (the SDKs are generated alike):
:mod:`agl.instrumentation.stainless`. Every patch is a ``wrapt`` wrapper on the class attribute,
restored by ``uninstrument()``. Names are
looked up defensively so a renamed internal (openai 3.x) disables only the part it affects, with a
warning, instead of breaking the import.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from agl.instrumentation import Instrumentor
from agl.instrumentation.stainless import Dialect, instrument_client
from agl.integrations.openai._spans import ChatSpan, classify, request_attributes

__all__ = ["OpenAIInstrumentor"]

# looked up at call time (not bound here), so a patched module function is the one called
_OPENAI = Dialect(
    lambda method, url: classify(method, url),
    lambda api, body: request_attributes(api, body),
    lambda api, span: ChatSpan(api, span),
)


# --------------------------------------------------------------------------------- instrumentor


class OpenAIInstrumentor(Instrumentor):
    """Client-side ``chat`` spans and trace headers for every call made through the openai package."""

    name = "openai"
    extra = "openai"
    instruments = ("openai >= 1.40",)

    distributions = ("openai",)

    def _instrument(self, **kwargs: Any) -> None:
        from agl import __version__

        provider = kwargs.get("tracer_provider")
        tracer = trace.get_tracer(__name__, __version__, tracer_provider=provider)
        instrument_client(self.ledger, tracer, "openai", _OPENAI)

    def _uninstrument(self, **kwargs: Any) -> None:
        self.ledger.unpatch_all()
