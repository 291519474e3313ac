"""An adapter per agent (issue 35): one LoRA adapter per selected agent on one frozen tiny random
Llama. The training step updates each adapter on its own agent's transitions; checkpoints hold one folder
per adapter; the gateway serves each call with its agent's adapter, mixed batches included."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from agl.algorithms.adapters import adapter_names  # noqa: E402
from agl.algorithms.lightning_rl import LightningRL  # noqa: E402
from agl.algorithms.update import PolicyUpdate  # noqa: E402
from agl.config import RunConfig  # noqa: E402
from agl.errors import UsageError  # noqa: E402
from agl.trainer import load_tokenizer  # noqa: E402
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
    with pytest.raises(UsageError, match="map to one adapter name 'a_b'"):
        adapter_names(["a.b", "a b"])


def test_a_step_changes_only_the_adapters_whose_agents_had_an_advantage(tok, tmp_path) -> None:
    policy = make(tok, tmp_path)
    before = {name: adapter_weights(policy, name) for name in AGENTS}
    assert all(before.values()), "each agent has LoRA weights of its own"
    ts = [
        transition(tok, "writer", "r1", "SELECT 1"),
        transition(tok, "writer", "r2", "DROP TABLE"),
        transition(tok, "rewriter", "r1", "fine"),
        transition(tok, "rewriter", "r2", "fine"),
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
    per, stats = compute_advantages(ts, LightningRL(group_size=3), per_agent=True)
    assert shared[3] < 0.0, "shared: the rewriter's calls take the writer's group statistics"
    assert per[3:] == [0.0, 0.0], "per agent: the rewriter's own group has no variance"
    assert per[0] > 0.0 > per[1]
    assert stats["groups"] == 2 and stats["zero_variance_groups"] == 1


def test_trainer_validates_adapter_per_agent() -> None:
    from agl import Trainer

    with pytest.raises(UsageError, match="needs the agents to train by name"):
        Trainer(backend="scripted", script=["x"], adapter_per_agent=True)
    with pytest.raises(UsageError, match="map to one adapter name"):
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
    assert trainer.agent_adapters == {"writer": "writer", "rewriter": "rewriter"}
