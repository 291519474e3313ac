"""learn_on_cpu's update on 1 process, on 2 with DDP and on 2 with FSDP2 (``torchrun``, gloo, one
thread each): seconds per update, peak RSS per process, and the communication (and waiting) time per
step.

The update users run: ``PolicyUpdate.step`` on SmolLM2-135M-Instruct with learn_on_cpu's recipe (LoRA
r=16, alpha 32, lr 1e-3, clip 0.2, no KL, the default micro-batch budget) over one step of its size:
4 tasks x 4 rollouts = 16 calls, prompts of 110-170 tokens (the system prompt, the question, the
calculator's log) and replies of 4-16 tokens (``max_tokens=16``), advantages +-1, the engine's log-probs
present. The same fixed step (seed 0) is trained ``--steps`` times after one warm-up update; the three
configurations run in this one invocation, one after the other. FSDP2 is asked for as a user asks for
it under torchrun (``ACCELERATE_USE_FSDP=true FSDP_VERSION=2``; agl applies ``fully_shard`` on CPU).

    python bench/distributed.py               # 1 process, 2 DDP, 2 FSDP2, twice; a table
    python bench/distributed.py --steps 5 --rounds 3
    python bench/distributed.py --full        # full-parameter training (where FSDP2's sharding pays)

Per run: wall seconds per update (rank 0), CPU seconds per update summed over ranks (what the split
costs in work, whatever the load), communication and waiting per update, micro-batches per rank, peak
RSS per process, and the logged loss (the same on 1 and 2 processes).

Communication is timed around every ``torch.distributed`` collective the update makes (the step's
token totals, the one gradient all-reduce, the logged figures; under FSDP2 each unit's all-gather and
reduce-scatter, and the gather of the adapters into rank 0's copy): it includes the wait for the slower
rank, so it is an upper bound on the wire time (FSDP2's asynchronous collectives: their launch and
their ``Work.wait``). On this 2-core machine, shared with other work, 2
processes at one thread each use both cores: the speedup is bounded by the 2 cores and by the load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _transitions(seed: int = 0) -> tuple[list[Any], list[float]]:
    import random

    from agl.types import Transition

    rng = random.Random(seed)
    out, adv = [], []
    for task in range(4):
        prompt = tuple(rng.randrange(200, 40000) for _ in range(rng.randrange(110, 171)))
        for k in range(4):
            resp = tuple(rng.randrange(200, 40000) for _ in range(rng.randrange(4, 17)))
            lps = tuple(-rng.uniform(0.05, 3.0) for _ in resp)
            rid = f"t{task}-{k}"
            out.append(
                Transition(
                    rollout_id=rid,
                    attempt=1,
                    index=0,
                    prompt_ids=prompt,
                    response_ids=resp,
                    response_logprobs=lps,
                )
            )
            adv.append(1.0 if k % 2 else -1.0)
    return out, adv


def _timed_collectives() -> dict[str, float]:
    """Wrap torch.distributed's collectives so that their seconds add up in the returned dict."""
    import torch.distributed as dist

    spent = {"s": 0.0, "calls": 0.0}
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor"):
        real = getattr(dist, name, None)
        if real is None:
            continue

        def timed(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                spent["s"] += time.perf_counter() - t0
                spent["calls"] += 1

        setattr(dist, name, timed)
    real_wait = dist.Work.wait  # an asynchronous collective's (FSDP2's) time is spent in its wait

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real_wait(self, *args, **kwargs)
        finally:
            spent["s"] += time.perf_counter() - t0

    dist.Work.wait = wait
    return spent


def worker(out: Path, steps: int, full: bool) -> None:
    import torch

    torch.set_num_threads(1)
    spent = _timed_collectives()
    from agl.trainer import malloc

    malloc.tune()  # as Trainer.fit does: freed buffers leave the process
    import agl
    from agl.algorithms.update import PolicyUpdate
    from agl.chat.models import prepare_default_model
    from agl.config import RunConfig

    algo = agl.LightningRL(
        group_size=4, learning_rate=1e-3, lora=not full, lora_r=16, lora_alpha=32, clip_eps=0.2, kl_coef=0.0
    )
    config = RunConfig.resolve(algo, sampling={"temperature": 0.7, "max_tokens": 16})
    model = str(prepare_default_model(progress=False))
    policy = PolicyUpdate(model, None, config, output_dir=out / "ckpt", seed=0)
    ts, adv = _transitions()
    policy.step(ts, adv)  # warm-up: allocator, first backward
    update_s, cpu_s, comm_s, micro = [], [], [], []
    for _ in range(steps):
        c0 = spent["s"]
        t0, p0 = time.perf_counter(), time.process_time()
        m = policy.step(ts, adv)
        update_s.append(time.perf_counter() - t0)
        cpu_s.append(time.process_time() - p0)
        comm_s.append(spent["s"] - c0)
        micro.append(m["micro_batches"])
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "rank": rank,
        "world": int(os.environ.get("WORLD_SIZE", "1")),
        "update_s": update_s,
        "cpu_s": cpu_s,
        "comm_s": comm_s,
        "micro_batches": micro,
        "loss": m["loss"],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "micro_batch_tokens": policy.micro_batch_tokens,
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(record))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: the configurations compared: (label, processes, extra environment)
CONFIGS: list[tuple[str, int, dict[str, str]]] = [
    ("1 process", 1, {}),
    ("2 DDP", 2, {}),
    ("2 FSDP2", 2, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}),
]


def _run(nproc: int, out: Path, steps: int, extra: dict[str, str], full: bool) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    me = [str(Path(__file__).resolve()), "--worker", str(out), "--steps", str(steps)]
    me += ["--full"] if full else []
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={_free_port()}",
    ]
    cmd = [*launch, *me] if nproc > 1 else [sys.executable, *me]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra}
    subprocess.run(cmd, check=True, env=env)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--full", action="store_true", help="full-parameter training instead of LoRA")
    parser.add_argument("--rounds", type=int, default=2, help="the three configurations, this many times")
    parser.add_argument("--out", type=Path, default=Path("bench/results/distributed"))
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.steps, args.full)
        return
    rows = []
    for k in range(args.rounds):  # interleaved, so that a change of load hits both alike
        for j, (label, n, extra) in enumerate(CONFIGS):
            load = os.getloadavg()[0]
            ranks = _run(n, args.out / f"r{k}-c{j}", args.steps, extra, args.full)
            rows.append({"round": k, "n": label, "load_1min": load, "ranks": ranks})
    print(
        "round | run | load (1 min) | update s/step | CPU s/step, all ranks | comm+wait s/step (rank 0 / 1) | micro-batches/rank | peak RSS MiB/process | loss"
    )
    for row in rows:
        ranks = row["ranks"]
        comm = " / ".join(f"{_mean(r['comm_s']):.2f}" for r in ranks)
        mbs = " / ".join(f"{_mean(r['micro_batches']):.0f}" for r in ranks)
        rss = " / ".join(f"{r['peak_rss_mib']:.0f}" for r in ranks)
        print(
            f"{row['round']} | {row['n']} | {row['load_1min']:.1f} | {_mean(ranks[0]['update_s']):.1f}"
            f" | {sum(_mean(r['cpu_s']) for r in ranks):.1f} | {comm}"
            f" | {mbs} | {rss} | {ranks[0]['loss']:.6f}"
        )
    (args.out / "summary.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
