"""An adapter per agent served by an engine outside the trainer (issue 35): vLLM (the fake vLLM server
speaks its runtime-LoRA protocol) and a separately served agl gateway (``_push_remote``). Each step
pushes every agent's adapter by name as one weight version, and each agent's calls reach its own."""

from __future__ import annotations

import copy
import hashlib
import itertools
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
openai = pytest.importorskip("openai")

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.algorithms.lightning_rl import LightningRL  # noqa: E402
from agl.trainer.trainer import load_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "gateway"))
from fake_vllm import FakeVLLM  # noqa: E402
from test_adapter_per_agent import AGENTS, tiny_model  # noqa: E402


def _app() -> Any:
    """Each rollout: the writer, then the rewriter, one call each; rewards alternate 1, 0."""
    counter, lock = itertools.count(), threading.Lock()

    def app(task: dict, resources: agl.Resources) -> float:
        llm = resources.llm
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "x")
        msgs = [{"role": "user", "content": task["q"]}]
        for agent in AGENTS:
            with agl.agent(agent):
                client.chat.completions.create(model=llm.model, messages=msgs, max_tokens=4)
        with lock:
            return float(next(counter) % 2)

    return app


def _fit(tmp_path: Path, **serving: Any) -> agl.Trainer:
    trainer = agl.Trainer(
        LightningRL(group_size=2, lora_r=4, lora_alpha=8, learning_rate=1e-2, mixed_precision="no"),
        model=tiny_model(),
        serving=agl.Serving(
            tokenizer=load_tokenizer(), runners=2, run_dir=tmp_path, progress=False, **serving
        ),
        loop=agl.LoopConfig(adapter_per_agent=True, steps=2, tasks_per_step=1, val_every=0),
        agents=AGENTS,
    )
    agl.instrument("openai")
    try:
        trainer.fit(_app(), [{"q": "hello"}])
    finally:
        agl.uninstrument()
    return trainer


def _server_spans(store: Any) -> list[Any]:
    spans = [
        s for s in store.query_spans(name=sc.SPAN_CHAT) if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER
    ]
    return sorted(spans, key=lambda s: s.start_ns)


def test_vllm_loads_each_agents_adapter_by_name_and_routes_its_calls(tmp_path: Path) -> None:
    """backend='vllm' with an adapter per agent: every push loads ``policy-<adapter>-v<version>`` from
    that adapter's folder of the step's save, and after it each agent's calls go to its own adapter;
    the spans name the adapter, and every agent's transitions train its adapter."""
    from agl.gateway.testing import serve_asgi

    fake = FakeVLLM(["Answer: 42", "no idea"], model="policy")
    with serve_asgi(fake.app) as root:
        trainer = _fit(
            tmp_path, backend="vllm", vllm_url=root + "/v1", model_name="policy", store="memory://"
        )
    versions = [r["resources_version"] for r in trainer.history]
    loads = [(b["lora_name"], Path(b["lora_path"])) for k, b in fake.requests if k == "load_lora_adapter"]
    pushed = sorted({int(p.parent.name[1:]) for _, p in loads})
    assert pushed == versions  # each step pushes before its rollouts
    # a push loads every adapter whose weights changed since the push before (all of them the first
    # time); one an update left unchanged (no gradient reached it) keeps serving its loaded copy
    digests = {
        (v, a): hashlib.sha256(
            (tmp_path / "adapters" / f"v{v}" / a / "adapter_model.safetensors").read_bytes()
        ).hexdigest()
        for v in versions
        for a in AGENTS
    }
    expected = {
        (f"v{v}", a)
        for i, v in enumerate(versions)
        for a in AGENTS
        if i == 0 or digests[(v, a)] != digests[(versions[i - 1], a)]
    }
    assert sorted((p.parent.name, p.name) for _, p in loads) == sorted(expected)
    assert len(expected) > len(AGENTS)  # the update changed at least one adapter, which was loaded again
    for name, path in loads:
        adapter = path.name
        assert name == f"policy-{adapter}-{path.parent.name}" and adapter in AGENTS
        assert (path / "adapter_config.json").is_file()
    spans = _server_spans(trainer.store)
    by_version: dict[int, dict[str, str]] = {}
    for name, path in loads:
        by_version.setdefault(int(path.parent.name[1:]), {})[path.name] = name
    chats = [b["model"] for k, b in fake.requests if k == "completions"]  # rendered by agl: prompt ids
    assert len(chats) == len(spans) == 8
    for span, upstream in zip(spans, chats, strict=True):
        adapter = span.attributes[sc.AGL_LLM_ADAPTER]
        version = span.attributes[sc.AGL_LLM_WEIGHT_VERSION]
        assert adapter in AGENTS
        # the copy of that adapter loaded for the call's version (the newest at or before it)
        loaded = [
            by_version[v][adapter] for v in sorted(by_version) if v <= version and adapter in by_version[v]
        ]
        assert upstream == (loaded[-1] if loaded else "policy")
    assert "policy" not in chats  # every step's calls reached the adapters loaded for it
    for record in trainer.history:
        for name in AGENTS:
            assert record[f"trained_transitions/{name}"] == 2.0


def test_a_separate_gateway_gets_every_adapter_as_one_version(tmp_path: Path) -> None:
    """Serving(gateway_url=...) with an adapter per agent: each step's adapters reach the separately
    served transformers gateway in one ``POST /agl/v1/adapters {"adapters": ...}``; it then serves each
    one by name, decoding as the adapter folder the trainer saved."""
    from peft import PeftModel

    from agl.gateway import TransformersBackend
    from agl.gateway.testing import serve_gateway
    from agl.store.memory import MemoryStore

    store = MemoryStore()
    backend = TransformersBackend(copy.deepcopy(tiny_model()), tokenizer=load_tokenizer(), model_name="tiny")
    with serve_gateway(backend, store) as url:
        trainer = _fit(tmp_path, gateway_url=url.root, model_name="tiny", store=store)
        last = trainer.history[-1]["resources_version"]
        assert backend.weight_version == last
        assert backend.agent_loras() == AGENTS
        assert backend.models() == ["tiny", "tiny:writer", "tiny:rewriter"]
    served = backend.model
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    outs = []
    for name in AGENTS:
        folder = tmp_path / "adapters" / f"v{last}" / name
        expect = PeftModel.from_pretrained(tiny_model(), str(folder)).eval()
        served.set_adapter(name)
        with torch.no_grad():
            got = served(ids).logits
            assert torch.allclose(got, expect(ids).logits, atol=1e-5)
        outs.append(got)
    assert not torch.allclose(outs[0], outs[1], atol=1e-6)  # two adapters, trained apart
    late = [s for s in _server_spans(store) if s.attributes[sc.AGL_LLM_WEIGHT_VERSION] > 0]
    assert late and {s.attributes[sc.AGL_LLM_ADAPTER] for s in late} == set(AGENTS)
