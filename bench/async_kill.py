"""The kill test on a real example: calc_agent trained asynchronously, its trainer SIGKILLed 3 times.

    python bench/async_kill.py                      # runs/bench_async_kill, kills after steps 1, 3, 5
    python bench/async_kill.py --kills-after 2 4 6 --steps 8 --run-dir runs/kill2

The run is ``python -m examples.calc_agent --threads 1 train --max-staleness 1 --checkpoint-every 1``
(the example's defaults otherwise: SmolLM2-135M, 2 tasks x 8 rollouts per step, 48 held-out problems
every 4 steps). Each time the metrics show the given step trained, the script waits a random 0-8 s
(seeded) so the kill lands inside a later step, SIGKILLs the trainer's whole process group (its
in-process runners and gateway die with it), and starts it again with ``--resume``. At the end, from
metrics.jsonl: every step appears once, the final step is reached, and every trained rollout id
appears in exactly one update, none of them also dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written when the process died
            continue
    return out


def _trained_steps(run_dir: Path) -> set[int]:
    return {r["step"] for r in _records(run_dir) if r.get("trained_rollout_ids")}


def _start(args: argparse.Namespace, resume: bool) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "examples.calc_agent", "--threads", "1", "train", "--run-dir", str(args.run_dir),
        "--max-staleness", str(args.k), "--checkpoint-every", "1", "--steps", str(args.steps),
        "--seed", str(args.seed),
    ]  # fmt: skip
    if resume:
        cmd.append("--resume")
    log = open(args.run_dir.parent / f"{args.run_dir.name}.log", "ab")  # noqa: SIM115 - the child's
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    args.run_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = _start(args, resume=False)
    kills: list[dict[str, Any]] = []
    for after in args.kills_after:
        while after not in _trained_steps(args.run_dir):
            if proc.poll() is not None:
                raise SystemExit(f"the trainer exited ({proc.returncode}) before step {after} trained")
            time.sleep(1.0)
        delay = rng.uniform(0.0, 8.0)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kills.append(
            {"after_step": after, "delay_s": round(delay, 1), "at_s": round(time.perf_counter() - t0, 1)}
        )
        print(f"[kill] SIGKILL after step {after} (+{delay:.1f} s); restarting with --resume", flush=True)
        proc = _start(args, resume=True)
    rc = proc.wait()
    wall = time.perf_counter() - t0
    records = _records(args.run_dir)
    steps = [r["step"] for r in records if "step_s" in r]
    trained = [rid for r in records for rid in r.get("trained_rollout_ids", [])]
    dropped = {rid for r in records for rid in r.get("dropped_rollout_ids", [])}
    vals = [r["val_reward"] for r in records if r.get("val_reward") is not None]
    result = {
        "exit": rc,
        "wall_s": round(wall, 1),
        "kills": kills,
        "steps": steps,
        "final_step_reached": bool(steps) and max(steps) >= args.steps - 1,
        "each_step_once": len(steps) == len(set(steps)),
        "trained_rollouts": len(trained),
        "trained_twice": len(trained) - len(set(trained)),
        "trained_and_dropped": len(set(trained) & dropped),
        "val_before_after": (vals[0], vals[-1]) if vals else None,
    }
    (args.run_dir / "kill_test.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, default=Path("runs/bench_async_kill"))
    parser.add_argument("--kills-after", type=int, nargs="+", default=[1, 3, 5])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--k", type=int, default=1, help="--max-staleness")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.run_dir.exists() and any(args.run_dir.iterdir()):
        raise SystemExit(f"{args.run_dir} is not empty: pick another --run-dir")
    result = run(args)
    print(json.dumps(result, indent=1))
    ok = (
        result["exit"] == 0
        and result["final_step_reached"]
        and result["each_step_once"]
        and not result["trained_twice"]
        and not result["trained_and_dropped"]
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
