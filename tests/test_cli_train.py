"""``agl train`` end to end on the scripted engine: the README's own agent as a module, tasks from JSONL
files, the settings from a YAML file. The real Trainer, gateway, runners and update run on a tiny
model; the printed (saved) config runs again and gives the same run; bad configs and bad rows fail
with one line and write nothing."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("openai")

import agl  # noqa: E402
from agl.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

#: the scripted model: held-out questions (a >= 40) right for even sums only; each training question
#: right and wrong in turn, so every GRPO group has reward variance and the run updates
REPLIES = """
import re
seen = {}

def script(request):
    a, b = map(int, re.findall(r"What is (\\d+) \\+ (\\d+)", request.messages[-1]["content"])[0])
    if a >= 40:
        right = (a + b) % 2 == 0
    else:
        seen[(a, b)] = seen.get((a, b), 0) + 1
        right = seen[(a, b)] % 2 == 1
    return f"Answer: {a + b}" if right else "I do not know"
"""


def readme_agent() -> str:
    """The README's own-agent block, as a user saves it to a file."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- docs-test: trainer[^>]*-->\n```python\n(.*?)```", text, re.S)
    assert m, "README.md has no trainer block"
    return m.group(1)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agl.chat.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> Iterator[Path]:
    """A user's folder: my_agent.py (the README block), replies.py, train/val JSONL, run.yaml."""
    import torch

    from agl.tracing import provider as tracing

    (tmp_path / "my_agent.py").write_text(readme_agent())
    (tmp_path / "replies.py").write_text(REPLIES)
    train = [{"a": a, "b": b} for a in range(10, 14) for b in range(10, 12)]
    val = [{"a": a, "b": 3} for a in range(40, 44)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in train))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(t) + "\n" for t in val))
    (tmp_path / "run.yaml").write_text(
        f"agent: my_agent:agent\ntrain: train.jsonl\nval: val.jsonl\nbackend: scripted\n"
        f"script: replies:script\nmodel: {tiny_model_dir}\nsteps: 2\ntasks_per_step: 2\n"
        "group_size: 2\nval_every: 0\nrunners: 4\nprogress: false\nlearning_rate: 0.01\nrun_dir: runs/one\n"
    )
    monkeypatch.chdir(tmp_path)
    for name in ("my_agent", "replies"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tmp_path
    torch.set_num_threads(threads)
    agl.uninstrument()
    tracing.reset_tracing()


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


_TIMES = ("_s", "tokens_per_s", "engine_")


def _comparable(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not any(t in k for t in _TIMES)}


def test_train_from_jsonl_and_a_yaml_config_then_its_saved_config_runs_the_same(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--config", "run.yaml"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{") : out.rindex("}") + 1])
    assert (summary["val_reward_before"], summary["val_reward_after"], summary["steps"]) == (0.5, 0.5, 2)
    run1 = project / "runs" / "one"
    records = _records(run1)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0]["val_reward"] == 0.5 and records[-1]["val_reward"] == 0.5  # a + 3 even: 41, 43
    trained = [r for r in records if "train_reward" in r]
    assert all(r["train_reward"] == 0.5 and r["zero_variance_groups"] == 0 and "loss" in r for r in trained)
    assert (run1 / "reward_curve.png").exists() and (run1 / "store.db").exists()
    saved = (run1 / "config.yaml").read_text()
    assert "learning_rate: 0.01" in saved and "# policy updates\nsteps: 2" in saved
    store = agl.store.open(f"sqlite:///{run1 / 'store.db'}")
    try:
        names = {
            s.attributes.get("gen_ai.agent.name") for s in store.query_spans() if s.name == "invoke_agent"
        }
    finally:
        store.close()
    assert names == {"adder"}

    sys.modules["replies"].seen.clear()  # the scripted model starts afresh, as in a new process
    assert main(["train", "--config", str(run1 / "config.yaml"), "--run-dir", "runs/two"]) == 0
    again = _records(project / "runs" / "two")
    assert [_comparable(r) | {"loss": None} for r in again] == [
        _comparable(r) | {"loss": None} for r in records
    ]
    losses = [(a["loss"], b["loss"]) for a, b in zip(again, records, strict=True) if "loss" in b]
    assert len(losses) == 2 and all(a == pytest.approx(b, rel=1e-4, abs=1e-6) for a, b in losses)
    assert (project / "runs" / "two" / "config.yaml").read_text() == saved.replace("runs/one", "runs/two")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"train.jsonl": '{"a": 1, "b": 2}\n{"a": 3, "b":\n'}, "train.jsonl:2 is not JSON"),
        ({"val.jsonl": '{"a": 40, "b": NaN}\n'}, "val.jsonl:1: nan is not a finite number"),
        ({"run.yaml+": "steps: -1\n"}, "steps must be an integer >= 0, got -1"),
        ({"run.yaml+": "report_to: [wandbb]\n"}, "unknown tracker 'wandbb'; did you mean 'wandb'?"),
        ({"run.yaml+": "temperature: 0\n"}, "temperature must be > 0 for training"),
        ({"run.yaml+": "agent: my_agent:nope\n"}, "module 'my_agent' has no attribute 'nope'"),
        ({"run.yaml+": "script: replies:nope\n"}, "--script: module 'replies' has no attribute 'nope'"),
        ({"run.yaml+": "backend: vllm\n"}, "backend='vllm' needs vllm_url"),
    ],
)
def test_bad_rows_and_bad_settings_fail_with_one_line_and_write_nothing(
    project: Path, change: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, text in change.items():
        if name.endswith("+"):
            path = project / name[:-1]
            path.write_text(path.read_text() + text)
        else:
            (project / name).write_text(text)
    before = sorted(p.name for p in project.iterdir())
    assert main(["train", "--config", "run.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("agl train: error: ") and message in err and "\n" not in err, err
    assert sorted(p.name for p in project.iterdir() if p.name != "__pycache__") == [
        b for b in before if b != "__pycache__"
    ]


def test_dev_runs_a_few_held_out_tasks_without_training(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--config", "run.yaml", "--dev", "2"]) == 0
    out = capsys.readouterr().out
    assert "Answer: 43" in out or "I do not know" in out
    assert not (project / "runs" / "one" / "metrics.jsonl").exists()


def _readme_commands() -> list[list[str]]:
    """The README's `agl train` lines for the same agent (continuations joined, comments dropped)."""
    import shlex

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"```bash\n(agl train --agent my_agent:agent.*?)```", text, re.S)
    assert m, "README.md does not show its agent with agl train"
    lines = m.group(1).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


def test_the_readmes_agl_train_lines_run_the_readmes_agent(
    project: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the README shows them: print the config (tasks from the module's own lists), run it, then a
    flag over the file; here on the scripted engine and the tiny model, one step."""
    printing, running, overriding = _readme_commands()
    assert "--print-config" in printing and ">" in printing
    argv = printing[1 : printing.index(">")]
    assert main(argv) == 0
    (project / "run.yaml").write_text(capsys.readouterr().out)
    assert running == ["agl", "train", "--config", "run.yaml"]
    assert overriding[:4] == ["agl", "train", "--config", "run.yaml"]
    here = ["--backend", "scripted", "--script", "replies:script", "--model", str(tiny_model_dir)]
    here += ["--steps", "1", "--tasks-per-step", "1", "--group-size", "2", "--val", "val.jsonl"]
    here += ["--no-progress", "--run-dir", "runs/readme"]
    assert main([*running[1:], *here]) == 0
    records = _records(project / "runs" / "readme")
    assert [r["step"] for r in records] == [0, 1] and records[0]["rollouts"] == 2
    saved = (project / "runs" / "readme" / "config.yaml").read_text()
    assert "train: 'my_agent:train'" in saved and "learning_rate: 0.001" in saved


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_trackers_receive_every_steps_metrics_the_config_and_the_plot(project: Path) -> None:
    """`agl train --report-to trackio wandb mlflow`, each tracker local (trackio's database in a folder,
    W&B offline, MLflow's SQLite in the run directory): every step of metrics.jsonl reaches each."""
    import os
    import subprocess

    names = [n for n in ("trackio", "wandb", "mlflow") if _installed(n)]
    if not names:
        pytest.skip("no tracker installed (pip install 'agl[trackio,wandb,mlflow]')")
    env = dict(os.environ, TRACKIO_DIR=str(project / "trackio"), WANDB_MODE="offline", WANDB_SILENT="true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        env[var] = str(project / "wandb-home")
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "agl.cli", "train", "--config", "run.yaml", "--threads", "1", "--steps", "1"]
    cmd += ["--report-to", *names, "--project", "adder", "--run-name", "cli-run"]
    proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = project / "runs" / "one"
    records = _records(run_dir)
    want = {r["step"]: r for r in records}
    if "mlflow" in names:
        _check_mlflow(run_dir, want)
    if "trackio" in names:
        _check_trackio(project / "trackio", want, env)
    if "wandb" in names:
        _check_wandb(run_dir)


def _check_mlflow(run_dir: Path, want: dict[int, dict[str, Any]]) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    run = client.get_run(run_id)
    assert run.info.run_name == "cli-run" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "adder"
    for key in ("train_reward", "val_reward", "loss"):
        got = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert got == {s: r[key] for s, r in want.items() if key in r}, key
    assert run.data.params["loop.steps"] == "1" and run.data.params["algorithm.learning_rate"] == "0.01"
    assert {f.path for f in client.list_artifacts(run_id)} == {"config.json", "reward_curve.png"}


def _check_trackio(folder: Path, want: dict[int, dict[str, Any]], env: dict[str, str]) -> None:
    import subprocess

    # trackio reads TRACKIO_DIR when imported: read its database in a process that has it set
    code = "import json; from trackio.sqlite_storage import SQLiteStorage as S; print(json.dumps(S.get_logs('adder', 'cli-run')))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    logs = [
        row
        for row in json.loads(out.stdout.strip().splitlines()[-1])
        if "train_reward" in row or "val_reward" in row
    ]
    got = {row["step"]: row for row in logs}
    assert set(got) == set(want)
    for step, record in want.items():
        for key in ("train_reward", "val_reward", "loss"):
            if key in record:
                assert got[step][key] == pytest.approx(record[key]), (step, key)
    assert any((folder / "media").rglob("*.png")), "the reward curve is not in trackio"


def _check_wandb(run_dir: Path) -> None:
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    data = next(runs[0].glob("run-*.wandb")).read_bytes()
    for key in (b"train_reward", b"val_reward", b"loop.steps", b"val_reward_after"):
        assert key in data, key  # history, config and summary records of the offline run
    assert list((runs[0] / "files" / "media").rglob("reward_curve*.png"))
    assert json.loads((run_dir / "trackers.json").read_text())["wandb"] in runs[0].name
