"""learn_on_cpu through the ``tinker`` backend (SkyRL's Tinker server on this CPU, started by the run)
against the embedded path, same seed, one run after the other: held-out reward before and after, and
seconds per step split into sampling (the step's rollouts), forward_backward, optim_step, saving the
state and weight sync. A functional comparison on a CPU, not a speed claim.

    AGL_TINKER_PYTHON=/path/to/tinker-venv/bin/python PYTHONPATH=<dir with tinker==0.12.0> \\
        python bench/tinker_backend.py [--steps 3] [--tasks 2] [--group 4] [--val 8] [--only tinker]

Prints one JSON line per run and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TINKER_TELEMETRY", "0")


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def run(backend: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import agl
    from examples.learn_on_cpu.agent import calc_agent
    from examples.learn_on_cpu.data import split

    train, val = split(n_val=args.val)
    serving: dict[str, Any] = {"backend": backend, "runners": args.group * args.tasks, "progress": False}
    if backend == "tinker":
        serving["tinker_python"] = os.environ["AGL_TINKER_PYTHON"]
    trainer = agl.Trainer(
        agl.LightningRL(group_size=args.group, learning_rate=args.lr, lora_r=8, lora_alpha=32, kl_coef=0.0),
        agents=["calculator_agent"],
        serving=agl.Serving(run_dir=root / backend, **serving),
        loop=agl.LoopConfig(
            tasks_per_step=args.tasks, steps=args.steps, val_every=args.steps, seed=args.seed
        ),
        config=agl.RunConfig(max_tokens=16),
    )
    load0, t0 = _load(), time.perf_counter()
    out = trainer.fit(calc_agent, train, val)
    wall = time.perf_counter() - t0
    steps = [r for r in out["history"] if "rollouts" in r]
    split_s = {
        k: sum(float(r.get(k, 0.0) or 0.0) for r in steps) / max(len(steps), 1)
        for k in (
            "rollout_s",
            "forward_backward_s",
            "optim_step_s",
            "save_state_s",
            "update_s",
            "sync_s",
            "step_s",
        )
    }
    return {
        "backend": backend,
        "wall_s": round(wall, 1),
        "val_before": out["val_reward_before"],
        "val_after": out["val_reward_after"],
        "per_step_s": {k: round(v, 1) for k, v in split_s.items()},
        "load": f"{load0}-{_load()}",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tasks", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--val", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=["tinker", "transformers"])
    p.add_argument("--root", default="runs/bench_tinker")
    args = p.parse_args()
    root = Path(args.root)
    results = [run(b, args, root) for b in ("transformers", "tinker") if args.only in (None, b)]
    for r in results:
        print(json.dumps(r))
    print(
        "| backend | wall s | held-out before → after | sampling s/step | forward_backward | optim_step | save_state | update (local) | weight sync | load |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        s = r["per_step_s"]
        print(
            f"| {r['backend']} | {r['wall_s']} | {r['val_before']} → {r['val_after']} | {s['rollout_s']} | "
            f"{s['forward_backward_s']} | {s['optim_step_s']} | {s['save_state_s']} | {s['update_s']} | "
            f"{s['sync_s']} | {r['load']} |"
        )


if __name__ == "__main__":
    main()
