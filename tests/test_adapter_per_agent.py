"""An adapter per agent (issue 35): one LoRA adapter per selected agent on one frozen tiny random
Llama. The training step updates each adapter on its own agent's transitions; checkpoints hold one folder
per adapter; the gateway serves each call with its agent's adapter, mixed batches included."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from agl.algorithms.lightning_rl import LightningRL  # noqa: E402
from agl.algorithms.per_agent_lora import adapter_names  # noqa: E402
from agl.algorithms.update import PolicyUpdate  # noqa: E402
from agl.config import RunConfig  # noqa: E402
from agl.engine import EngineSettings  # noqa: E402
from agl.errors import UsageError  # noqa: E402
from agl.trainer.trainer import load_tokenizer  # noqa: E402
from agl.types import Transition  # noqa: E402

AGENTS = ["writer", "rewriter"]


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def make(tok, tmp_path, agents=AGENTS, **cfg) -> PolicyUpdate:
    algo = LightningRL(
        **{"learning_rate": 5e-3, "lora_r": 4, "lora_alpha": 8, "mixed_precision": "no", **cfg}
    )
    config = RunConfig.resolve(algo, sampling={"temperature": 1.0})
    return PolicyUpdate(tiny_model(0), tok, config, output_dir=tmp_path / "ckpt", seed=0, adapters=agents)


def transition(tok, agent: str, rid: str, text: str) -> Transition:
    prompt = tuple(tok(f"{agent}: say something", add_special_tokens=False)["input_ids"])
    response = tuple(tok(text, add_special_tokens=False)["input_ids"]) + (tok.eos_token_id,)
    return Transition(
        rollout_id=rid,
        attempt=1,
        index=0,
        agent=agent,
        group_id="g",
        prompt_ids=prompt,
        response_ids=response,
    )


def adapter_weights(policy: PolicyUpdate, name: str) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in policy.model.named_parameters() if f".{name}." in k}


def test_adapter_names_refuse_unnamed_agents_and_collisions() -> None:
    assert adapter_names(["writer", "sql.rewriter"]) == {"writer": "writer", "sql.rewriter": "sql_rewriter"}
    with pytest.raises(UsageError, match="needs the agents to train by name"):
        adapter_names(None)
    with pytest.raises(UsageError, match="map to one LoRA name 'a_b'"):
        adapter_names(["a.b", "a b"])


def test_a_step_changes_only_the_adapters_whose_agents_had_an_advantage(tok, tmp_path) -> None:
    policy = make(tok, tmp_path)
    before = {name: adapter_weights(policy, name) for name in AGENTS}
    assert all(before.values()), "each agent has LoRA weights of its own"
    ts = [
        transition(tok, "writer", "r1", "SELECT 1"),
        transition(tok, "writer", "r2", "DROP TABLE"),
        transition(tok, "rewriter", "r1", "fine"),
        # not "fine" again: two identical sequences with advantages +1 and -1 have exactly zero gradient
        transition(tok, "rewriter", "r2", "not fine at all"),
    ]
    metrics = policy.step(ts, [1.0, -1.0, 0.0, 0.0])
    changed = {
        name: any(not torch.equal(before[name][k], p) for k, p in adapter_weights(policy, name).items())
        for name in AGENTS
    }
    assert changed == {"writer": True, "rewriter": False}
    assert metrics["trained_transitions/writer"] == 2.0
    assert metrics["trained_transitions/rewriter"] == 0.0
    assert metrics["grad_norm/writer"] > 0.0
    assert policy.global_step == 1
    # the rewriter's turn: now only it moves
    writer_now = adapter_weights(policy, "writer")
    policy.step(ts, [0.0, 0.0, 1.0, -1.0])
    assert all(torch.equal(writer_now[k], p) for k, p in adapter_weights(policy, "writer").items())
    assert any(
        not torch.equal(before["rewriter"][k], p) for k, p in adapter_weights(policy, "rewriter").items()
    )


def test_a_checkpoint_holds_one_folder_per_adapter_and_loads_back(tok, tmp_path) -> None:
    policy = make(tok, tmp_path)
    ts = [transition(tok, "writer", "r1", "a"), transition(tok, "writer", "r2", "b")]
    policy.step(ts, [1.0, -1.0])
    path = policy.save_checkpoint()
    for name in AGENTS:
        assert (tmp_path / "ckpt" / "checkpoint-1" / name / "adapter_model.safetensors").is_file()
    trained = adapter_weights(policy, "writer")
    fresh = make(tok, tmp_path / "again")
    assert fresh.load_checkpoint(path) == 1
    loaded = adapter_weights(fresh, "writer")
    assert all(torch.equal(trained[k], loaded[k]) for k in trained)


def test_adapter_per_agent_needs_lora(tok, tmp_path) -> None:
    with pytest.raises(UsageError, match="lora=False"):
        make(tok, tmp_path, lora=False)


def test_grpo_groups_per_agent() -> None:
    """A group is one task's rollouts seen per agent: the writer's calls are compared with the writer's,
    the rewriter's with the rewriter's (here the rewriter only acted in rollouts that scored the same)."""
    from agl.algorithms.lightning_rl import compute_advantages

    def t(rid: str, agent: str, reward: float) -> Transition:
        return Transition(
            rollout_id=rid,
            attempt=1,
            index=0 if agent == "writer" else 1,
            agent=agent,
            group_id="g",
            prompt_ids=(1,),
            response_ids=(2,),
            final_reward=reward,
            reward=reward,
        )

    ts = [
        t("a", "writer", 1.0),
        t("b", "writer", 0.0),
        t("c", "writer", 0.0),
        t("b", "rewriter", 0.0),
        t("c", "rewriter", 0.0),
    ]
    shared, _ = compute_advantages(ts, LightningRL(group_size=3))
    per, stats = compute_advantages(ts, LightningRL(group_size=3, agent_baseline="group"), per_agent=True)
    assert shared[3] < 0.0, "shared: the rewriter's calls take the writer's group statistics"
    assert per[3:] == [0.0, 0.0], "per agent: the rewriter's own group has no variance"
    assert per[0] > 0.0 > per[1]
    assert stats["groups"] == 2 and stats["zero_variance_groups"] == 1
    # under "auto" (the default) the rewriter, flat in the step with no history, falls back to the
    # task group whole: the shared advantages; the writer keeps its own group
    auto, stats = compute_advantages(ts, LightningRL(group_size=3), per_agent=True)
    assert auto[3:] == shared[3:] and auto[:3] == per[:3]
    assert stats["agent_baselines"] == {"writer": "group", "rewriter": "task"}


def test_trainer_validates_adapter_per_agent() -> None:
    from agl import Trainer

    with pytest.raises(UsageError, match="needs the agents to train by name"):
        Trainer(backend="scripted", script=["x"], adapter_per_agent=True)
    with pytest.raises(UsageError, match="map to one LoRA name"):
        Trainer(backend="scripted", script=["x"], agents=["a.b", "a:b"], adapter_per_agent=True)
    with pytest.raises(UsageError, match="needs lora=True"):
        Trainer(
            backend="scripted",
            script=["x"],
            agents=AGENTS,
            adapter_per_agent=True,
            update_options={"lora": False},
        )
    trainer = Trainer(backend="scripted", script=["x"], agents=AGENTS, adapter_per_agent=True)
    assert trainer.agent_loras == {"writer": "writer", "rewriter": "rewriter"}


# ------------------------------------------------------------------------------------------- serving
def distinct_adapters(policy: PolicyUpdate) -> None:
    """Give every adapter weights of its own (peft starts each B at zero: every adapter = the base)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for k, p in policy.model.named_parameters():
            if "lora_B" in k:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def serve(policy: PolicyUpdate):
    from agl.gateway.backends.transformers import TransformersBackend

    return TransformersBackend.for_policy(
        policy, model_name="tiny", settings=EngineSettings(max_batch_size=8), batch_window_s=0.05
    )


def test_a_mixed_batch_matches_each_adapter_served_alone(tok, tmp_path) -> None:
    import asyncio

    from agl.gateway.backends.base import GenerationRequest

    policy = make(tok, tmp_path)
    distinct_adapters(policy)
    backend = serve(policy)
    assert backend.models() == ["tiny", "tiny:writer", "tiny:rewriter"]
    asks = [(f"question {i}", adapter) for i in range(2) for adapter in ("writer", "rewriter", None)]

    def request(prompt: str, adapter: str | None) -> GenerationRequest:
        messages = [{"role": "user", "content": prompt}]
        return GenerationRequest(
            model="tiny", messages=messages, temperature=0.0, max_tokens=8, adapter=adapter
        )

    async def alone() -> list:
        return [await backend.generate(request(p, a)) for p, a in asks]

    async def together() -> list:
        return await asyncio.gather(*(backend.generate(request(p, a)) for p, a in asks))

    solo = asyncio.run(alone())
    mixed = asyncio.run(together())
    assert max(backend.batch_sizes) == len(asks), "all six rows decoded in one batch"
    for s, m, (_, adapter) in zip(solo, mixed, asks, strict=True):
        assert m.adapter == s.adapter == (adapter or "__base__")
        assert m.choices[0].response_ids == s.choices[0].response_ids
        assert m.choices[0].logprobs == pytest.approx(s.choices[0].logprobs, abs=1e-4)
    # the adapters really differ: one prompt's three replies are not scored alike
    first = [solo[i].choices[0].logprobs for i in range(3)]
    assert first[0] != pytest.approx(first[1], abs=1e-3) and first[1] != pytest.approx(first[2], abs=1e-3)


def test_the_gateway_routes_by_model_name_and_agent_baggage(tok, tmp_path) -> None:
    """``/v1/models`` lists the adapters; ``"tiny:writer"`` picks one by name; an ``agl.agent(...)``
    span's baggage picks the agent's own; the server span records the adapter, and the adapter (spans ->
    transitions) leaves out the writer's call that the rewriter's adapter served."""
    import httpx
    import openai
    from opentelemetry.sdk.trace import TracerProvider

    import agl
    from agl import semconv as sc
    from agl.adapter import Adapter
    from agl.gateway.testing import serve_gateway
    from agl.store.memory import MemoryStore
    from agl.tracing import provider as tracing
    from agl.tracing.emit import emit_reward
    from agl.types import NewRollout

    policy = make(tok, tmp_path)
    distinct_adapters(policy)
    store = MemoryStore()
    (ro,) = store.enqueue([NewRollout(group_id="g")])
    claim = store.claim("w")
    provider = TracerProvider()
    tracing.setup_tracing(store, provider)
    agl.instrument("openai", tracer_provider=provider)
    try:
        with serve_gateway(serve(policy), store) as url:
            ids = [m["id"] for m in httpx.get(f"{url}/models").json()["data"]]
            assert ids == ["tiny", "tiny:writer", "tiny:rewriter"]
            client = openai.OpenAI(base_url=str(url), api_key="x")
            msgs = [{"role": "user", "content": "hi"}]
            with tracing.rollout_context(ro.id, claim.attempt.number):
                with agl.agent("writer"):
                    client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4)
                    client.chat.completions.create(model="tiny:rewriter", messages=msgs, max_tokens=4)
                with agl.agent("rewriter"):
                    client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4)
                client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4)
                emit_reward(1.0)
            assert tracing.flush(10)
        store.finish_attempt(ro.id, claim.attempt.number, "succeeded")
        servers = sorted(
            (
                s
                for s in store.query_spans(rollout_id=ro.id, name=sc.SPAN_CHAT)
                if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER
            ),
            key=lambda s: s.start_ns,
        )
        assert [s.attributes.get(sc.AGL_LLM_ADAPTER) for s in servers] == [
            "writer",
            "rewriter",
            "rewriter",
            "__base__",
        ]
        assert all(sc.AGL_LLM_WEIGHT_VERSION in s.attributes for s in servers)
        adapter = Adapter(agents=AGENTS)
        ts = adapter.from_store(store, [ro.id])
        assert [t.agent for t in ts] == ["writer", "rewriter"]
        assert [t.span_id for t in ts] == [servers[0].span_id, servers[2].span_id]
        assert adapter.last_stats.other_adapter == 1
    finally:
        agl.uninstrument()
        tracing.reset_tracing()
        provider.shutdown()
        store.close()


@pytest.mark.parametrize("batched", [False, True], ids=["peft-rows", "batched-lora"])
def test_fit_trains_an_adapter_per_agent_end_to_end(tmp_path, batched: bool, monkeypatch) -> None:
    """``Trainer(agents=[...], adapter_per_agent=True)`` on the transformers backend: each agent's calls
    are served by its own adapter (the span says so), each adapter trains on its own agent's calls, the
    step's metrics are per adapter, and the checkpoint holds one folder per adapter; the same with
    ``batched_lora=True`` (the engine's mixed rows through the batched LoRA product)."""
    import itertools
    import json
    import threading

    import openai

    import agl
    from agl.engine import batched_lora as _batched_lora

    counter, lock = itertools.count(), threading.Lock()
    stacked: list[Any] = []

    def spy(model: Any, names: Any) -> Any:
        stacked.append(_real(model, names))
        return stacked[-1]

    _real = _batched_lora.batched_lora
    monkeypatch.setattr(_batched_lora, "batched_lora", spy)

    def app(task: dict, resources: agl.Resources) -> float:
        llm = resources.llm
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "x")
        msgs = [{"role": "user", "content": task["q"]}]
        for agent in AGENTS:
            with agl.agent(agent):
                client.chat.completions.create(model=llm.model, messages=msgs, max_tokens=4)
        with lock:
            return float(next(counter) % 2)  # every group has a good and a bad rollout

    trainer = agl.Trainer(
        LightningRL(group_size=2, lora_r=4, lora_alpha=8, learning_rate=1e-2, mixed_precision="no"),
        model=tiny_model(),
        tokenizer=load_tokenizer(),
        agents=AGENTS,
        adapter_per_agent=True,
        steps=1,
        tasks_per_step=1,
        val_before=False,
        runners=2,
        run_dir=tmp_path / "run",
        progress=False,
        store="memory://",
        engine=EngineSettings(batched_lora=batched),
    )
    agl.instrument("openai")
    try:
        trainer.fit(app, [{"q": "hello"}])
    finally:
        agl.uninstrument()
    # the engine stacked the adapters for the batched product (for the calls it served) only when asked
    assert bool(stacked) is batched
    (record,) = trainer.history
    for name in AGENTS:
        assert record[f"trained_transitions/{name}"] == 2.0
        assert record[f"grad_norm/{name}"] > 0.0
        assert record[f"train_reward/{name}"] == 0.5
        assert (
            tmp_path / "run" / "checkpoints" / "checkpoint-1" / name / "adapter_model.safetensors"
        ).is_file()
    assert record["unadapted"] == 0.0 and record["transitions"] == 4
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert "loss/writer" in json.loads(lines[-1])


def test_a_checkpoint_is_served_again_per_adapter_and_bad_folders_are_refused(tok, tmp_path) -> None:
    """``agl gateway serve --adapter writer=DIR --adapter rewriter=DIR``: a checkpoint's adapter folders
    served on the base model decode exactly as the training policy's engine did; a folder that is not a
    peft adapter, or one of another rank, is refused by name."""
    import argparse
    import asyncio
    import json
    import shutil

    from agl.cli.gateway import build_backend, register_cli
    from agl.gateway.backends.base import GenerationRequest

    policy = make(tok, tmp_path)
    distinct_adapters(policy)
    path = tmp_path / "ckpt" / "checkpoint-0"
    policy.save_checkpoint()
    base_dir = tmp_path / "base"
    tiny_model(0).save_pretrained(base_dir)
    tok.save_pretrained(base_dir)

    def args(*adapters: str):
        parser = argparse.ArgumentParser()
        register_cli(parser)
        flags = [f"--adapter={a}" for a in adapters]
        return parser.parse_args(["serve", "--model", str(base_dir), "--model-name", "tiny", *flags])

    served = build_backend(args(f"writer={path / 'writer'}", f"rewriter={path / 'rewriter'}"))
    trained = serve(policy)

    async def reply(backend, adapter: str):
        messages = [{"role": "user", "content": "hi"}]
        req = GenerationRequest(
            model="tiny", messages=messages, temperature=0.0, max_tokens=6, adapter=adapter
        )
        return (await backend.generate(req)).choices[0]

    for name in AGENTS:
        a, b = asyncio.run(reply(served, name)), asyncio.run(reply(trained, name))
        assert a.response_ids == b.response_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert served.models() == ["tiny", "tiny:writer", "tiny:rewriter"]

    with pytest.raises(UsageError, match="not a peft adapter folder"):
        build_backend(args(f"writer={base_dir}"))
    other = tmp_path / "other_rank"
    shutil.copytree(path / "rewriter", other)
    cfg = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**cfg, "r": 8}))
    with pytest.raises(UsageError, match="'rewriter' has rank/target modules"):
        build_backend(args(f"writer={path / 'writer'}", f"rewriter={other}"))
    with pytest.raises(UsageError, match="NAME=DIR"):
        build_backend(args("writer"))


def test_the_batched_lora_product_matches_peft_per_row(tok, tmp_path) -> None:
    """``batched_lora=True``: the adapters concatenated and each row masked to its own in two matmuls
    per LoRA layer gives peft's per-row ``adapter_names`` result within 1e-4 (mixed rows, one adapter
    only, the second adapter only, base rows only), directly and through the engine's continuous batch,
    and after a weight push (the concatenations are rebuilt from the new tensors)."""
    import asyncio

    from agl.engine.batched_lora import batched_lora
    from agl.gateway.backends.base import GenerationRequest
    from agl.gateway.backends.transformers import TransformersBackend

    policy = make(tok, tmp_path)
    distinct_adapters(policy)
    model = policy.model
    model.eval()
    ids = torch.randint(0, 1000, (4, 7), generator=torch.Generator().manual_seed(3))
    rows = ["writer", "rewriter", None, "writer"]
    with torch.no_grad():
        ref = model(input_ids=ids, adapter_names=[r or "__base__" for r in rows]).logits
        stack = batched_lora(model, AGENTS)
        assert stack is not None and len(stack.stacks) > 0
        with stack.rows(rows):
            got = model(input_ids=ids).logits
        plain = model(input_ids=ids, adapter_names=["__base__"] * 4).logits
    assert (got - ref).abs().max().item() < 1e-4
    assert not torch.allclose(ref[0], ref[1], atol=1e-3) and not torch.allclose(ref[0], plain[0], atol=1e-3)
    assert torch.allclose(plain[2], ref[2], atol=1e-6)  # forward restored: no stale patch left behind
    for subset in (["rewriter", None, "rewriter", None], [None] * 4, ["writer"] * 4):
        with torch.no_grad():
            want = model(input_ids=ids, adapter_names=[r or "__base__" for r in subset]).logits
            with stack.rows(subset):
                have = model(input_ids=ids).logits
        assert (have - want).abs().max().item() < 1e-4, subset

    peft_rows = serve(policy)
    batched = TransformersBackend.for_policy(
        policy,
        model_name="tiny",
        settings=EngineSettings(max_batch_size=8, batched_lora=True),
        batch_window_s=0.05,
    )
    asks = [(f"question {i}", adapter) for i in range(2) for adapter in ("writer", "rewriter", None)]

    async def together(backend) -> list:
        reqs = [
            GenerationRequest(
                model="tiny",
                messages=[{"role": "user", "content": p}],
                temperature=0.0,
                max_tokens=6,
                adapter=a,
            )
            for p, a in asks
        ]
        return await asyncio.gather(*(backend.generate(r) for r in reqs))

    for round_ in range(2):
        expect, mixed = asyncio.run(together(peft_rows)), asyncio.run(together(batched))
        assert max(batched.batch_sizes) == len(asks)
        for e, m in zip(expect, mixed, strict=True):
            assert m.choices[0].response_ids == e.choices[0].response_ids
            assert m.choices[0].logprobs == pytest.approx(e.choices[0].logprobs, abs=1e-4)
        if round_ == 0:  # new writer weights pushed to both engines: the stacks must follow
            before = [m.choices[0].logprobs for m in mixed]
            with torch.no_grad():
                for k, p in policy.model.named_parameters():
                    if "lora_B.writer" in k:
                        p.mul_(-3.0)
            asyncio.run(peft_rows.push(policy, version=1))
            asyncio.run(batched.push(policy, version=1))
    assert [m.choices[0].logprobs for m in mixed] != before
