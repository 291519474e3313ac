"""agl integration for CrewAI: crews, tasks, agents (by ``role``), tools and LLM calls as spans.

Registered through the ``agl`` entry-point group like any plugin. Importing this module does not
import CrewAI: the Instrumentor imports it only when instrumenting.
"""

from agl.instrumentation.registry import lazy_instrumentors

agl_register_instrumentors, __getattr__, __all__ = lazy_instrumentors(
    "agl.integrations.crewai.instrumentor:CrewAIInstrumentor"
)
