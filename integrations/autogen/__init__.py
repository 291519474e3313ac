"""agl integration for AutoGen AgentChat: agent turns, tool calls and team speaker selection as spans.

Registered through the ``agl`` entry-point group like any plugin. Importing this module does not
import AutoGen: the Instrumentor imports it only when instrumenting.
"""

from agl.instrumentation.registry import lazy_instrumentors

agl_register_instrumentors, __getattr__, __all__ = lazy_instrumentors(
    "agl.integrations.autogen.instrumentor:AutoGenInstrumentor"
)
