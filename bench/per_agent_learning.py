"""sql_agent's writer and rewriter: one shared policy vs an adapter per agent, from the same warm
start (issue 35).

The paper's two trained agents pull one set of weights two ways when they share a policy; with
``--adapter-per-agent`` each trains its own LoRA adapter (own optimizer state, GRPO groups and
advantages) on one frozen base. Both setups start from the very same policy: 128 oracle demonstrations,
one ``agl sft`` on them, merged into the model. The shared setup trains one fresh LoRA on that model;
the per-agent setup one fresh LoRA per agent on the same model (``train --adapter-per-agent
--warm-start`` of a shared SFT run), so at step 0 the two are the same weights and only RL differs.
(Per-agent SFT is not an option here: the oracle's queries are right the first time, so its
demonstrations hold no rewriter call.) Then the recipe of examples/sql_agent/README.md (16 steps x 6
questions x 4 rollouts at temperature 1.0, lr 2e-4, 16 runners) and one check on all 90 held-out
questions at the end. One subprocess at a time, the two setups interleaved per seed, finished runs
skipped (bench/_matrix.py). Seeds fixed here.

    python bench/per_agent_learning.py --build-warm-start   # demos, the SFT and its check if missing (~12 min)
    python bench/per_agent_learning.py                      # 2 setups x seeds 0 1 2 (~20 min a run here)
    python bench/per_agent_learning.py --report-only        # the table and plot of the runs there

Per run: held-out after, wall time and load; per setup: mean, seed range, and whether the mean gain
over the warm start exceeds twice the seed range (the project's bar for an RL result). The warm start's
own held-out figure: ``--build-warm-start`` measures it (``train --steps 0``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _matrix import dot_plot, finished, fmt, records, run_once, summary  # bench/, the script's own folder

SEEDS = (0, 1, 2)  # declared before the runs
SETUPS = ("shared", "per_agent")
RECIPE = (
    "--steps", "16", "--tasks-per-step", "6", "--group-size", "4", "--val-tasks", "90", "--val-every", "0",
    "--no-val-before", "--max-tokens", "64", "--temperature", "1.0", "--learning-rate", "2e-4",
    "--runners", "16", "--gradient-checkpointing", "off", "--micro-batch-tokens", "1024",
)  # fmt: skip


def _sft(root: Path, out: Path, threads: int) -> list[str]:
    return [
        sys.executable, "-m", "agl.cli", "sft", "--store", f"sqlite:///{root / 'sql_demos128.db'}",
        "--agents", "writer,rewriter", "--min-reward", "1", "--out", str(out), "--epochs", "1",
        "--batch-size", "4", "--learning-rate", "5e-4", "--threads", str(threads),
    ]  # fmt: skip


def _train(threads: int, warm: Path, run_dir: Path, per_agent: bool, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "examples.sql_agent", "--threads", str(threads), "train",
        "--warm-start", str(warm), "--run-dir", str(run_dir),
        *(["--adapter-per-agent"] if per_agent else []), *extra,
    ]  # fmt: skip


def warm_dir(root: Path) -> Path:
    """The one warm start of both setups: a shared ``agl sft`` run (its merged model)."""
    return root / "sft_shared"


def build_warm_starts(root: Path, threads: int) -> None:
    """The 128 oracle demonstrations, the SFT on them, and the warm start's held-out check."""
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if not (root / "sql_demos128.db").exists():
        demos = [sys.executable, "-m", "examples.sql_agent", "dev", "--oracle", "--split", "train", "-n", "128",
                 "--store", f"sqlite:///{root / 'sql_demos128.db'}"]  # fmt: skip
        subprocess.run(demos, check=True, env=env)
    out = warm_dir(root)
    if not (out / "sft_summary.json").exists():
        subprocess.run(_sft(root, out, threads), check=True, env=env)
    check = root / "warm_shared_s0"
    extra = ["--steps", "0", "--val-tasks", "90", "--runners", "16"]
    run_once(check, _train(threads, out, check, False, extra), "warm start")


def summarise(run_dir: Path) -> dict[str, Any]:
    steps = sum(1 for r in records(run_dir) if "train_reward" in r)
    return {**summary(run_dir, "setup"), "steps": steps}


def report(root: Path) -> list[dict[str, Any]]:
    rows = [summarise(d) for d in sorted(root.iterdir()) if d.is_dir() and finished(d)]
    print("| run | held-out (90) | steps | wall min | load |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['run']} | {fmt(r['val_after'])} | {r['steps']} | {r['wall_s'] / 60:.1f} | "
            f"{r['load'][0]:.1f}–{r['load'][1]:.1f} |"
        )
    for setup in SETUPS:
        after = [r["val_after"] for r in rows if r["setup"] == setup and r["val_after"] is not None]
        warm = [r["val_after"] for r in rows if r["setup"] == "warm_shared" and r["val_after"] is not None]
        if not after:
            continue
        mean, spread = statistics.fmean(after), max(after) - min(after)
        line = f"{setup}: {len(after)} seeds, held-out {mean:.3f} (range {spread:.3f})"
        if warm:
            gain = mean - warm[0]
            bar = "met" if len(after) > 1 and gain > 2 * spread else "not met"
            line += (
                f", gain over its warm start {gain:+.3f} (bar: gain > 2 x range = {2 * spread:.3f}: {bar})"
            )
        print(line)
    (root / "summary.json").write_text(json.dumps(rows, indent=1))
    if rows:
        plot(rows, root / "per_agent_learning.png")
    return rows


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    """Held-out per setup, warm start and after RL: one dot per seed, a bar at the mean."""
    labels = {"warm_shared": "warm start\n(both setups)", "shared": "RL, shared\npolicy",
              "per_agent": "RL, adapter\nper agent"}  # fmt: skip
    groups = [
        (label, [r["val_after"] for r in rows if r["setup"] == name and r["val_after"] is not None],
         "#c6dbef" if name.startswith("warm") else "#9ecae1")
        for name, label in labels.items()
    ]  # fmt: skip
    title = "sql_agent: writer + rewriter, shared policy vs an adapter each (dots: seeds)"
    dot_plot(groups, "held-out reward (90 questions)", title, out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=Path("runs/per_agent_learning"))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--build-warm-start", action="store_true", help="demos, the SFT and its check first")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    if args.build_warm_start:
        build_warm_starts(args.root, args.threads)
    if not args.report_only:
        if not (warm_dir(args.root) / "sft_summary.json").exists():
            raise SystemExit(f"no warm start in {args.root}: run with --build-warm-start first")
        for seed in args.seeds:
            for setup in args.setups:
                run_dir = args.root / f"{setup}_s{seed}"
                extra = ["--seed", str(seed), *RECIPE]
                cmd = _train(args.threads, warm_dir(args.root), run_dir, setup == "per_agent", extra)
                run_once(run_dir, cmd, f"{setup} seed={seed}")
    report(args.root)


if __name__ == "__main__":
    main()
