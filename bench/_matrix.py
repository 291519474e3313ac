"""A matrix of training runs, one subprocess at a time, resumable: what bench/judge_learning.py and
bench/per_agent_learning.py share.

Each run gets its own folder ``ROOT/<config>_s<seed>``; a folder with ``metrics.jsonl`` and
``wall.json`` is finished and skipped, any other is removed and run again, so a matrix stopped by a
session's end continues where it stopped. ``wall.json`` records the wall time and the load average at
the start and the end (the figures every measurement here states).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["finished", "records", "run_once", "wall"]


def finished(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").exists() and (run_dir / "wall.json").exists()


def run_once(run_dir: Path, cmd: Sequence[str], label: str) -> None:
    """Run ``cmd`` (which writes into ``run_dir``) unless ``run_dir`` holds a finished run."""
    if finished(run_dir):
        print(f"[skip] {run_dir} (done)", flush=True)
        return
    shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished earlier run
    print(f"[run] {label}: {' '.join(cmd[1:])}", flush=True)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    subprocess.run(list(cmd), check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (run_dir / "wall.json").write_text(
        json.dumps({"wall_s": time.perf_counter() - t0, "load_start": load0, "load_end": os.getloadavg()[0]})
    )


def records(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl, one dict per line."""
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def wall(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "wall.json").read_text())


def dot_plot(groups: Sequence[tuple[str, Sequence[float], str]], ylabel: str, title: str, out: Path) -> Path:
    """One bar per group at its mean and one dot per seed: ``groups`` is ``(label, values, bar colour)``."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [g for g in groups if g[1]]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (_, values, colour) in enumerate(shown):
        ax.bar(i, statistics.fmean(values), color=colour, width=0.6)
        ax.scatter([i] * len(values), list(values), color="#08519c", zorder=3)
    ax.set_xticks(range(len(shown)), [g[0] for g in shown], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def summary(run_dir: Path, name_key: str) -> dict[str, Any]:
    """What every matrix reports of a finished run: its folder, configuration (under ``name_key``),
    seed, last held-out reward, wall time and load."""
    vals = [r["val_reward"] for r in records(run_dir) if r.get("val_reward") is not None]
    timing = wall(run_dir)
    name, _, seed = run_dir.name.rpartition("_s")
    return {
        "run": run_dir.name,
        name_key: name,
        "seed": int(seed),
        "val_after": vals[-1] if vals else None,
        "wall_s": timing["wall_s"],
        "load": (timing["load_start"], timing["load_end"]),
    }


def fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"
