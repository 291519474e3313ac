"""instrument()/uninstrument() of the LangChain integration: idempotent, reversible, never in the way."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

from langchain_core.callbacks import CallbackManager  # noqa: E402
from langchain_core.tracers import context as lc_context  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.graph import START, MessagesState, StateGraph  # noqa: E402
from lc_support import MODEL, Traced  # noqa: E402
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.instrumentation import available_instrumentors, failure_counts, get_instrumentor  # noqa: E402
from agl.integrations.langchain._handler import AglCallbackHandler  # noqa: E402
from agl.integrations.langchain.instrumentor import LangChainInstrumentor  # noqa: E402


def agl_handlers(handlers: list[Any]) -> list[Any]:
    return [h for h in handlers if isinstance(h, AglCallbackHandler)]


def graph(traced: Traced, *, stop_after_writer: bool = False) -> Any:
    llm = ChatOpenAI(model=MODEL, base_url=traced.gateway.base_url, api_key="sk-test", max_retries=0)

    def writer(state: MessagesState) -> dict[str, Any]:
        message = llm.invoke([("system", "writer"), *state["messages"]])
        if stop_after_writer:
            agl.uninstrument("langchain")  # while the graph is running
        return {"messages": [message]}

    def checker(state: MessagesState) -> dict[str, Any]:
        return {"messages": [llm.invoke([("system", "checker"), *state["messages"]])]}

    g = StateGraph(MessagesState)
    g.add_node("writer", writer)
    g.add_node("checker", checker)
    g.add_edge(START, "writer")
    g.add_edge("writer", "checker")
    return g.compile()


def test_registered_through_the_entry_point() -> None:
    assert available_instrumentors()["langchain"] is LangChainInstrumentor


def test_instrument_twice_is_once_and_uninstrument_leaves_nothing(traced: Traced) -> None:
    # the traced fixture instrumented once; a second instrument (same provider) changes nothing
    hooks = list(lc_context._configure_hooks)
    assert agl.instrument("langchain", tracer_provider=traced.provider) == ["langchain"]
    assert lc_context._configure_hooks == hooks
    assert len(agl_handlers(CallbackManager.configure().handlers)) == 1
    with traced.rollout() as out:
        graph(traced).invoke({"messages": [("user", "q")]})
    assert [s.attributes[sc.GEN_AI_AGENT_NAME] for s in out["tree"].agents()] == ["writer", "checker"]
    assert len(out["tree"].client_chats()) == 2

    handler = get_instrumentor("langchain").handler
    agl.uninstrument("langchain")
    assert get_instrumentor("langchain").handler is None and handler is not None and not handler.enabled
    assert not any(isinstance(entry[0].get(), AglCallbackHandler) for entry in lc_context._configure_hooks), (
        "the configure hook is gone"
    )
    assert len(lc_context._configure_hooks) == len(hooks) - 1
    assert agl_handlers(CallbackManager.configure().handlers) == []
    traced.exporter.clear()
    with traced.rollout() as out:
        graph(traced).invoke({"messages": [("user", "q")]})
    assert out["tree"].agents() == [] and out["tree"].tools() == []
    assert len(out["tree"].client_chats()) == 2  # the openai integration is still on: only ours is off

    # and it comes back
    assert agl.instrument("langchain", tracer_provider=traced.provider) == ["langchain"]
    assert len(lc_context._configure_hooks) == len(hooks)
    with traced.rollout() as out:
        graph(traced).invoke({"messages": [("user", "q")]})
    assert len(out["tree"].agents()) == 2


def test_uninstrument_during_a_run_stops_spans_and_ends_open_ones(traced: Traced) -> None:
    with traced.rollout() as out:
        graph(traced, stop_after_writer=True).invoke({"messages": [("user", "q")]})
    tree = out["tree"]
    # the writer span (started before) is still ended and stored; the checker (started after) has none
    assert [s.attributes[sc.GEN_AI_AGENT_NAME] for s in tree.agents()] == ["writer"]
    assert len(tree.client_chats()) == 2


class _Broken(SpanProcessor):
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if span.name == sc.SPAN_INVOKE_AGENT:
            raise RuntimeError("exporter bug")


def test_agl_failures_never_break_the_run(traced: Traced) -> None:
    provider = TracerProvider()
    provider.add_span_processor(_Broken())
    agl.uninstrument("langchain")
    agl.instrument("langchain", tracer_provider=provider)
    handler = get_instrumentor("langchain").handler
    failed = sum(failure_counts("langchain.").values())
    try:
        result = graph(traced).invoke({"messages": [("user", "q")]})
    finally:
        agl.uninstrument("langchain")
        provider.shutdown()
    assert len(result["messages"]) == 3  # the user's run completed normally
    assert handler is not None and sum(failure_counts("langchain.").values()) >= failed + 2


def test_naming_rules() -> None:
    from agl.integrations.langchain._handler import node_agent, root_agent

    assert node_agent("writer", inside_agent=False) == node_agent("writer", inside_agent=True) == "writer"
    assert node_agent("model", inside_agent=False) == "model"  # a top-level loop node names itself
    for loop_node in ("model", "agent", "pre_model_hook", "SummarizationMiddleware.before_model"):
        assert node_agent(loop_node, inside_agent=True) is None  # a turn of the enclosing agent
    assert (
        node_agent("tools", inside_agent=False) is None
        and node_agent("__start__", inside_agent=False) is None
    )
    assert root_agent("writer") == "writer" and root_agent("sql_agent", "chain") == "sql_agent"
    for default in ("LangGraph", "RunnableSequence", "RunnableParallel<a,b>", "RunnableLambda"):
        assert root_agent(default) is None
    assert (
        root_agent("ChatPromptTemplate", "prompt") is None and root_agent("StrOutputParser", "parser") is None
    )
