"""Synchronous vs asynchronous LightningRL on ``learn_on_cpu`` and calc_agent's recipe: wall time,
engine share, held-out reward.

The path users run, one subprocess per run, one run at a time, the configurations interleaved per
seed so that a change of machine load hits them alike. The seeds are fixed here, before anything runs.

- ``learn_on_cpu``: ``python -m examples.learn_on_cpu train --max-staleness K --seed S`` (SmolLM2-135M
  on the embedded transformers engine, LoRA r=16, 8 steps x 4 tasks x 4 rollouts, 24 held-out
  questions every 2 steps).
- ``calc_agent``: the recipe of examples/calc_agent/README.md (warm start from ``--warm-start DIR``,
  the 64-demonstration SFT; 8 steps x 8 problems x 4 samples at temperature 0.8, lr 2e-4, 16 runners,
  one greedy check on all 100 held-out problems at the end) with ``--max-staleness K``.

    python bench/async_training.py                       # learn_on_cpu, k = 0 and 1, seeds 0 1 2
    python bench/async_training.py --ks 0 1 2 --seeds 0  # another matrix
    python bench/async_training.py --example calc_agent --warm-start runs/calc_sft64 --ks 0 1 2
    python bench/async_training.py --report-only         # the table of runs already there
    python bench/async_training.py --vllm-python V/bin/python --seeds 0   # learn_on_cpu served by a
                                                         # managed vLLM server (issue 50), k = 0 and 1

Per run, from its metrics.jsonl: wall time (the process, model load included), mean seconds per step,
held-out reward before and after, the engine's busy share (``engine_busy_s`` over ``step_s``), the
update's seconds, staleness and dropped groups, and whether any rollout was trained twice. The
projection for an engine and a trainer on separate devices: a synchronous step costs rollouts + update,
an asynchronous one the larger of the two (measured here, per step, in the synchronous runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SEEDS = (0, 1, 2)  # declared before the runs (bench/README.md)
KS = (0, 1)


CALC_RECIPE = (
    "--steps", "8", "--tasks-per-step", "8", "--group-size", "4", "--val-tasks", "100", "--val-every", "0",
    "--no-val-before", "--max-tokens", "64", "--temperature", "0.8", "--learning-rate", "2e-4",
    "--runners", "16", "--gradient-checkpointing", "off", "--micro-batch-tokens", "1024",
)  # fmt: skip


def _command(args: argparse.Namespace, k: int, seed: int, run_dir: Path) -> list[str]:
    common = ["--seed", str(seed), "--max-staleness", str(k), "--run-dir", str(run_dir)]
    if args.example == "calc_agent":  # no --overwrite there: _run starts it in an empty folder
        threads = str(args.threads or 2)
        warm = ["--warm-start", str(args.warm_start)] if args.warm_start else []
        return [
            sys.executable,
            "-m",
            "examples.calc_agent",
            "--threads",
            threads,
            "train",
            *common,
            *warm,
            *CALC_RECIPE,
        ]
    return [
        sys.executable,
        "-m",
        "examples.learn_on_cpu",
        "train",
        *common,
        "--overwrite",
        "--threads",
        str(args.threads),
        *(["--backend", "vllm", "--vllm-python", str(args.vllm_python)] if args.vllm_python else []),
    ]


def _run(args: argparse.Namespace, k: int, seed: int) -> None:
    run_dir = args.root / f"k{k}_s{seed}"
    if (run_dir / "metrics.jsonl").exists() and (run_dir / "wall.json").exists():
        print(f"[skip] {run_dir} (done)", flush=True)
        return
    cmd = _command(args, k, seed, run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished earlier run
    print(f"[run] k={k} seed={seed}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    (run_dir / "wall.json").write_text(
        json.dumps({"wall_s": wall, "load_start": load0, "load_end": os.getloadavg()[0]})
    )


def _summary(run_dir: Path) -> dict[str, Any]:
    records = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    steps = [r for r in records if "step_s" in r]
    vals = [r["val_reward"] for r in records if r.get("val_reward") is not None]
    wall = json.loads((run_dir / "wall.json").read_text())
    trained = [rid for r in steps for rid in r.get("trained_rollout_ids", [])]
    step_s = sum(r["step_s"] for r in steps)
    busy = sum(r.get("engine_busy_s", 0.0) for r in steps)
    return {
        "run": run_dir.name,
        "wall_s": wall["wall_s"],
        "load": (wall["load_start"], wall["load_end"]),
        "steps": len(steps),
        "s_per_step": step_s / max(len(steps), 1),
        # the training steps alone (a held-out check that ran after the last one is its own record)
        "s_per_train_step": statistics.fmean([r["step_s"] for r in steps if "train_reward" in r] or [0.0]),
        "val_before": vals[0] if vals else None,
        "val_after": vals[-1] if vals else None,
        "busy_share": busy / step_s if step_s else None,
        "update_s": sum(r.get("update_s", 0.0) for r in steps),
        "staleness_mean": statistics.fmean([r["staleness_mean"] for r in steps if r.get("staleness_mean") is not None] or [0.0]),
        "dropped": sum(r.get("stale_groups_dropped", 0) for r in steps),
        "trained_twice": len(trained) - len(set(trained)),
        "projected_speedup": _projection(steps),
    }  # fmt: skip


def _projection(steps: list[dict[str, Any]]) -> float | None:
    """A synchronous run's steps replayed with the engine and the trainer on separate devices and the
    rollouts enqueued ahead: a step costs the larger of its rollouts and its update, not their sum
    (None for an asynchronous run: its ``rollout_s`` is the trainer's wait, not the rollouts' time)."""
    if any(r.get("max_staleness") for r in steps):
        return None
    pairs = [(r["rollout_s"], r.get("update_s", 0.0)) for r in steps if "rollout_s" in r]
    if not pairs:
        return None
    return sum(a + b for a, b in pairs) / max(sum(max(a, b) for a, b in pairs), 1e-9)


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def report(root: Path) -> list[dict[str, Any]]:
    rows = [_summary(d) for d in sorted(root.iterdir()) if (d / "wall.json").exists()]
    print(
        "| run | wall s | s/step | s/train step | held-out before → after | engine busy | update s | staleness | dropped | trained twice | load |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['run']} | {r['wall_s']:.0f} | {r['s_per_step']:.1f} | {r['s_per_train_step']:.1f} | {_fmt(r['val_before'])} → {_fmt(r['val_after'])} | "
            f"{r['busy_share']:.0%} | {r['update_s']:.0f} | {r['staleness_mean']:.2f} | {r['dropped']} | "
            f"{r['trained_twice']} | {r['load'][0]:.1f}–{r['load'][1]:.1f} |"
        )
    for k in sorted({r["run"].split("_")[0] for r in rows}):
        group = [r for r in rows if r["run"].startswith(k + "_")]
        after = [r["val_after"] for r in group]
        proj = [r["projected_speedup"] for r in group if r["projected_speedup"] is not None]
        print(
            f"{k}: {len(group)} seeds, wall {statistics.fmean(r['wall_s'] for r in group):.0f} s, "
            f"s/step {statistics.fmean(r['s_per_step'] for r in group):.1f} (training steps "
            f"{statistics.fmean(r['s_per_train_step'] for r in group):.1f}), held-out after "
            f"{statistics.fmean(after):.3f} (range {max(after) - min(after):.3f}), busy "
            f"{statistics.fmean(r['busy_share'] for r in group):.0%}"
            + (
                f", projected separate-device speedup {statistics.fmean(p for p in proj):.2f}x"
                if proj
                else ""
            )
        )
    (root / "summary.json").write_text(json.dumps(rows, indent=1))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--example", choices=("learn_on_cpu", "calc_agent"), default="learn_on_cpu")
    parser.add_argument("--warm-start", type=Path, default=None, help="calc_agent: the SFT warm start folder")
    parser.add_argument("--root", type=Path, default=None, help="default runs/bench_async[_calc]")
    parser.add_argument("--ks", type=int, nargs="+", default=list(KS))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help="learn_on_cpu: serve the policy from a managed vLLM server run by this interpreter",
    )
    args = parser.parse_args()
    if args.root is None:
        args.root = Path("runs/bench_async" + ("_calc" if args.example == "calc_agent" else ""))
    args.root.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for seed in args.seeds:
            for k in args.ks:
                _run(args, k, seed)
    report(args.root)


if __name__ == "__main__":
    main()
