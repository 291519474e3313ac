"""agl integration for the OpenAI Agents SDK (``agents``): agents, tools, handoffs, guardrails as spans.

Registered through the ``agl`` entry-point group like any plugin. Importing this module does not
import the SDK: the Instrumentor imports it only when instrumenting.
"""

from agl.instrumentation.registry import lazy_instrumentors

agl_register_instrumentors, __getattr__, __all__ = lazy_instrumentors(
    "agl.integrations.openai_agents.instrumentor:OpenAIAgentsInstrumentor"
)
