"""``--config FILE`` / ``--print-config`` of ``agl train``, ``agl sft`` and ``agl apo`` (agl.cli.config_file):
keys generated from the typed configs, flags over the file, unknown keys and wrong values refused by
name before anything runs, and the printed config reading back to the same settings. No torch needed:
these stop before a model is built."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from agl.cli import build_parser, main
from agl.cli.config_file import apply_config_file, format_config, resolved_config


def _sub(command: str) -> argparse.ArgumentParser:
    parser = build_parser(command)
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def _parse(command: str, argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """What ``agl COMMAND argv`` resolves to: the config file applied, then the flags."""
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    apply_config_file(sub, [command, *argv])
    return sub, parser.parse_args([command, *argv])


def test_train_flags_and_keys_come_from_the_typed_configs() -> None:
    from agl import LightningRL, LoopConfig, RunConfig, Serving
    from agl.config import RolloutSettings, config_fields

    keys = resolved_config(*_parse("train", ["--agent", "m:f"]))
    for cls in (LoopConfig, LightningRL, Serving):
        # Serving.engine is an EngineSettings, whose fields are keys of their own (checked below)
        missing = {f.name for f in config_fields(cls)} - set(keys) - {"script", "engine"}
        assert not missing, f"{cls.__name__} fields without a key: {missing}"
    assert {"temperature", "top_p", "max_tokens"} <= set(keys)
    assert {"rollout_timeout_s", "lease_s", "max_attempts", "infra_retries"} <= set(keys)
    assert len(list(config_fields(RolloutSettings))) == 4 and len(list(config_fields(RunConfig))) > 3
    # defaults are the dataclasses' own, under the field's name (an off switch under the setting's)
    assert keys["steps"] == LoopConfig().steps and keys["group_size"] == LightningRL().group_size
    assert keys["lora"] is True and keys["progress"] is True and "no_lora" not in keys
    assert {"engine_dtype", "prefix_cache_mb", "batched_lora", "deterministic", "threads"} <= set(keys)


def test_a_flag_overrides_the_file_and_yaml_and_toml_read_the_same(tmp_path: Path) -> None:
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("steps: 3\ntasks-per-step: 2\nlora: false\nreport_to: mlflow\nlearning_rate: 1e-3\n")
    toml_file = tmp_path / "run.toml"
    toml_file.write_text(
        'steps = 3\ntasks_per_step = 2\nlora = false\nreport_to = ["mlflow"]\nlearning_rate = 1e-3\n'
    )
    for path in (yaml_file, toml_file):
        _, args = _parse("train", ["--agent", "m:f", "--config", str(path), "--steps", "7"])
        assert (args.steps, args.tasks_per_step, args.no_lora) == (7, 2, True)
        assert args.report_to == ["mlflow"] and args.learning_rate == pytest.approx(1e-3)


def test_print_config_reads_back_to_the_same_settings(tmp_path: Path) -> None:
    argv = ["--agent", "pkg.mod:agent", "--train", "t.jsonl", "--steps", "5", "--no-lora", "--report-to",
            "tensorboard", "wandb", "--temperature", "0.7", "--run-dir", str(tmp_path / "run"),
            "--behaviour-logprobs", "--credit", "discounted", "--step-timeout-s", "30"]  # fmt: skip
    sub, args = _parse("train", argv)
    text = format_config(sub, args)
    assert "# policy updates\nsteps: 5\n" in text  # each key under its help
    printed = tmp_path / "printed.yaml"
    printed.write_text(text)
    sub2, again = _parse("train", ["--config", str(printed)])
    assert resolved_config(sub2, again) == resolved_config(sub, args)
    assert vars(again) | {"config": None, "func": None} == vars(args) | {"config": None, "func": None}


def test_print_config_from_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--agent", "m:f", "--steps", "4", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "steps: 4" in out and "agent: 'm:f'" in out and "# --- loop" in out
    assert not any(tmp_path.iterdir())  # printing writes nothing


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("steps: 3\nstep: 4\n", "run.yaml:2: unknown key 'step'; did you mean 'steps'?"),
        ("learning-rat: 0.1\n", "unknown key 'learning-rat'; did you mean 'learning_rate'?"),
        ("steps: many\n", "run.yaml:1: steps must be an integer, got 'many'"),
        ("credit: greedy\n", "credit must be one of identical, discounted, got 'greedy'"),
        ("lora: maybe\n", "lora must be true or false, got 'maybe'"),
        ("steps: [1, 2]\n", "steps takes one value"),
        ("- steps\n", "must hold a mapping of settings"),
        ("steps: [\n", "is not YAML"),
    ],
)
def test_a_bad_config_file_fails_with_one_line_and_writes_nothing(
    text: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(text)
    rc = main(["train", "--agent", "m:f", "--train", "t.jsonl", "--config", "run.yaml"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("agl train: error: ") and message in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


def test_a_missing_config_file_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--agent", "m:f", "--config", "nowhere.yaml"]) == 2
    assert "agl train: error: --config nowhere.yaml: no such file" in capsys.readouterr().err


def test_the_file_may_give_a_required_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text("agent: my_agent:agent\n")
    _, args = _parse("train", ["--config", str(cfg)])
    assert args.agent == "my_agent:agent"


def test_secrets_are_not_written_into_a_kept_config(tmp_path: Path) -> None:
    sub, args = _parse("train", ["--agent", "m:f", "--api-key", "sk-secret", "--gateway-api-key", "tok"])
    text = format_config(sub, args, secrets=("api_key", "gateway_api_key"))
    assert "sk-secret" not in text and "tok\n" not in text and "api_key: null" in text


@pytest.mark.parametrize(
    ("command", "argv", "text", "expect"),
    [
        ("sft", ["--store", "sqlite:///x.db"], "out: runs/sft\nepochs: 3\nfull: true\n", {"out": "runs/sft", "epochs": 3, "full": True}),
        ("apo", ["--agent", "m:f"], "train: t.jsonl\nval: v.jsonl\nrounds: 2\nprogress: false\n", {"train": "t.jsonl", "rounds": 2, "no_progress": True}),
    ],
)  # fmt: skip
def test_sft_and_apo_take_the_same_config_file(
    command: str, argv: list[str], text: str, expect: dict[str, Any], tmp_path: Path
) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    sub, args = _parse(command, [*argv, "--config", str(cfg)])
    for key, value in expect.items():
        assert getattr(args, key) == value
    assert "--print-config" in sub._option_string_actions
    (tmp_path / "bad.yaml").write_text("epoch: 3\n" if command == "sft" else "round: 3\n")
    with pytest.raises(Exception, match="unknown key"):
        _parse(command, [*argv, "--config", str(tmp_path / "bad.yaml")])
