"""The run environment (agl.run) and the Trainer's typed configs: each given whole, field help, the one
backend factory, the served gateway with the scripted backend, the metrics log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agl.config import LoopConfig, RolloutSettings, RunConfig, config_fields
from agl.gateway.backends import from_spec
from agl.gateway.serve import rollout_base_url, root_url, v1_url
from agl.run.environment import Environment
from agl.run.metrics import MetricsLog
from agl.run.settings import Serving
from agl.store.memory import MemoryStore
from agl.trainer.trainer import Trainer


def test_the_trainer_takes_typed_settings_whole_and_refuses_anything_else(tmp_path: Path) -> None:
    trainer = Trainer(
        serving=Serving(backend="scripted", script=["x"], run_dir=tmp_path, progress=False),
        loop=LoopConfig(steps=5, seed=7),
        rollout=RolloutSettings(lease_s=9.0),
        config=RunConfig(temperature=0.5),
    )
    assert trainer.loop.steps == 5 and trainer.loop.seed == 7
    assert trainer.serving.backend == "scripted" and trainer.serving.progress is False
    assert trainer.run_dir == tmp_path
    assert trainer.rollout_config.lease_s == 9.0 and trainer.rollout_config.max_attempts == 2
    assert trainer.sampling["temperature"] == 0.5
    assert trainer.behaviour_logprobs is False  # scripted replies carry no policy log-probs
    defaults = Trainer(serving=Serving(backend="scripted", script=["x"]))  # a value not given: its defaults
    assert defaults.loop == LoopConfig() and defaults.rollout == RolloutSettings()
    with pytest.raises(TypeError, match="unexpected keyword argument 'steps'"):
        Trainer(steps=3, serving=Serving(backend="scripted", script=["x"]))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="loop must be an agl.config.LoopConfig, got dict"):
        Trainer(loop={"steps": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tasks_per_step must be >= 1"):
        Trainer(serving=Serving(backend="scripted", script=["x"]), loop=LoopConfig(tasks_per_step=0))


def test_every_config_field_has_help_and_a_type() -> None:
    for cls in (LoopConfig, RolloutSettings, Serving):
        rows = list(config_fields(cls))
        assert rows, cls
        for row in rows:
            assert row.help.strip(), f"{cls.__name__}.{row.name} has no help text"
    loop = {row.name: row for row in config_fields(LoopConfig)}
    assert loop["steps"].default == 20 and loop["steps"].type is int
    assert loop["step_timeout_s"].default is None
    assert RolloutSettings().for_store().lease_s == 120.0
    # RunConfig's fields come through too (their help may be empty): the examples give their own
    assert {row.name for row in config_fields(RunConfig)} >= {"temperature", "learning_rate"}


def test_urls_are_normalised_in_one_place() -> None:
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert v1_url(url) == "http://h:1/v1" and root_url(url) == "http://h:1"
    assert rollout_base_url("http://h:1/v1", "ro-1", 2) == "http://h:1/rollouts/ro-1/attempts/2/v1"


def test_from_spec_names_what_is_missing() -> None:
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        from_spec("tpu")
    with pytest.raises(ValueError, match="script"):
        from_spec("scripted")
    with pytest.raises(ValueError, match="vllm"):
        from_spec("vllm")
    with pytest.raises(ValueError, match="base_url"):
        from_spec("openai")
    assert from_spec("scripted", script=["hi"], models=["m"]).models() == ["m"]


def test_environment_serves_the_backend_records_calls_and_publishes(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")  # the core env has no openai client
    store = MemoryStore()
    env = Environment(
        Serving(backend="scripted", script=["Hello there."], store=store, run_dir=tmp_path, runners=0)
    )
    env.start()
    try:
        assert env.url is not None and env.url.endswith("/v1") and env.gateway is not None
        version = env.publish({"temperature": 0.3})
        llm = store.get_resources().llm
        assert llm is not None and llm.base_url == env.url and llm.sampling == {"temperature": 0.3}
        client = openai.OpenAI(base_url=env.url, api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model=env.model_name, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content == "Hello there."
        assert env.push_weights(None, version) == 0.0  # nothing to push without a policy
    finally:
        env.close()
    assert env.gateway is None
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=llm.base_url, api_key="x", max_retries=0).models.list()


def test_an_external_gateway_is_used_as_given(tmp_path: Path) -> None:
    env = Environment(Serving(gateway_url="http://gpu:8765/", model_name="m", store="memory://", runners=0))
    env.start()
    assert env.url == "http://gpu:8765/v1" and env.model_name == "m" and env.gateway is None
    env.close()


def test_metrics_log_writes_loads_and_summarises(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    log.write({"step": 0, "val_reward": 0.5, "val_tasks": 4})
    log.write({"step": 1, "train_reward": 0.25})
    log.write({"step": 2, "val_reward": 0.75, "val_tasks": 4})
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]
    again = MetricsLog(tmp_path)
    assert again.load() == lines
    summary = again.summary(2)
    assert summary["val_reward_before"] == 0.5 and summary["val_reward_after"] == 0.75
    again.write({"step": 3, "val_reward": 0.9, "val_tasks": 8})  # a re-check on a larger held-out set
    assert again.summary(3)["val_reward_before"] is None
    again.reset()
    assert not (tmp_path / "metrics.jsonl").exists() and again.history == []
