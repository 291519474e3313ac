"""agl integration for the ``anthropic`` package (client-side ``chat`` spans + trace headers).

Registered through the ``agl`` entry-point group like any plugin. Importing this module does not
import anthropic: the Instrumentor imports it only when instrumenting.
"""

from __future__ import annotations

from collections.abc import Callable

from agl.instrumentation import Instrumentor
from agl.plugins import hookimpl

__all__ = ["AnthropicInstrumentor", "agl_register_instrumentors"]


@hookimpl
def agl_register_instrumentors(register: Callable[[type[Instrumentor]], None]) -> None:
    from agl.integrations.anthropic.instrumentor import AnthropicInstrumentor

    register(AnthropicInstrumentor)


def __getattr__(name: str) -> object:
    if name == "AnthropicInstrumentor":
        from agl.integrations.anthropic.instrumentor import AnthropicInstrumentor

        return AnthropicInstrumentor
    raise AttributeError(name)
