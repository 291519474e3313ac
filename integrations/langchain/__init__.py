"""agl integration for LangChain and LangGraph (``pip install 'agl[langchain]'``).

After ``agl.instrument()`` every LangChain/LangGraph run inside a rollout produces ``invoke_agent``
spans (one per LangGraph node turn, named agent graph, or top-level ``run_name``), ``execute_tool``
spans (ERROR when a tool failed) and — through the openai integration — the ``chat`` spans of
``ChatOpenAI`` calls nested under the agent that made them. It hooks in through LangChain's callback
system (a configure hook), never by patching models. Importing this module does not import LangChain.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from agl.plugins import hookimpl

if TYPE_CHECKING:
    from agl.instrumentation import Instrumentor
    from agl.integrations.langchain.instrumentor import LangChainInstrumentor

__all__ = ["LangChainInstrumentor", "agl_register_instrumentors"]


@hookimpl
def agl_register_instrumentors(register: Callable[[type[Instrumentor]], None]) -> None:
    from agl.integrations.langchain.instrumentor import LangChainInstrumentor

    register(LangChainInstrumentor)


def __getattr__(name: str) -> object:
    if name == "LangChainInstrumentor":
        from agl.integrations.langchain.instrumentor import LangChainInstrumentor

        return LangChainInstrumentor
    raise AttributeError(name)
