"""Each LangGraph node's LLM calls reach the gateway naming that node as the calling agent.

The integration puts the agent's name in the W3C baggage (``agl.agent``) while the node runs, the
openai integration sends it with each request, and the gateway records it on its server span
(``agl.llm.agent``): the name a backend with an adapter per agent serves the call by. Real LangGraph,
real ``ChatOpenAI``, agl's gateway with the scripted backend on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

import openai  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.graph import START, MessagesState, StateGraph  # noqa: E402
from lc_support import MODEL, Traced, Tree  # noqa: E402
from test_langchain_spans import INPUT, by_role, llm_for, two_node_graph  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402


def served_agents(tree: Tree) -> list[tuple[str | None, str | None]]:
    """(agent the span tree attributes the call to, agent the gateway saw in the baggage) per call."""
    return [(tree.agent_of(s), s.attributes.get(sc.AGL_LLM_AGENT)) for s in tree.server_chats()]


@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
def test_each_node_calls_as_its_own_agent(traced: Traced, mode: str) -> None:
    traced.backend.policy = by_role
    graph = two_node_graph(llm_for(traced), mode, name="sql_app")
    with traced.rollout() as out:
        if mode == "invoke":
            graph.invoke(INPUT)
        else:
            asyncio.run(graph.ainvoke(INPUT))
    tree: Tree = out["tree"]
    # the nearest agent names the call: the node, not the named graph around it
    assert served_agents(tree) == [("writer", "writer"), ("checker", "checker")], tree.shape()
    assert [r.agent for r, _ in out["record"]] == ["writer", "checker"]  # what the backend was given


def test_calls_after_the_graph_name_no_agent(traced: Traced) -> None:
    """A call the application makes after an (async) graph run is nobody's: no agent in its baggage,
    even where LangChain ended the run in a copy of the caller's context."""
    traced.backend.policy = by_role
    graph = two_node_graph(llm_for(traced), "ainvoke")
    client = openai.AsyncOpenAI(base_url=traced.gateway.base_url, api_key="sk-test", max_retries=0)

    async def run() -> Any:
        await graph.ainvoke(INPUT)
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "judge: score it"}]
        )

    with traced.rollout() as out:
        asyncio.run(run())
    tree: Tree = out["tree"]
    assert served_agents(tree) == [("writer", "writer"), ("checker", "checker"), (None, None)], tree.shape()


def test_each_node_is_served_by_its_own_adapter(agl_tracer: Any, tmp_path: Any) -> None:
    """The whole way: a tiny random Llama with a LoRA adapter per trained agent behind the gateway;
    each LangGraph node's calls are served by its own adapter, an untrained node's by the base model."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    from agl import tracing
    from agl.algorithms.lightning_rl import LightningRL
    from agl.algorithms.update import PolicyUpdate
    from agl.config import RunConfig
    from agl.gateway.backends.transformers import TransformersBackend
    from agl.gateway.testing import serve_gateway
    from agl.store.memory import MemoryStore
    from agl.trainer import load_tokenizer
    from agl.types import NewRollout

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=49152,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    )
    config = RunConfig.resolve(LightningRL(lora_r=4, lora_alpha=8, mixed_precision="no"))
    policy = PolicyUpdate(
        model, load_tokenizer(), config, output_dir=tmp_path / "ckpt", seed=0, adapters=["writer", "rewriter"]
    )
    backend = TransformersBackend.for_policy(policy, model_name="tiny", max_batch_size=4, batch_window_s=0.01)

    def node(role: str) -> Any:
        def run(state: Any) -> dict[str, Any]:
            return {"messages": [llm.invoke([("system", f"{role}: go"), *state["messages"]])]}

        return run

    g = StateGraph(MessagesState)
    for role in ("writer", "rewriter", "checker"):  # checker is not trained: no adapter of its own
        g.add_node(role, node(role))
    g.add_edge(START, "writer")
    g.add_edge("writer", "rewriter")
    g.add_edge("rewriter", "checker")
    graph = g.compile()
    store = MemoryStore()
    tracing.setup_tracing(store, agl_tracer.provider)
    assert agl_tracer.instrument("openai", "langchain") == ["openai", "langchain"]
    (rollout,) = store.enqueue([NewRollout()])
    claim = store.claim("w")
    assert claim is not None
    with serve_gateway(backend, store) as url:
        llm = ChatOpenAI(model="tiny", base_url=str(url), api_key="sk-test", max_retries=0, max_tokens=3)
        with agl.rollout_context(rollout.id, claim.attempt.number):
            graph.invoke(INPUT)
        assert tracing.flush(10)
    tree = Tree(store.query_spans(rollout_id=rollout.id, attempt=claim.attempt.number))
    served = [(tree.agent_of(s), s.attributes.get(sc.AGL_LLM_ADAPTER)) for s in tree.server_chats()]
    assert served == [("writer", "writer"), ("rewriter", "rewriter"), ("checker", sc.BASE_ADAPTER)]
