"""agl integration for CrewAI: crews, tasks, agents (by ``role``), tools and LLM calls as spans.

Registered through the ``agl`` entry-point group like any plugin. Importing this module does not
import CrewAI: the Instrumentor imports it only when instrumenting.
"""

from __future__ import annotations

from collections.abc import Callable

from agl.instrumentation import Instrumentor
from agl.plugins import hookimpl

__all__ = ["CrewAIInstrumentor", "agl_register_instrumentors"]


@hookimpl
def agl_register_instrumentors(register: Callable[[type[Instrumentor]], None]) -> None:
    from agl.integrations.crewai.instrumentor import CrewAIInstrumentor

    register(CrewAIInstrumentor)


def __getattr__(name: str) -> object:
    if name == "CrewAIInstrumentor":
        from agl.integrations.crewai.instrumentor import CrewAIInstrumentor

        return CrewAIInstrumentor
    raise AttributeError(name)
