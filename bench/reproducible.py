"""What reproducible generation costs and what it buys: the transformers engine, default vs ``deterministic=True``.

    python bench/reproducible.py [--threads 1] [--new-tokens 32] [--rounds 3]

SmolLM2-135M-Instruct (``agl models prepare``), one model object shared by two engines: the default one
(continuous batching, up to 8 rows) and a ``deterministic=True`` one (one row at a time). Each round
sends the same 8 seeded requests (temperature 1, distinct seeds, the prompts of bench/generation.py)
concurrently to each engine, in alternating order, and counts generated tokens per second of wall time
(ratios are taken within a round: the load of a shared machine moves them much less than absolute
figures). It also sends each request *alone* to both engines and reports how many of the 8 batched
replies equal the lone reply token for token, and with their log-probs to the last bit: the
deterministic engine must give 8/8 by construction; the default engine's counts show how often
batching's float rounding flips a draw at temperature 1, and how often it changes the behaviour
log-probs the update weighs each token by.

Training runs (the path users run, one subprocess per run, ``--deterministic`` appended with the seed
and the run directory; the load average is sampled every 30 s while they run):

    python bench/reproducible.py twice --root runs/repro/loc -- python -m examples.learn_on_cpu train --threads 1
    python bench/reproducible.py twice --root runs/repro/calc -- python -m examples.calc_agent --threads 1 \
        train --warm-start runs/calc_sft64 --steps 4 --tasks-per-step 8 --group-size 4 --val-tasks 24 ...
    python bench/reproducible.py paired --root runs/repro/async --seeds 0 1 --setting "--max-staleness 1" \
        -- python -m examples.learn_on_cpu train --threads 1
    python bench/reproducible.py twice --root runs/repro/loc --report-only    # runs already there

``twice`` runs the same command with the same seed into ``ROOT/a`` and ``ROOT/b`` *at once* (so their
runners finish in different orders), then reports ``agl diff``'s verdict, whether the train reward,
held-out reward and loss of every step are equal to the bit, the SHA-256 of each run's last adapter, and
each run's wall time. ``paired`` runs, per seed, the command and the command with ``--setting`` at once
(``ROOT/base_s<seed>``, ``ROOT/changed_s<seed>``; a finished pair is kept) and reports the held-out
reward of both at every check and the paired difference, with its spread over the seeds.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how photosynthesis works.",
    "List some tips for learning a new language.",
    "Describe the city of Paris to a tourist.",
    "What are the benefits of regular exercise?",
    "Explain what a neural network is.",
    "Write a poem about the sea.",
    "How do airplanes stay in the air?",
]
SEEDS = [1000 + i for i in range(8)]


def _requests(new_tokens: int) -> list[Any]:
    from agl.gateway.backends.base import GenerationRequest

    return [
        GenerationRequest(
            model="m",
            messages=[{"role": "user", "content": p}],
            seed=s,
            temperature=1.0,
            max_tokens=new_tokens,
        )
        for p, s in zip(PROMPTS, SEEDS, strict=True)
    ]


Reply = tuple[list[int], list[float]]  # response ids, their log-probs


async def _batch(engine: Any, new_tokens: int) -> tuple[float, list[Reply]]:
    """Tokens per second for the 8 requests at once, and their replies."""
    t0 = time.perf_counter()
    out = await asyncio.gather(*(engine.generate(r) for r in _requests(new_tokens)))
    dt = time.perf_counter() - t0
    replies = [(o.choices[0].response_ids, o.choices[0].logprobs) for o in out]
    return sum(len(ids) for ids, _ in replies) / dt, replies


async def _alone(engine: Any, new_tokens: int) -> list[Reply]:
    out = [(await engine.generate(r)).choices[0] for r in _requests(new_tokens)]
    return [(c.response_ids, c.logprobs) for c in out]


async def run(threads: int, new_tokens: int, rounds: int) -> dict[str, Any]:
    import torch

    from agl.engine import EngineSettings
    from agl.gateway.backends.transformers import TransformersBackend

    torch.set_num_threads(threads)
    default = TransformersBackend(settings=EngineSettings(max_batch_size=8, threads=threads))
    default.engine.load()
    det = TransformersBackend(
        default.model,
        tokenizer=default.tokenizer,
        settings=EngineSettings(deterministic=True, threads=threads),
    )
    await _batch(default, 4)  # warm-up: first-call allocations out of the figures
    await _batch(det, 4)
    tps: dict[str, list[float]] = {"default": [], "deterministic": []}
    batched: dict[str, list[Reply]] = {}
    for k in range(rounds):
        order = [("default", default), ("deterministic", det)]
        for name, engine in order if k % 2 == 0 else order[::-1]:
            rate, ids = await _batch(engine, new_tokens)
            tps[name].append(rate)
            if name in batched and batched[name] != ids:
                print(f"  note: {name} gave other tokens in round {k} than in round 0")
            batched.setdefault(name, ids)
        print(
            f"round {k}: default {tps['default'][-1]:.1f} tok/s, deterministic {tps['deterministic'][-1]:.1f} tok/s",
            flush=True,
        )
    same, exact = {}, {}
    for name, engine in (("default", default), ("deterministic", det)):
        alone = await _alone(engine, new_tokens)
        same[name] = sum(1 for a, b in zip(alone, batched[name], strict=True) if a[0] == b[0])
        exact[name] = sum(1 for a, b in zip(alone, batched[name], strict=True) if a == b)
    return {"tps": tps, "same_alone_vs_batch": same, "exact_alone_vs_batch": exact}


def engine_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: a shared CPU)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    res = asyncio.run(run(args.threads, args.new_tokens, args.rounds))
    d, t = res["tps"]["default"], res["tps"]["deterministic"]
    ratios = [b / a for a, b in zip(d, t, strict=True)]
    print(
        f"8 concurrent seeded requests, {args.new_tokens} new tokens, {args.threads} thread(s): default "
        f"{statistics.median(d):.1f} tok/s, deterministic {statistics.median(t):.1f} tok/s, ratio "
        f"{statistics.median(ratios):.2f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    s, e = res["same_alone_vs_batch"], res["exact_alone_vs_batch"]
    print(
        f"batched reply == the same request alone: tokens: default {s['default']}/8, deterministic "
        f"{s['deterministic']}/8; tokens and log-probs to the bit: default {e['default']}/8, "
        f"deterministic {e['deterministic']}/8"
    )


# ------------------------------------------------------------------------------------ training runs
class LoadSampler:
    """The 1-minute load average every ``every`` seconds while runs go (each figure states its load)."""

    def __init__(self, every: float = 30.0) -> None:
        self.samples: list[float] = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(every,), daemon=True)
        self._thread.start()

    def _loop(self, every: float) -> None:
        while not self._stop.wait(every):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])
        return {
            "load_min": min(self.samples),
            "load_max": max(self.samples),
            "load_mean": statistics.fmean(self.samples),
        }


def run_at_once(jobs: dict[Path, list[str]]) -> dict[str, Any]:
    """Start every command at once (each writes its run directory), wait for all: wall time each, load."""
    sampler = LoadSampler()
    t0 = time.perf_counter()
    procs = {}
    for run_dir, cmd in jobs.items():
        shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished earlier run
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        log = open(run_dir.parent / f"{run_dir.name}.log", "wb")  # noqa: SIM115 - closed below
        procs[run_dir] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log)
        print(f"[run] {run_dir}: {shlex.join(cmd)}", flush=True)
    walls = {}
    for run_dir, (proc, log) in procs.items():
        rc = proc.wait()
        log.close()
        walls[run_dir.name] = time.perf_counter() - t0
        if rc != 0:
            raise SystemExit(f"{run_dir}: exit status {rc} (log: {run_dir.parent / f'{run_dir.name}.log'})")
        (run_dir / "wall.json").write_text(json.dumps({"wall_s": walls[run_dir.name]}))
    return {"wall_s": walls, **sampler.stop()}


def _cmd(
    base: list[str], seed: int, run_dir: Path, extra: Sequence[str] = (), deterministic: bool = True
) -> list[str]:
    cmd = [sys.executable if c in ("python", "python3") else c for c in base]
    det = ["--deterministic"] if deterministic else []
    return [*cmd, *extra, *det, "--seed", str(seed), "--run-dir", str(run_dir)]


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _series(run_dir: Path, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in _records(run_dir) if isinstance(r.get(key), (int, float))]


def last_adapter_sha(run_dir: Path) -> str | None:
    """SHA-256 of the newest checkpoint's adapter weights (None: no checkpoint saved)."""
    files = sorted(
        (run_dir / "checkpoints").glob("*/adapter_model.safetensors"), key=lambda p: p.stat().st_mtime
    )
    return hashlib.sha256(files[-1].read_bytes()).hexdigest() if files else None


def compare_twice(a: Path, b: Path) -> dict[str, Any]:
    """``agl diff a b`` and the per-step train reward, held-out reward and loss of both, bit for bit."""
    import io

    from agl.cli.diff import format_diff
    from agl.reports.diff import diff_runs, open_run

    ra, rb = open_run(str(a)), open_run(str(b))
    try:
        result = diff_runs(ra, rb)
    finally:
        ra.store.close()
        rb.store.close()
    text = io.StringIO()
    format_diff(result, file=text)
    out: dict[str, Any] = {"diff": text.getvalue().strip(), "identical": result.identical}
    for key in ("train_reward", "val_reward", "loss"):
        sa, sb = _series(a, key), _series(b, key)
        out[key] = {"a": sa, "b": sb, "equal": sa == sb}
    out["adapter_sha256"] = {"a": last_adapter_sha(a), "b": last_adapter_sha(b)}
    for name in (a, b):
        if (name / "wall.json").exists():
            out.setdefault("wall_s", {})[name.name] = json.loads((name / "wall.json").read_text())["wall_s"]
    return out


def twice_main(args: argparse.Namespace) -> None:
    root = Path(args.root)
    a, b = root / args.names[0], root / args.names[1]
    load = None
    if not args.report_only:
        if not args.command:
            raise SystemExit("twice: give the training command after --")
        load = run_at_once(
            {d: _cmd(args.command, args.seed, d, deterministic=not args.batched) for d in (a, b)}
        )
    out = compare_twice(a, b)
    if load is not None:
        out["load"] = load
        (root / "twice.json").write_text(json.dumps(out, indent=1))
    print(out["diff"])
    for key in ("train_reward", "val_reward", "loss"):
        print(f"{key}: {'equal' if out[key]['equal'] else 'DIFFER'}: A {out[key]['a']}")
        if not out[key]["equal"]:
            print(f"{' ' * len(key)}         B {out[key]['b']}")
    sha = out["adapter_sha256"]
    print(
        f"last adapter SHA-256: A {sha['a']}, B {sha['b']} ({'same' if sha['a'] == sha['b'] else 'DIFFER'})"
    )
    print(f"wall: {out.get('wall_s')}; load: {out.get('load')}")


def _val(run_dir: Path) -> list[tuple[int, float]]:
    return _series(run_dir, "val_reward")


def paired_main(args: argparse.Namespace) -> None:
    root = Path(args.root)
    setting = shlex.split(args.setting)
    rows = []
    for seed in args.seeds:
        base, changed = root / f"base_s{seed}", root / f"changed_s{seed}"
        todo = {d: c for d, c in ((base, []), (changed, setting)) if not (d / "wall.json").exists()}
        if todo and not args.report_only:
            load = run_at_once({d: _cmd(args.command, seed, d, c) for d, c in todo.items()})
            (root / f"load_s{seed}.json").write_text(json.dumps(load))
        if not ((base / "wall.json").exists() and (changed / "wall.json").exists()):
            print(f"seed {seed}: not run")
            continue
        vb, vc = dict(_val(base)), dict(_val(changed))
        steps = sorted(set(vb) & set(vc))
        diffs = [vc[s] - vb[s] for s in steps]
        rows.append(
            {
                "seed": seed,
                "steps": steps,
                "base": [vb[s] for s in steps],
                "changed": [vc[s] for s in steps],
                "diff": diffs,
            }
        )
        print(
            f"seed {seed}: held-out at steps {steps}: base {rows[-1]['base']}, changed {rows[-1]['changed']}, changed - base {[round(d, 3) for d in diffs]}"
        )
    finals = [r["diff"][-1] for r in rows if r["diff"]]
    if finals:
        spread = statistics.stdev(finals) if len(finals) > 1 else float("nan")
        print(
            f"paired difference of the last check (changed - base): mean {statistics.fmean(finals):+.3f}, sd {spread:.3f}, over {len(finals)} seed(s)"
        )
    (root / "paired.json").write_text(json.dumps({"setting": args.setting, "rows": rows}, indent=1))


def main() -> None:
    argv = sys.argv[1:]
    if not argv or argv[0] not in ("engine", "twice", "paired"):
        argv = ["engine", *argv]  # the engine benchmark is the default, as before
    if argv[0] == "engine":
        engine_main(argv[1:])
        return
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["twice", "paired"])
    parser.add_argument("--root", required=True, help="folder of the runs")
    parser.add_argument("--seed", type=int, default=0, help="twice: the seed of both runs")
    parser.add_argument("--names", nargs=2, default=["a", "b"], help="twice: the two run folders in ROOT")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="paired: the seeds (declare them first)"
    )
    parser.add_argument("--setting", default="", help="paired: the flags the changed run adds")
    parser.add_argument(
        "--batched", action="store_true", help="twice: the default engine (no --deterministic), for contrast"
    )
    parser.add_argument("--report-only", action="store_true", help="report the runs already in ROOT")
    args = parser.parse_args(argv)
    args.command = command
    (twice_main if args.mode == "twice" else paired_main)(args)


if __name__ == "__main__":
    main()
