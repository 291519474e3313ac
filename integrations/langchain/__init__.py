"""agl integration for LangChain and LangGraph (``pip install 'agl[langchain]'``).

After ``agl.instrument()`` every LangChain/LangGraph run inside a rollout produces ``invoke_agent``
spans (one per LangGraph node turn, named agent graph, or top-level ``run_name``), ``execute_tool``
spans (ERROR when a tool failed) and — through the openai integration — the ``chat`` spans of
``ChatOpenAI`` calls nested under the agent that made them. It hooks in through LangChain's callback
system (a configure hook), never by patching models. Importing this module does not import LangChain.
"""

from agl.instrumentation.registry import lazy_instrumentors

agl_register_instrumentors, __getattr__, __all__ = lazy_instrumentors(
    "agl.integrations.langchain.instrumentor:LangChainInstrumentor"
)
