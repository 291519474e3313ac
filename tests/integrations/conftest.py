"""What the framework suites share: their names for agl.testing's fixtures (the plugin does the work).

Each suite's own conftest.py overrides ``agl_policy``/``agl_agent_of`` to script the model as its app's
agents; the langchain and openai suites define ``gateway``/``traced`` of their own shape.
``adapter_gateway`` serves a tiny random Llama with a LoRA adapter per agent (an adapter per agent, for
real), for the suites' routing tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


# The suite's names for agl.testing's fixtures.
@pytest.fixture(scope="module")
def scripted_model(agl_model: Any) -> Any:
    return agl_model


@pytest.fixture
def gateway(agl_gateway: Any) -> tuple[Any, Any]:
    return agl_gateway, agl_gateway.store


@pytest.fixture(scope="module")
def gateway_url(agl_gateway_url: Any) -> Any:
    return agl_gateway_url


@pytest.fixture
def clean_agl(agl_tracer: Any) -> None:
    """Nothing instrumented or set up for tracing is left for the next test (agl_tracer's teardown)."""


@pytest.fixture
def memory_spans(agl_tracer: Any) -> tuple[Any, Any]:
    return agl_tracer.provider, agl_tracer.exporter


# --------------------------------------------------------------------- an adapter per agent, for real
class AdapterGateway:
    """agl's gateway serving a tiny random Llama with one LoRA adapter per named agent (the
    transformers backend, peft's named adapters), storing spans in memory; ``served(rollout)`` says,
    per LLM call in order, which agent made it (span tree) and which adapter served it (gateway)."""

    MODEL = "tiny"

    def __init__(self, url: Any, store: Any) -> None:
        self.url = str(url)
        self.store = store

    def run(self, body: Any) -> str:
        """Run ``body()`` inside a fresh rollout; returns the rollout id once its spans are stored."""
        import agl
        from agl.tracing import provider as tracing
        from agl.types import NewRollout

        (rollout,) = self.store.enqueue([NewRollout()])
        claim = self.store.claim("w")
        assert claim is not None
        with agl.rollout_context(rollout.id, claim.attempt.number):
            body()
        assert tracing.flush(10)
        return rollout.id

    def served(self, rollout_id: str) -> list[tuple[str | None, str | None]]:
        from agl import semconv as sc
        from agl.testing.spans import SpanTree

        tree = SpanTree(self.store.query_spans(rollout_id=rollout_id, attempt=1))
        servers = [s for s in tree.named(sc.SPAN_CHAT) if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER]
        return [(tree.agent_of(s), s.attributes.get(sc.AGL_LLM_ADAPTER)) for s in servers]


@pytest.fixture
def adapter_gateway(
    agl_tracer: Any, tmp_path: Any, request: pytest.FixtureRequest
) -> Iterator[AdapterGateway]:
    """An :class:`AdapterGateway` with adapters for the agents the test names with
    ``@pytest.mark.parametrize("adapter_gateway", [["writer", "rewriter"]], indirect=True)``."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    pytest.importorskip("trl")
    from transformers import LlamaConfig, LlamaForCausalLM

    from agl.algorithms.lightning_rl import LightningRL
    from agl.algorithms.update import PolicyUpdate
    from agl.config import RunConfig
    from agl.engine import EngineSettings
    from agl.gateway.backends.transformers import TransformersBackend
    from agl.gateway.testing import serve_gateway
    from agl.store.memory import MemoryStore
    from agl.tracing import provider as tracing
    from agl.trainer.trainer import load_tokenizer

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
        model, load_tokenizer(), config, output_dir=tmp_path / "ckpt", seed=0, adapters=list(request.param)
    )
    backend = TransformersBackend.for_policy(
        policy,
        model_name=AdapterGateway.MODEL,
        settings=EngineSettings(max_batch_size=4),
        batch_window_s=0.01,
    )
    store = MemoryStore()
    tracing.setup_tracing(store, agl_tracer.provider)
    with serve_gateway(backend, store) as url:
        yield AdapterGateway(url, store)
    store.close()
