"""agl integration for the OpenAI Agents SDK (``agents``): agents, tools, handoffs, guardrails as spans.

Registered through the ``agl`` entry-point group like any plugin. Importing this module does not
import the SDK: the Instrumentor imports it only when instrumenting.
"""

from __future__ import annotations

from collections.abc import Callable

from agl.instrumentation import Instrumentor
from agl.plugins import hookimpl

__all__ = ["OpenAIAgentsInstrumentor", "agl_register_instrumentors"]


@hookimpl
def agl_register_instrumentors(register: Callable[[type[Instrumentor]], None]) -> None:
    from agl.integrations.openai_agents.instrumentor import OpenAIAgentsInstrumentor

    register(OpenAIAgentsInstrumentor)


def __getattr__(name: str) -> object:
    if name == "OpenAIAgentsInstrumentor":
        from agl.integrations.openai_agents.instrumentor import OpenAIAgentsInstrumentor

        return OpenAIAgentsInstrumentor
    raise AttributeError(name)
