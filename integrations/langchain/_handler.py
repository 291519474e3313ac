"""The LangChain callback handler that turns runs into agl spans (imported only when instrumenting).

LangChain reports every run (chain, graph node, chat model, tool) to the callback handlers of its
callback manager, with ``run_id``/``parent_run_id`` linking runs into a tree. The handler keeps a
small record per live run and opens OpenTelemetry spans for the runs that matter for training:

- ``invoke_agent`` for agents: LangGraph nodes (the node name), graphs and prebuilt agents that have
  a name of their own (``create_agent(name=...)``, ``create_react_agent(name=...)``,
  ``compile(name=...)``), top-level runs named with ``run_name``, and runs whose metadata has
  ``agl_agent``; see :func:`node_agent` and :func:`root_agent`. One span per agent turn: an agent run
  directly inside an agent span of the same name (the prebuilt swarm's and supervisor's node + subgraph),
  or inside a node's span that nothing ran under yet (a node that runs one prebuilt agent), is a turn
  of that span's agent (``AglCallbackHandler._turn_of``);
- ``execute_tool`` for tool runs (``@tool``, ``StructuredTool``, tools run by ``ToolNode``), ERROR
  when the tool raised or LangChain reported a handled tool error (``ToolMessage.status == "error"``),
  plus a synthetic ERROR span for a failed call a node reported without running a tool (ToolNode
  answering a call to an unknown tool).

Every other run (prompts, parsers, sequences, routing functions) gets no span: its children attach
to the nearest ancestor that has one. Spans are parented through the run tree, not through whatever
context the callback happens to run in, so threads that lost the context still nest correctly.

LLM calls get no span from this handler: ``ChatOpenAI`` calls the ``openai`` package, whose agl
integration makes the client-side ``chat`` span. To make that span a child of the right agent, the
handler makes the agent's span current (through a :class:`ScopeSpan`, see ``_scope``) where the
agent's code runs: at the start of every node/agent/tool run, and again at the start of an LLM run
if the context there lost it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import ToolMessage
from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, Status, StatusCode

from agl import semconv as sc
from agl.instrumentation import guarded, safe_json
from agl.instrumentation.agent import agent_context
from agl.integrations.langchain._scope import ScopeSpan, current_span

__all__ = ["AglCallbackHandler", "node_agent", "root_agent"]

logger = logging.getLogger(__name__)

INTEGRATION = "langchain"
#: the name ``StateGraph.compile()`` and the prebuilt agents give a graph nobody named
DEFAULT_GRAPH_NAME = "LangGraph"
#: nodes of the prebuilt agent loops (langchain's ``create_agent``, langgraph's
#: ``create_react_agent``): inside an agent, these are that agent's turns, not agents of their own
LOOP_NODES = frozenset(
    {"agent", "model", "tools", "pre_model_hook", "post_model_hook", "generate_structured_response"}
)
#: ``create_agent`` middleware nodes are named ``"<Middleware>.<hook>"``
MIDDLEWARE_HOOKS = (".before_agent", ".before_model", ".after_model", ".after_agent")
#: the node that runs tools: never an agent
TOOL_NODE = "tools"
#: put ``{"agl_agent": "critic"}`` in a run's metadata to name any run an agent
AGENT_METADATA_KEY = "agl_agent"
#: run types LangChain gives prompt templates and output parsers: never agents
_NOT_AGENT_RUN_TYPES = frozenset({"prompt", "parser"})
_MAX_ATTR_CHARS = 32_768
_SEEN_TOOL_CALLS = 8192


# ---------------------------------------------------------------------------------------- naming


def root_agent(name: str, run_type: str | None = None) -> str | None:
    """The agent a top-level chain run stands for: its name, unless that is a LangChain default."""
    if not name or name == DEFAULT_GRAPH_NAME or name.startswith("Runnable"):
        return None
    if run_type in _NOT_AGENT_RUN_TYPES:
        return None
    return name


def is_loop_node(name: str) -> bool:
    return name in LOOP_NODES or name.endswith(MIDDLEWARE_HOOKS)


def node_agent(name: str, *, inside_agent: bool) -> str | None:
    """The agent a LangGraph node stands for, or None when it is a turn of the enclosing agent.

    Every node is an agent named after the node, except the standard agent-loop nodes
    (:data:`LOOP_NODES`, middleware hooks): inside an agent (a named graph, or a node that runs the
    loop as a subgraph) they are that agent's turns; at the top level they are agents of their own
    name. The tool node and LangGraph's reserved ``__*__`` nodes are never agents.
    """
    if name == TOOL_NODE or name.startswith("__"):  # LangGraph's own __start__/__end__
        return None
    if is_loop_node(name) and inside_agent:
        return None
    return name


# --------------------------------------------------------------------------------------- helpers


def _truncate(text: str) -> str:
    return text if len(text) <= _MAX_ATTR_CHARS else text[:_MAX_ATTR_CHARS] + "…"


def _to_text(value: Any) -> str:
    return safe_json(value, _MAX_ATTR_CHARS)


def _describe(error: BaseException) -> str:
    text = str(error)
    return _truncate(f"{type(error).__name__}: {text}" if text else type(error).__name__)


def _is_control_flow(error: BaseException) -> bool:
    """LangGraph raises GraphBubbleUp subclasses (interrupts, ``Command(graph=PARENT)``) to steer the
    graph: they end a node without it having failed."""
    return any(cls.__name__ == "GraphBubbleUp" for cls in type(error).__mro__)


def _is_step(tags: Sequence[str] | None) -> bool:
    return bool(tags) and any(t.startswith("graph:step:") for t in tags)  # type: ignore[union-attr]


def _serialized_name(serialized: Any) -> str | None:
    if isinstance(serialized, dict):
        name = serialized.get("name")
        if isinstance(name, str) and name:
            return name
        ids = serialized.get("id")
        if isinstance(ids, list) and ids and isinstance(ids[-1], str):
            return ids[-1]
    return None


def _tool_messages(obj: Any, depth: int = 0) -> Iterator[ToolMessage]:
    """ToolMessages in a node's output: ``{"messages": [...]}``, lists, ``Command(update=...)``."""
    if depth > 4:
        return
    if isinstance(obj, ToolMessage):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tool_messages(value, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tool_messages(value, depth + 1)
    elif type(obj).__name__ == "Command":
        yield from _tool_messages(getattr(obj, "update", None), depth + 1)


# ------------------------------------------------------------------------------------------ runs


class _Pending:
    """A failed tool span held open until its node ends, to learn its tool call id from the node."""

    __slots__ = ("span", "tool", "error", "end_ns", "call_id")

    def __init__(self, span: trace.Span, tool: str, error: str) -> None:
        self.span = span
        self.tool = tool
        self.error = error
        self.end_ns = time.time_ns()
        self.call_id: str | None = None


class _Run:
    """What the handler remembers about one live LangChain run."""

    __slots__ = (
        "run_id",
        "parent",
        "name",
        "metadata",
        "start_ns",
        "ctx",
        "span",
        "scope",
        "attached",
        "is_graph",
        "is_node",
        "call_id",
        "pending",
        "agent",
        "busy",
    )

    def __init__(self, run_id: UUID, parent: _Run | None, name: str, metadata: dict[str, Any]) -> None:
        self.run_id = run_id
        self.parent = parent
        self.name = name
        self.metadata = metadata
        self.start_ns = time.time_ns()
        self.ctx = otel_context.get_current()  # the context the run started in
        self.span: trace.Span | None = None
        self.scope: ScopeSpan | None = None
        self.attached: otel_context.Context | None = None
        self.is_graph = False
        self.is_node = False
        self.call_id: str | None = None
        self.pending: list[_Pending] | None = None  # failed tool runs without a call id (see on_tool_error)
        self.agent: str | None = None  # the gen_ai.agent.name of this run's invoke_agent span, if any
        self.busy = False  # something ran under this run's span (an LLM call, a tool, an agent)

    def owner_run(self) -> _Run | None:
        """This run or its nearest ancestor that has a span."""
        run: _Run | None = self
        while run is not None:
            if run.span is not None:
                return run
            run = run.parent
        return None

    def owner(self) -> trace.Span | None:
        """The span of this run or of its nearest ancestor that has one."""
        run = self.owner_run()
        return run.span if run is not None else None

    def agent_name(self) -> str | None:
        """The name of the agent this run belongs to: its own or its nearest agent ancestor's."""
        run: _Run | None = self
        while run is not None:
            if run.agent is not None:
                return run.agent
            run = run.parent
        return None

    def inside_agent(self) -> bool:
        return self.owner() is not None

    def node(self) -> _Run | None:
        """The nearest LangGraph node run above this one."""
        run = self.parent
        while run is not None and not run.is_node:
            run = run.parent
        return run


class AglCallbackHandler(BaseCallbackHandler):
    """Added to every LangChain run by the configure hook the instrumentor registers."""

    # Called right where LangChain invokes it (never in a thread-pool copy of the context), so the
    # context it attaches is the one the run's own code then runs in.
    run_inline = True
    raise_error = False

    def __init__(self, tracer: trace.Tracer) -> None:
        super().__init__()
        self.tracer = tracer
        self.enabled = True
        self._runs: dict[UUID, _Run] = {}
        self._lock = threading.Lock()
        self._tool_calls: OrderedDict[str, None] = OrderedDict()  # ids of tool calls that have a span

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        return f"<agl LangChain handler {state}, {len(self._runs)} live runs>"

    def __deepcopy__(self, memo: dict[int, Any]) -> AglCallbackHandler:
        return self  # LangChain deep-copies callback managers in places; there is one handler

    def __copy__(self) -> AglCallbackHandler:
        return self

    # -------------------------------------------------------------------------- span plumbing
    def _parent_context(self, run: _Run) -> otel_context.Context:
        owner = run.parent.owner_run() if run.parent is not None else None
        if owner is None or owner.span is None:
            return run.ctx
        # a run whose context lost the baggage (a thread started without copying the context) still
        # belongs to its agent's rollout: take the rest of the context from where the agent started
        base = run.ctx if baggage.get_all(run.ctx) or not baggage.get_all(owner.ctx) else owner.ctx
        return trace.set_span_in_context(owner.span, base)

    def _open(self, run: _Run, name: str, attributes: dict[str, Any]) -> trace.Span:
        owner = run.parent.owner_run() if run.parent is not None else None
        if owner is not None:
            owner.busy = True
        span = self.tracer.start_span(
            name,
            context=self._parent_context(run),
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=run.start_ns,
        )
        run.span = span
        return span

    def _open_agent(self, run: _Run, agent: str) -> None:
        attributes: dict[str, Any] = {
            sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT,
            sc.GEN_AI_AGENT_NAME: agent,
            sc.AGL_INTEGRATION: INTEGRATION,
            sc.AGL_LANGCHAIN_RUN_ID: str(run.run_id),
        }
        if run.is_node:
            attributes[sc.AGL_LANGGRAPH_NODE] = run.name
            step = run.metadata.get("langgraph_step")
            if isinstance(step, int) and not isinstance(step, bool):
                attributes[sc.AGL_LANGGRAPH_STEP] = step
        self._open(run, sc.SPAN_INVOKE_AGENT, attributes)
        run.agent = agent

    @staticmethod
    def _attach(run: _Run, span: trace.Span, base: otel_context.Context | None = None) -> None:
        """Make ``span`` current for the code this run executes (see ``_scope``); ``base`` supplies the
        rest of the context (baggage: the rollout) when the current one lost it. The baggage names the
        run's agent (none outside agents), so the run's LLM calls reach that agent's adapter."""
        if not span.get_span_context().is_valid:
            return
        ctx = otel_context.get_current()
        scope = ScopeSpan(span, trace.get_current_span(ctx))
        attached = trace.set_span_in_context(scope, base if base is not None else ctx)
        # a context LangChain leaves attached after the run names the agent only while the run is live
        attached = agent_context(attached, run.agent_name(), live=lambda: scope.live)
        otel_context.attach(attached)
        run.scope = scope
        run.attached = attached

    @staticmethod
    def _detach(run: _Run) -> None:
        scope = run.scope
        if scope is None:
            return
        scope.close()
        # Same context as the start (sync runs, tools): put the caller's context back for real.
        # Elsewhere (async chain/LLM ends run in a copy) the closed scope already means the caller's span.
        if otel_context.get_current() is run.attached:
            otel_context.attach(run.ctx)

    def _mark_graph(self, graph: _Run) -> None:
        """``graph`` runs LangGraph nodes; a graph with a name of its own is an agent, unless it is the
        turn of the agent it runs in (:meth:`_turn_of`)."""
        if graph.is_graph:
            return
        with self._lock:
            if graph.is_graph:
                return
            graph.is_graph = True
            if graph.span is None and graph.name != DEFAULT_GRAPH_NAME:
                if self._turn_of(graph, graph.name) is None:
                    self._open_agent(graph, graph.name)

    @staticmethod
    def _turn_of(run: _Run, agent: str) -> _Run | None:
        """The agent run whose turn ``run`` (an agent called ``agent``) is, or None when it is an agent of
        its own: one ``invoke_agent`` span per agent turn. LangGraph's prebuilt multi-agent graphs run
        each agent as a node named after it whose subgraph has the same name (``langgraph_swarm``,
        ``langgraph_supervisor``), and a graph node often just runs one prebuilt agent
        (``create_react_agent`` inside a node function). So an agent directly inside an agent span
        (nothing with a span in between) is that agent's turn when it has the same name, or when the
        enclosing span is a node's that nothing has run under yet: the node's span then takes the
        agent's own name (the node stays in ``agl.langgraph.node``). Its runs send the agent's name as
        baggage from then on."""
        owner = run.parent.owner_run() if run.parent is not None else None
        if owner is None or owner.agent is None or owner.span is None:
            return None
        if owner.agent == agent:
            return owner
        if owner.is_node and not owner.busy:
            owner.span.set_attribute(sc.GEN_AI_AGENT_NAME, agent)
            owner.agent = agent
            return owner
        return None

    def _seen_tool_call(self, call_id: str) -> bool:
        with self._lock:
            seen = call_id in self._tool_calls
            self._tool_calls[call_id] = None
            self._tool_calls.move_to_end(call_id)
            while len(self._tool_calls) > _SEEN_TOOL_CALLS:
                self._tool_calls.popitem(last=False)
            return seen

    # ------------------------------------------------------------------------------- chains
    @guarded("langchain.on_chain_start")
    def on_chain_start(
        self,
        serialized: dict[str, Any] | None,
        inputs: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not self.enabled:
            return
        name = kwargs.get("name") or _serialized_name(serialized) or "chain"
        parent = self._runs.get(parent_run_id) if parent_run_id is not None else None
        md = metadata or {}
        run = _Run(run_id, parent, name, md)
        self._runs[run_id] = run

        agent: str | None = None
        if parent is not None and md.get("langgraph_node") == name and _is_step(tags):
            run.is_node = True
            self._mark_graph(parent)
            agent = node_agent(name, inside_agent=parent.inside_agent())
        elif parent is None:
            agent = root_agent(name, kwargs.get("run_type"))
        explicit = md.get(AGENT_METADATA_KEY)
        if isinstance(explicit, str) and explicit:
            if parent is None or parent.metadata.get(AGENT_METADATA_KEY) != explicit:
                agent = explicit
        if agent is not None and self._turn_of(run, agent) is None:
            self._open_agent(run, agent)
        if run.span is not None or run.is_node:
            owner = run.owner()
            if owner is not None:
                self._attach(run, owner)

    @guarded("langchain.on_chain_end")
    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        run = self._runs.pop(run_id, None)
        if run is None:
            return
        if run.is_node:
            self._reported_tool_errors(run, outputs)
        self._end_pending(run)
        self._detach(run)
        if run.span is not None:
            run.span.end()

    @guarded("langchain.on_chain_error")
    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        run = self._runs.pop(run_id, None)
        if run is None:
            return
        self._end_pending(run)
        self._detach(run)
        span = run.span
        if span is not None:
            if not _is_control_flow(error):
                span.record_exception(error)
                span.set_attribute(sc.ERROR_TYPE, type(error).__qualname__)
                span.set_status(Status(StatusCode.ERROR, _describe(error)))
            span.end()

    def _reported_tool_errors(self, node: _Run, outputs: Any) -> None:
        """Tool calls the node's output reports as failed (``ToolMessage(status="error")``) that have no
        span with their id yet: a failed tool run whose id LangChain did not report takes it; a call no
        tool ran for (ToolNode answering a call to an unknown tool) gets a synthetic ERROR span, so AIR
        sees it like any other failed call."""
        reported = [
            m
            for m in _tool_messages(outputs)
            if getattr(m, "status", None) == "error"
            and m.tool_call_id
            and not self._seen_tool_call(m.tool_call_id)
        ]
        if not reported:
            return
        pending = node.pending or []
        unmatched = []
        for exact in (True, False):  # first by tool name and error text, then by tool name alone
            unmatched = []
            for message in reported:
                text = _to_text(message.content)
                match = next(
                    (
                        p
                        for p in pending
                        if p.call_id is None
                        and p.tool == message.name
                        and (not exact or (p.error and p.error in text))
                    ),
                    None,
                )
                if match is None:
                    unmatched.append(message)
                else:
                    match.call_id = message.tool_call_id
                    match.span.set_attribute(sc.GEN_AI_TOOL_CALL_ID, message.tool_call_id)
            reported = unmatched
        owner = node.owner()
        ctx = trace.set_span_in_context(owner, node.ctx) if owner is not None else node.ctx
        for message in unmatched:
            result = _to_text(message.content)
            span = self.tracer.start_span(
                sc.SPAN_EXECUTE_TOOL,
                context=ctx,
                kind=SpanKind.INTERNAL,
                attributes={
                    sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL,
                    sc.GEN_AI_TOOL_NAME: message.name or "unknown",
                    sc.GEN_AI_TOOL_CALL_ID: message.tool_call_id,
                    sc.GEN_AI_TOOL_CALL_RESULT: result,
                    sc.AGL_INTEGRATION: INTEGRATION,
                },
            )
            span.set_status(Status(StatusCode.ERROR, result))
            span.end()

    @staticmethod
    def _end_pending(run: _Run) -> None:
        for pending in run.pending or ():
            pending.span.end(pending.end_ns)
        run.pending = None

    # ---------------------------------------------------------------------------------- LLMs
    def _llm_start(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        if not self.enabled or parent_run_id is None:
            return
        parent = self._runs.get(parent_run_id)
        owner = parent.owner_run() if parent is not None else None
        if owner is None or owner.span is None:
            return
        owner.busy = True  # a node that called the model itself is an agent of its own (see _turn_of)
        want = owner.span.get_span_context()
        have = current_span().get_span_context()
        if have.is_valid and have.trace_id == want.trace_id:
            return  # the agent's span (or a span below it) is already current here
        # The context was lost on the way (a thread started without copying it): bring back the
        # agent's span and the context its run started in, baggage (rollout id) included.
        run = _Run(run_id, parent, "llm", {})
        self._runs[run_id] = run
        self._attach(run, owner.span, base=owner.ctx)

    @guarded("langchain.on_chat_model_start")
    def on_chat_model_start(
        self,
        serialized: dict[str, Any] | None,
        messages: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        self._llm_start(run_id, parent_run_id)

    @guarded("langchain.on_llm_start")
    def on_llm_start(
        self,
        serialized: dict[str, Any] | None,
        prompts: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        self._llm_start(run_id, parent_run_id)

    @guarded("langchain.on_llm_end")
    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        run = self._runs.pop(run_id, None)
        if run is not None:
            self._detach(run)

    @guarded("langchain.on_llm_error")
    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        run = self._runs.pop(run_id, None)
        if run is not None:
            self._detach(run)

    # --------------------------------------------------------------------------------- tools
    @guarded("langchain.on_tool_start")
    def on_tool_start(
        self,
        serialized: dict[str, Any] | None,
        input_str: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        inputs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not self.enabled:
            return
        name = _serialized_name(serialized) or kwargs.get("name") or "tool"
        parent = self._runs.get(parent_run_id) if parent_run_id is not None else None
        run = _Run(run_id, parent, name, metadata or {})
        self._runs[run_id] = run
        attributes: dict[str, Any] = {
            sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL,
            sc.GEN_AI_TOOL_NAME: name,
            sc.GEN_AI_TOOL_CALL_ARGUMENTS: _to_text(inputs) if inputs is not None else _to_text(input_str),
            sc.AGL_INTEGRATION: INTEGRATION,
        }
        call_id = kwargs.get("tool_call_id")
        if isinstance(call_id, str) and call_id:
            attributes[sc.GEN_AI_TOOL_CALL_ID] = call_id
            run.call_id = call_id
            self._seen_tool_call(call_id)
        span = self._open(run, sc.SPAN_EXECUTE_TOOL, attributes)
        self._attach(run, span)

    @guarded("langchain.on_tool_end")
    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        run = self._runs.pop(run_id, None)
        if run is None:
            return
        self._detach(run)
        span = run.span
        if span is None:
            return
        messages = list(_tool_messages(output)) if not isinstance(output, str) else []
        message = messages[0] if messages else None
        result = _to_text(message.content if message is not None else output)
        span.set_attribute(sc.GEN_AI_TOOL_CALL_RESULT, result)
        if message is not None:
            call_id = message.tool_call_id
            if call_id and run.call_id is None:
                span.set_attribute(sc.GEN_AI_TOOL_CALL_ID, call_id)
                self._seen_tool_call(call_id)
            if getattr(message, "status", None) == "error":
                # handle_tool_error / handle_validation_error: the model gets a message, but the call failed
                span.set_status(Status(StatusCode.ERROR, result))
        span.end()

    @guarded("langchain.on_tool_error")
    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        run = self._runs.pop(run_id, None)
        if run is None:
            return
        self._detach(run)
        span = run.span
        if span is None:
            return
        if run.call_id is None:
            call_id = kwargs.get("tool_call_id")
            if isinstance(call_id, str) and call_id:
                span.set_attribute(sc.GEN_AI_TOOL_CALL_ID, call_id)
                run.call_id = call_id
                self._seen_tool_call(call_id)
        if not _is_control_flow(error):
            span.record_exception(error)
            span.set_attribute(sc.ERROR_TYPE, type(error).__qualname__)
            span.set_status(Status(StatusCode.ERROR, _describe(error)))
        node = run.node() if run.call_id is None else None
        if node is not None:
            # Older langchain-core reports no tool call id for a tool that raised; the node's error
            # ToolMessage names it. Keep the span open until the node ends to give it that id.
            if node.pending is None:
                node.pending = []
            node.pending.append(_Pending(span, run.name, str(error)))
            return
        span.end()
