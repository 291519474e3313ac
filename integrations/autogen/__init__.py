"""agl integration for AutoGen AgentChat: agent turns, tool calls and team speaker selection as spans.

Registered through the ``agl`` entry-point group like any plugin. Importing this module does not
import AutoGen: the Instrumentor imports it only when instrumenting.
"""

from __future__ import annotations

from collections.abc import Callable

from agl.instrumentation import Instrumentor
from agl.plugins import hookimpl

__all__ = ["AutoGenInstrumentor", "agl_register_instrumentors"]


@hookimpl
def agl_register_instrumentors(register: Callable[[type[Instrumentor]], None]) -> None:
    from agl.integrations.autogen.instrumentor import AutoGenInstrumentor

    register(AutoGenInstrumentor)


def __getattr__(name: str) -> object:
    if name == "AutoGenInstrumentor":
        from agl.integrations.autogen.instrumentor import AutoGenInstrumentor

        return AutoGenInstrumentor
    raise AttributeError(name)
