"""agl integration for the ``openai`` package (client-side ``chat`` spans + trace headers).

Registered through the ``agl`` entry-point group like any plugin. Importing this module does not
import openai: the Instrumentor imports it only when instrumenting.
"""

from agl.instrumentation.registry import lazy_instrumentors

agl_register_instrumentors, __getattr__, __all__ = lazy_instrumentors(
    "agl.integrations.openai.instrumentor:OpenAIInstrumentor"
)
