"""Resume of the synchronous loop keeps one metrics record per step: the records of steps after the
last checkpoint (their updates died with the killed process) are dropped before the steps run again,
as the asynchronous loop does (``MetricsLog.truncate``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from test_trainer import Script, _instrumented, _one_thread, tiny_model, two_agent_app  # noqa: E402, F401

import agl  # noqa: E402
from agl.config import LoopConfig  # noqa: E402
from agl.run.settings import Serving  # noqa: E402
from agl.trainer.trainer import Trainer, load_tokenizer  # noqa: E402


def test_a_resumed_sync_run_writes_each_step_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    serving = Serving(
        backend="scripted",
        script=Script(),
        runners=4,
        run_dir=run,
        tokenizer=load_tokenizer(),
        progress=False,
        store="memory://",
    )
    common: dict[str, Any] = dict(serving=serving, agents=["writer"])
    loop = LoopConfig(tasks_per_step=1, val_every=0, checkpoint_every=1)
    algo = agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8)
    tasks = [{"q": "a"}, {"q": "b"}]
    Trainer(algo, model=tiny_model(), loop=dataclasses.replace(loop, steps=2), **common).fit(
        two_agent_app, tasks
    )
    metrics = run / "metrics.jsonl"
    # killed after step 2's metrics were written, before its checkpoint was saved
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 2, "train_reward": 0.5, "trained_rollout_ids": ["lost"]}) + "\n")
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["next_step"] == 2
    resumed = Trainer(
        algo, model=tiny_model(), loop=dataclasses.replace(loop, steps=4, resume=True), **common
    )
    resumed.fit(two_agent_app, tasks)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all("lost" not in r.get("trained_rollout_ids", []) for r in records)
    assert [r["step"] for r in resumed.history] == [0, 1, 2, 3]
