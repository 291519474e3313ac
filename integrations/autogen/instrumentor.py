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

Every replacement is recorded and put back by ``uninstrument()`` (only where it is still agl's), so
nothing is left patched. AutoGen's runtime messaging spans (``autogen publish ...``) and its
``create_agent`` spans are left as they are, on the global provider.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from typing import Any, ClassVar

from opentelemetry import trace

from agl.instrument import Instrumentor

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
    try:
        from agl.integrations.openai import OpenAIInstrumentor

        active = bool(OpenAIInstrumentor().is_instrumented_by_opentelemetry)
    except Exception:  # noqa: BLE001 - the openai package or integration is unavailable
        active = False
    if not active:
        logger.warning(
            "agl: the 'openai' integration is not instrumented, so the LLM calls of AutoGen's "
            "OpenAIChatCompletionClient get no chat spans and no traceparent and cannot be attributed "
            "to agents; use agl.instrument() or agl.instrument('autogen', 'openai')"
        )


class _Patch:
    __slots__ = ("owner", "attr", "original", "replacement")

    def __init__(self, owner: Any, attr: str, original: Any, replacement: Any) -> None:
        self.owner, self.attr, self.original, self.replacement = owner, attr, original, replacement

    def undo(self) -> None:
        if (
            vars(self.owner).get(self.attr) is self.replacement
        ):  # someone else re-patched it since: leave theirs
            setattr(self.owner, self.attr, self.original)


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

    _patches: list[_Patch]
    _hooks: Any = None

    def __init__(self) -> None:
        if not hasattr(self, "_patches"):
            self._patches = []
            self._late_done: set[str] = set()
            self._late_lock = threading.Lock()

    @property
    def patches(self) -> list[tuple[Any, str]]:
        """(owner, attribute) of everything agl replaced (tests compare them before and after)."""
        return [(p.owner, p.attr) for p in self._patches]

    # ------------------------------------------------------------------------------ patching
    def _replace(self, owner: Any, attr: str, replacement: Any) -> None:
        original = vars(owner)[attr]
        setattr(owner, attr, replacement)
        self._patches.append(_Patch(owner, attr, original, replacement))

    def _wrap(self, owner: Any, attr: str, wrapper: Any) -> None:
        import wrapt

        self._replace(owner, attr, wrapt.FunctionWrapper(vars(owner)[attr], wrapper))

    def _patch_site(self, module: Any, attr: str, which: str) -> None:
        hooks = self._hooks
        original = vars(module).get(attr)
        if original is None:
            logger.warning(
                "agl: %s has no %s (changed in this AutoGen version?); not instrumented there",
                module.__name__,
                attr,
            )
            return
        if which == "invoke":
            self._replace(module, attr, hooks.invoke_agent_helper(original))
        else:
            self._replace(module, attr, hooks.tool_helper(original))

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
                try:
                    self._patch_site(module, attr, which)
                except Exception as exc:  # noqa: BLE001 - never break the user's run
                    logger.warning("agl: cannot instrument %s.%s: %r", module_name, attr, exc)

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
                    self._wrap(cls, "on_messages", hooks.on_messages())
                if "on_messages_stream" in vars(cls):
                    self._wrap(cls, "on_messages_stream", hooks.on_messages_stream())
            for (module_name, class_name, attr), wrapper in (
                (_TOOL_CALL, hooks.execute_tool_call()),
                (_SELECTOR, hooks.select_speaker()),
            ):
                cls = getattr(importlib.import_module(module_name), class_name, None)
                if cls is None or attr not in vars(cls):
                    logger.warning(
                        "agl: AutoGen has no %s.%s.%s; that part is not instrumented",
                        module_name,
                        class_name,
                        attr,
                    )
                    continue
                self._wrap(cls, attr, wrapper)
            self._patch_late_sites()
        except BaseException:
            self._undo()
            raise

    def _undo(self) -> None:
        with self._late_lock:
            self._hooks = None
            while self._patches:
                self._patches.pop().undo()

    def _uninstrument(self, **kwargs: Any) -> None:
        self._undo()
