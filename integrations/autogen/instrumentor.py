"""Instrument AutoGen AgentChat (``autogen-agentchat`` 0.7+) through its own OpenTelemetry spans.

AutoGen opens a GenAI ``invoke_agent`` span around every agent turn (``BaseChatAgent.run`` /
``run_stream``, and the group-chat container for every turn in a team) and an ``execute_tool`` span
around every tool run (``BaseTool.run_json``), through two helpers whose ``tracer`` argument its call
sites leave unset. ``instrument()`` replaces the helper *names* at those call sites with versions that
pass agl's tracer (:class:`~agl.integrations.autogen._spans.AglTracer`), so AutoGen keeps deciding
when spans start and end and which attributes they carry, and the spans land on agl's provider in
agl's shape. Wrappers cover only what those spans do not give (see ``_spans``): tool arguments,
results and non-raising tool errors (``AssistantAgent._execute_tool_call``), a turn span for agents
called directly through ``on_messages``/``on_messages_stream``, and the agent name of a
``SelectorGroupChat``'s speaker-selection LLM calls.

LLM calls: ``OpenAIChatCompletionClient`` talks through the ``openai`` package, so the ``openai``
integration makes their ``chat`` spans (and sends ``traceparent``); they nest under the turn span
because AutoGen's span is current while the agent awaits its model client.

Why not AutoGen's event logger (``autogen_core.EVENT_LOGGER_NAME``)? Its ``ToolCallEvent`` is logged
after the tool's span has ended and only when the tool succeeded, AssistantAgent's tool-call events
go to a second logger at DEBUG, and ``LLMCallEvent`` duplicates the openai integration's span; the
logger is silent at the default WARNING level, and enabling it would make the application's own
handlers print AutoGen's events. The spans carry everything agl needs without touching logging.

Every replacement goes through the integration's patch ledger (``agl.instrumentation.PatchLedger``) and
is put back by ``uninstrument()`` (only where it is still agl's), so nothing is left patched. AutoGen's runtime messaging spans (``autogen publish ...``) and its
``create_agent`` spans are left as they are, on the global provider.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from typing import Any, ClassVar

from opentelemetry import trace

from agl.instrumentation import Instrumentor, guarded, is_instrumented

__all__ = ["AutoGenInstrumentor"]

logger = logging.getLogger(__name__)

_TELEMETRY = "autogen_core._telemetry"
#: (module, global name, which replacement): AutoGen's call sites of its GenAI span helpers
_HELPER_SITES: tuple[tuple[str, str, str], ...] = (
    ("autogen_agentchat.agents._base_chat_agent", "trace_invoke_agent_span", "invoke"),
    ("autogen_agentchat.teams._group_chat._chat_agent_container", "trace_invoke_agent_span", "invoke"),
    ("autogen_core.tools._base", "trace_tool_span", "tool"),
)
#: call sites in modules agl does not import itself (heavy optional deps): patched once they appear
_LATE_HELPER_SITES: tuple[tuple[str, str, str], ...] = (
    ("autogen_ext.tools.mcp._workbench", "trace_tool_span", "tool"),
)
_AGENTS_MODULE = "autogen_agentchat.agents"
_AGENT_CLASSES = (
    "AssistantAgent",
    "CodeExecutorAgent",
    "SocietyOfMindAgent",
    "UserProxyAgent",
    "MessageFilterAgent",
)
_TOOL_CALL = ("autogen_agentchat.agents._assistant_agent", "AssistantAgent", "_execute_tool_call")
_SELECTOR = (
    "autogen_agentchat.teams._group_chat._selector_group_chat",
    "SelectorGroupChatManager",
    "_select_speaker",
)


def _check_llm_tracing() -> None:
    """At the first agent turn: warn when nothing will trace the agents' LLM calls."""
    if not is_instrumented("openai"):
        logger.warning(
            "agl: the 'openai' integration is not instrumented, so the LLM calls of AutoGen's "
            "OpenAIChatCompletionClient get no chat spans and no traceparent and cannot be attributed "
            "to agents; use agl.instrument() or agl.instrument('autogen', 'openai')"
        )


class AutoGenInstrumentor(Instrumentor):
    """agl integration for AutoGen AgentChat (``pip install 'agl[autogen]'``).

    Spans: ``invoke_agent`` per agent turn (``gen_ai.agent.name`` = the AutoGen agent's ``name``; the
    speaker selection of a ``SelectorGroupChat`` is a turn of its group chat manager), ``execute_tool``
    per tool call (name, call id, arguments, result; ERROR when the tool raised or AutoGen reported the
    call as an error). LLM calls are the ``openai`` integration's ``chat`` spans, nested under the turn.
    """

    name: ClassVar[str] = "autogen"
    extra: ClassVar[str] = "autogen"
    instruments: ClassVar[tuple[str, ...]] = ("autogen-agentchat >= 0.7.5", "autogen-core >= 0.7.5")

    distributions: ClassVar[tuple[str, ...]] = ("autogen-agentchat", "autogen-core", "autogen-ext")

    def __init__(self) -> None:
        super().__init__()
        self._hooks: Any = None
        self._late_done: set[str] = set()
        self._late_lock = threading.Lock()

    @property
    def patches(self) -> list[tuple[Any, str]]:
        """(owner, attribute) of everything agl replaced (tests compare them before and after)."""
        return self.ledger.patches

    # ------------------------------------------------------------------------------ patching
    def _patch_site(self, module: Any, attr: str, which: str) -> None:
        hooks = self._hooks
        make = hooks.invoke_agent_helper if which == "invoke" else hooks.tool_helper
        self.ledger.replace(
            (module, attr), make, optional=f"AutoGen's {attr} calls in {module.__name__} are not instrumented"
        )

    def _patch_late_sites(self) -> None:
        """Patch call sites of modules imported since ``instrument()`` (cheap when nothing is new)."""
        if len(self._late_done) == len(_LATE_HELPER_SITES) or self._hooks is None:
            return
        for module_name, attr, which in _LATE_HELPER_SITES:
            if module_name in self._late_done:
                continue
            module = sys.modules.get(module_name)
            if module is None:
                continue
            with self._late_lock:
                if module_name in self._late_done or self._hooks is None:
                    continue
                self._late_done.add(module_name)
                with guarded("autogen.late_patch"):  # never break the user's run
                    self._patch_site(module, attr, which)

    def _instrument(self, **kwargs: Any) -> None:
        from agl import __version__
        from agl.integrations.autogen._spans import Hooks

        telemetry = importlib.import_module(_TELEMETRY)
        tracer = trace.get_tracer(__name__, __version__, tracer_provider=kwargs.get("tracer_provider"))
        hooks = Hooks(tracer, telemetry.trace_invoke_agent_span, telemetry.trace_tool_span)
        hooks.on_tool_call = self._patch_late_sites
        hooks.on_first_turn = _check_llm_tracing
        self._hooks = hooks
        self._late_done = set()
        try:
            for module_name, attr, which in _HELPER_SITES:
                self._patch_site(importlib.import_module(module_name), attr, which)
            agents = importlib.import_module(_AGENTS_MODULE)
            for class_name in _AGENT_CLASSES:
                cls = getattr(agents, class_name, None)
                if cls is None:
                    continue
                if "on_messages" in vars(cls):
                    self.ledger.wrap((cls, "on_messages"), hooks.on_messages())
                if "on_messages_stream" in vars(cls):
                    self.ledger.wrap((cls, "on_messages_stream"), hooks.on_messages_stream())
            for (module_name, class_name, attr), wrapper in (
                (_TOOL_CALL, hooks.execute_tool_call()),
                (_SELECTOR, hooks.select_speaker()),
            ):
                self.ledger.wrap(
                    f"{module_name}:{class_name}.{attr}", wrapper, optional="that part is not instrumented"
                )
            self._patch_late_sites()
        except BaseException:
            self._undo()
            raise

    def _undo(self) -> None:
        with self._late_lock:
            self._hooks = None
            self.ledger.unpatch_all()

    def _uninstrument(self, **kwargs: Any) -> None:
        self._undo()
