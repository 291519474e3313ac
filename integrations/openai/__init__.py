"""agl integration for the ``openai`` package (client-side ``chat`` spans + trace headers).

Registered through the ``agl`` entry-point group like any plugin. Importing this module does not
import openai: the Instrumentor imports it only when instrumenting.
"""

from __future__ import annotations

from collections.abc import Callable

from agl.instrumentation import Instrumentor
from agl.plugins import hookimpl

__all__ = ["OpenAIInstrumentor", "agl_register_instrumentors"]


@hookimpl
def agl_register_instrumentors(register: Callable[[type[Instrumentor]], None]) -> None:
    from agl.integrations.openai.instrumentor import OpenAIInstrumentor

    register(OpenAIInstrumentor)


def __getattr__(name: str) -> object:
    if name == "OpenAIInstrumentor":
        from agl.integrations.openai.instrumentor import OpenAIInstrumentor

        return OpenAIInstrumentor
    raise AttributeError(name)
