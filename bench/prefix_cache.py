"""The main job with the embedded engine's prefix cache on (the default) and off, in the same run.

    python bench/prefix_cache.py [--rounds 3] [--root runs/bench_prefix] [-- extra train flags]
    python bench/prefix_cache.py --settings "fp32=" "bf16=--engine-dtype auto"   # any two settings

``--settings A=FLAGS B=FLAGS`` compares two other settings the same way (B / A), e.g. the engine in
fp32 (the default) against ``--engine-dtype auto``.

Each round runs ``python -m examples.learn_on_cpu train --seed 0`` twice, one subprocess at a time, once
with ``--prefix-cache-mb 0`` and once with the default, alternating which goes first, and reads what each
run wrote: wall time, the sum of the steps' ``rollout_s`` and ``engine_busy_s`` and ``update_s``, and the
held-out reward before and after (``metrics.jsonl``, ``summary.json``). The load average is read at the
start and end of each run. Ratios are taken within a round (on / off), so what a shared machine's load
does to absolute figures moves them less. A progress line per run; a table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SETTINGS = ["off=--prefix-cache-mb 0", "on="]


def run_once(root: Path, name: str, flags: list[str], extra: list[str]) -> dict[str, Any]:
    """One training run in ``root/name``; its figures."""
    run_dir = root / name
    cmd = [sys.executable, "-m", "examples.learn_on_cpu", "train", "--seed", "0", "--run-dir", str(run_dir)]
    cmd += ["--overwrite", *flags, *extra]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}")
    sums: dict[str, float] = {"rollout_s": 0.0, "engine_busy_s": 0.0, "update_s": 0.0}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key in sums:
            sums[key] += float(row.get(key) or 0.0)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "wall_s": wall,
        **sums,
        "before": summary["val_reward_before"],
        "after": summary["val_reward_after"],
        "load": (load0, os.getloadavg()[0]),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--root", default="runs/bench_prefix")
    p.add_argument("--settings", nargs=2, default=SETTINGS, metavar="NAME=FLAGS", help="the two settings")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if any("=" not in x for x in args.settings):
        p.error("--settings takes NAME=FLAGS twice")
    settings = {x.split("=", 1)[0]: x.split("=", 1)[1].split() for x in args.settings}
    a, b = list(settings)
    root = Path(args.root)
    results: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        order = [a, b] if r % 2 == 0 else [b, a]
        row: dict[str, dict[str, Any]] = {}
        for name in order:
            row[name] = run_once(root, f"r{r + 1}_{name}", settings[name], extra)
            f = row[name]
            print(
                f"round {r + 1} {name}: wall {f['wall_s']:.1f} s, rollouts {f['rollout_s']:.1f} s, "
                f"engine busy {f['engine_busy_s']:.1f} s, updates {f['update_s']:.1f} s, held-out "
                f"{f['before']:.3f} -> {f['after']:.3f}, load {f['load'][0]:.1f}-{f['load'][1]:.1f}",
                flush=True,
            )
        results.append(row)
    print(
        f"\n| round | setting | wall s | rollouts s | engine busy s | updates s | held-out | {b}/{a} wall | {b}/{a} rollouts |"
    )
    print("|---:|---|---:|---:|---:|---:|---|---:|---:|")
    for r, row in enumerate(results, 1):
        for name in (a, b):
            f = row[name]
            ratio = ("", "")
            if name == b:
                ratio = (
                    f"{f['wall_s'] / row[a]['wall_s']:.2f}",
                    f"{f['rollout_s'] / row[a]['rollout_s']:.2f}",
                )
            print(
                f"| {r} | {name} | {f['wall_s']:.1f} | {f['rollout_s']:.1f} | {f['engine_busy_s']:.1f} | "
                f"{f['update_s']:.1f} | {f['before']:.3f} -> {f['after']:.3f} | {ratio[0]} | {ratio[1]} |"
            )
    walls = [row[b]["wall_s"] / row[a]["wall_s"] for row in results]
    rolls = [row[b]["rollout_s"] / row[a]["rollout_s"] for row in results]
    print(
        f"\nmedian {b}/{a}: wall {statistics.median(walls):.2f} [{min(walls):.2f}-{max(walls):.2f}], "
        f"rollouts {statistics.median(rolls):.2f} [{min(rolls):.2f}-{max(rolls):.2f}]"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
