"""A short LightningRL run with the policy served by a real vLLM server that the run starts itself
(``Serving(backend="vllm", vllm_python=...)``), SIGKILLed in the middle of a step: the run restarts it
with the last pushed adapter, loses no rollout and says so in the step's metrics: the cut attempts are
``infra``, requeued, never scored (issue 64). Skipped unless
AGL_VLLM_PYTHON is set (vllm_real.py); ``tox -e vllm`` runs it."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from vllm_real import SERVER_ARGS, model_dir, vllm_config

pytest.importorskip("peft")
pytest.importorskip("openai")

#: the examples are imported from the repository root (as ``python -m examples.<name>`` runs them)
ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _metric(url: str, name: str) -> float | None:
    """One of vLLM's own metrics (``GET /metrics``, Prometheus text), summed over its labels."""
    import httpx

    try:
        text = httpx.get(url[: -len("/v1")] + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _kill_during_step(trainer: Any, step: int, done: threading.Event) -> None:
    """SIGKILL the run's vLLM server while ``step``'s rollouts generate: once its count of generated
    tokens grows between two reads and it has requests running (a kill after a fixed delay could land
    between the rollouts on a fast machine; the running gauge alone keeps its last value when idle)."""
    last = None
    while not done.is_set():
        server = trainer.env.vllm_server if trainer.env is not None else None
        if len(trainer.history) >= step and server is not None:
            now = _metric(server.url, "vllm:generation_tokens_total")
            if last is not None and now is not None and now > last:
                if (_metric(server.url, "vllm:num_requests_running") or 0) > 0:
                    server.kill()
                    return
            last = now
        time.sleep(0.02)


def test_lightning_rl_trains_through_a_managed_vllm_that_crashes_mid_step(tmp_path: Path) -> None:
    import agl
    from agl.config import RolloutSettings
    from examples.learn_on_cpu.agent import calc_agent
    from examples.learn_on_cpu.data import split

    python, _ = vllm_config()
    if python is None:
        pytest.skip("needs AGL_VLLM_PYTHON: the run starts its own server")
    train, val = split(n_val=4)
    trainer = agl.Trainer(
        agl.LightningRL(group_size=4, learning_rate=1e-3, lora_r=8, lora_alpha=16, kl_coef=0.0),
        model=str(model_dir()),
        agents=["calculator_agent"],
        serving=agl.Serving(
            backend="vllm",
            vllm_python=python,
            vllm_args=" ".join(["--dtype", "bfloat16", *SERVER_ARGS]),
            runners=8,
            run_dir=tmp_path / "run",
            progress=False,
        ),
        loop=agl.LoopConfig(tasks_per_step=2, steps=2, val_every=2, seed=0),
        config=agl.RunConfig(temperature=1.0, max_tokens=16),
        # every retry is the trainer's requeue at the seed place (the store's own retry, max_attempts=2,
        # would run a new, reseeded attempt of the same rollout, and the cut one would not be counted)
        rollout=RolloutSettings(max_attempts=1),
    )
    done = threading.Event()
    killer = threading.Thread(target=_kill_during_step, args=(trainer, 1, done), daemon=True)
    killer.start()
    try:
        out = trainer.fit(calc_agent, train, val)
    finally:
        done.set()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rollouts" in r]
    assert out["steps"] == 2 and len(steps) == 2
    assert all(r["rollouts"] == 8 and r["rollouts_failed"] == 0 for r in steps)  # nothing lost
    assert all(r["exact_token_ratio"] == 1.0 for r in steps)
    assert steps[0].get("engine_restarts") is None and steps[1]["engine_restarts"] == 1
    # the calls the kill cut are infrastructure failures (issue 64): their attempts are requeued at
    # their seed place and never scored, so every group trains whole, on finished attempts only
    killed = steps[1]["errored_rollouts/infra"]
    assert killed >= 1 and steps[1]["requeued_rollouts"] == killed, steps[1]
    assert steps[0]["errored_rollouts/infra"] == 0 and steps[0]["requeued_rollouts"] == 0
    assert all(r["effective_group_size"] == 4 and r["dropped_groups"] == 0 for r in steps)
    assert out["val_reward_before"] is not None and out["val_reward_after"] is not None
    log = (tmp_path / "run" / "vllm.log").read_text()
    assert log.count("=== agl:") == 2  # started, then restarted after the kill
    assert trainer.env is None or trainer.env.vllm_server is None  # stopped at the end
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    leftovers = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(tmp_path).encode() in cmdline:
            leftovers.append(pid)
    assert leftovers == []
