"""Experiment trackers (agl.run.trackers): names checked with the closest one, a missing package named with
its extra before anything runs, and what reaches a tracker (numbers by step, nested series flattened,
secrets never). Each tracker's full run, through `agl train`, is in tests/test_cli_train.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from agl.errors import UsageError
from agl.run.metrics import MetricsLog
from agl.run.trackers import TRACKERS, numeric_metrics, resolve_report_to, run_config


def test_report_to_names() -> None:
    assert resolve_report_to(None) is None
    assert resolve_report_to("wandb") == ("wandb",)
    assert resolve_report_to("mlflow, trackio,mlflow") == ("mlflow", "trackio")
    assert resolve_report_to(["none"]) == () == resolve_report_to([])
    assert set(resolve_report_to("all") or ()) <= set(TRACKERS)
    with pytest.raises(UsageError, match="unknown tracker 'wandbb'; did you mean 'wandb'"):
        resolve_report_to(["wandbb"])
    with pytest.raises(UsageError, match="unknown tracker 'comet'"):
        resolve_report_to("comet")


@pytest.mark.parametrize("name", ["trackio", "wandb", "mlflow"])
def test_a_missing_tracker_names_its_extra_before_anything_is_written(name: str, tmp_path: Path) -> None:
    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed here")
    with pytest.raises(
        UsageError,
        match=rf"report_to '{name}' needs {name}, which is not installed: pip install 'agl\[{name}\]'",
    ):
        MetricsLog(tmp_path / "run", report_to=[name])
    assert not (tmp_path / "run").exists()


def test_agl_train_refuses_a_missing_tracker_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    from agl.cli import main

    (tmp_path / "plain_agent.py").write_text("def agent(task, resources):\n    return 1.0\n")
    (tmp_path / "t.jsonl").write_text('{"a": 1}\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "plain_agent", raising=False)
    rc = main(["train", "--agent", "plain_agent:agent", "--train", "t.jsonl", "--report-to", "wandb"])
    err = capsys.readouterr().err.strip()
    assert (
        rc == 2
        and err
        == "agl train: error: report_to 'wandb' needs wandb, which is not installed: pip install 'agl[wandb]'"
    )
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == [
        "plain_agent.py",
        "t.jsonl",
    ]


@pytest.mark.parametrize("uri", ["file:///{tmp}/mlruns", "{tmp}/mlruns"])
def test_agl_train_refuses_an_mlflow_file_store_in_one_line_before_anything_starts(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MLflow 3 refuses ``file:`` stores (and plain paths) only when the tracker first opens its client,
    mid-run; `agl train` says so in one line, with what to use instead, before anything is written."""
    pytest.importorskip("mlflow")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from agl.cli import main

    uri = uri.format(tmp=tmp_path)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(MlflowException, match="maintenance mode"):  # what the real MLflow does with it
        MlflowClient(tracking_uri=uri).search_experiments()
    (tmp_path / "plain_agent.py").write_text("def agent(task, resources):\n    return 1.0\n")
    (tmp_path / "t.jsonl").write_text('{"a": 1}\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delitem(__import__("sys").modules, "plain_agent", raising=False)
    rc = main(["train", "--agent", "plain_agent:agent", "--train", "t.jsonl", "--report-to", "mlflow"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == (
        f"agl train: error: MLFLOW_TRACKING_URI={uri} is a file store, which MLflow 3 refuses: use "
        "sqlite:///PATH/mlflow.db (or a tracking server's http:// URL), or unset it to get the run's own "
        "run_dir/mlflow.db"
    )
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == [
        "plain_agent.py",
        "t.jsonl",
    ]


def test_an_mlflow_file_store_mlflow_is_told_to_allow_is_let_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``MLFLOW_ALLOW_FILE_STORE=true`` is MLflow's own opt-out: agl leaves the choice to it."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    log = MetricsLog(tmp_path / "run", report_to="mlflow", project="unit", run_name="r")
    log.start({"loop": {"steps": 1}})
    log.write({"step": 0, "train_reward": 0.5})
    log.close()
    assert any((tmp_path / "mlruns").iterdir())


def test_a_record_reaches_trackers_as_numbers_by_name() -> None:
    record = {
        "step": 3,
        "train_reward": 0.5,
        "train_reward/solver": 1,
        "no_update": True,
        "judge": {"cost_usd": 0.25, "model": "x"},
        "note": "text",
    }
    assert numeric_metrics(record) == {
        "train_reward": 0.5,
        "train_reward/solver": 1.0,
        "judge/cost_usd": 0.25,
    }


def test_the_run_config_a_tracker_gets_hides_secrets_and_objects(tmp_path: Path) -> None:
    import agl

    serving = agl.Serving(backend="scripted", script=lambda r: "hi", api_key="sk-secret", run_dir=tmp_path)
    config = run_config(agl.LightningRL(group_size=3), serving=serving, loop=agl.LoopConfig(steps=2))
    assert config["algorithm"]["name"] == "LightningRL" and config["algorithm"]["group_size"] == 3
    assert config["serving"]["api_key"] == "***" and config["serving"]["script"] == "<function>"
    assert config["serving"]["run_dir"] == str(tmp_path) and config["loop"]["steps"] == 2


def test_mlflow_gets_each_step_and_per_adapter_series(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    log = MetricsLog(tmp_path / "run", report_to="mlflow", project="unit", run_name="r")
    log.start({"loop": {"steps": 2}, "serving": {"api_key": "***"}})
    for step in range(3):
        log.write({"step": step, "train_reward": step / 2, "train_reward/solver": 1.0 - step / 4})
    log.close({"val_reward_before": 0.1, "val_reward_after": 0.9})
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("unit").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train_reward/solver")
    assert [(m.step, m.value) for m in history] == [(0, 1.0), (1, 0.75), (2, 0.5)]
    assert run.data.params == {"loop.steps": "2", "serving.api_key": "***"}
    assert not (Path.cwd() / "mlruns").exists()  # nothing in the working directory
