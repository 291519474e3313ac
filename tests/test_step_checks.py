"""The loop's checks of the agent selection (agl.trainer.checks): a selected agent that made no LLM call in
the first step is refused by name when other agents did (a typo), and only warned about otherwise."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("openai")

from test_trainer import (  # noqa: E402
    Script,
    _instrumented,  # noqa: F401 - autouse: the openai client is instrumented
    _one_thread,  # noqa: F401 - autouse
    sampling_writer,
    tiny_model,
    two_agent_app,
)

import agl  # noqa: E402
from agl.config import LoopConfig  # noqa: E402
from agl.errors import UsageError  # noqa: E402
from agl.run.settings import Serving  # noqa: E402
from agl.trainer.trainer import Trainer, load_tokenizer  # noqa: E402


def _trainer(tmp_path: Path, agents: list[str]) -> Trainer:
    return Trainer(
        agl.LightningRL(group_size=2, lora_r=4, lora_alpha=8),
        model=tiny_model(),
        agents=agents,
        serving=Serving(
            backend="scripted",
            script=Script(),
            store="memory://",
            runners=2,
            run_dir=tmp_path,
            tokenizer=load_tokenizer(),
            progress=False,
        ),
        loop=LoopConfig(tasks_per_step=1, steps=1, val_every=0),
    )


def test_a_selected_agent_without_calls_is_named_when_others_made_them(tmp_path: Path) -> None:
    """agents=["writer", "cheker"]: the writer's calls match, the misspelt checker's do not; the first
    step refuses the run, naming the missing agent and every agent seen with its call count."""
    trainer = _trainer(tmp_path, ["writer", "cheker"])
    with pytest.raises(UsageError, match=r"selected agent\(s\) 'cheker' made none of the 4 LLM calls") as err:
        trainer.fit(two_agent_app, [{"q": "What is 6 * 7?"}])
    assert "Agents seen: checker (2), writer (2)" in str(err.value)
    assert trainer.history == []


def test_a_selected_agent_without_calls_is_only_warned_about_when_all_calls_are_selected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent called only on some tasks (no unselected agent made calls): a warning, and the step
    trains on the others' calls."""
    trainer = _trainer(tmp_path, ["writer", "checker", "rewriter"])
    with caplog.at_level(logging.WARNING, logger="agl.trainer"):
        trainer.fit(two_agent_app, [{"q": "What is 6 * 7?"}])
    assert "the selected agent(s) 'rewriter' made no LLM call" in caplog.text
    (record,) = trainer.history
    assert record["transitions"] == 4


def test_the_off_policy_warning_names_mixed_precision_when_the_update_runs_in_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A first ratio far from 1 names the likeliest cause: the update's autocast when it has one (a GPU
    default), else the agent's own sampling settings; under the threshold, or a second time, nothing."""
    import logging

    from agl.config import RunConfig
    from agl.trainer.checks import StepChecks

    config = RunConfig(temperature=0.8)
    with caplog.at_level(logging.WARNING, logger="agl.trainer"):
        checks = StepChecks()
        checks.on_policy(1e-5, config, "bf16")
        assert not caplog.records
        checks.on_policy(1.13, config, "bf16")
        checks.on_policy(2.0, config, "bf16")
        (record,) = caplog.records
        assert "off by 1.13" in record.message and "bf16 autocast" in record.message
        assert "mixed_precision='no'" in record.message
        caplog.clear()
        StepChecks().on_policy(0.5, config)
        (record,) = caplog.records
        assert "temperature/top_p" in record.message and "autocast" not in record.message


def test_the_off_policy_message_is_info_when_decoupled_ppo_corrects_mixed_precision(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under mixed precision with decoupled PPO the engine's log-probs differing from the update's is
    expected: said once at INFO with its size, never as a warning."""
    from agl.config import RunConfig
    from agl.trainer.checks import StepChecks

    with caplog.at_level(logging.INFO, logger="agl.trainer"):
        checks = StepChecks()
        checks.on_policy(0.7, RunConfig(), "bf16", corrected=True)
        checks.on_policy(2.0, RunConfig(), "bf16", corrected=True)
    (record,) = caplog.records
    assert record.levelno == logging.INFO and "0.7" in record.message and "decoupled PPO" in record.message


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_an_update_in_mixed_precision_trains_by_decoupled_ppo(tmp_path: Path, precision: str) -> None:
    """The embedded engine computes its log-probs without autocast; an update in bf16 autocast (the
    GPU default; CPU autocast here) would take PPO's ratio against log-probs it cannot reproduce, so
    every step takes the decoupled path (its metrics appear) and reports the engine's deviation from
    the update's own log-probs. In float32 the plain path stays, ratio 1 up to float error."""
    trainer = Trainer(
        agl.LightningRL(group_size=4, learning_rate=1e-2, lora_r=4, lora_alpha=8, mixed_precision=precision),
        model=tiny_model(),
        config=agl.RunConfig(max_tokens=6),
        serving=Serving(
            backend="transformers",
            model_name="tiny",
            tokenizer=load_tokenizer(),
            store="memory://",
            runners=4,
            run_dir=tmp_path,
            progress=False,
        ),
        loop=LoopConfig(tasks_per_step=2, steps=2, val_every=0),
    )
    trainer.fit(sampling_writer, [{"q": "hello"}, {"q": "count"}])
    assert trainer.policy.precision == precision
    trained = [r for r in trainer.history if r.get("trained_transitions")]
    assert trained, trainer.history
    for r in trained:
        assert ("tis_weight_mean" in r) == (precision == "bf16"), r
        assert 0 <= r["behaviour_ratio_dev"] < (1e-3 if precision == "no" else 0.5), r
    if precision == "bf16":  # bf16 rounding shows, and stays a weight near 1
        assert max(r["behaviour_ratio_dev"] for r in trained) > 1e-5
        assert all(abs(r["tis_weight_mean"] - 1.0) < 0.05 for r in trained)
