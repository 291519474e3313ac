"""How much judge noise costs learning: rag_agent trained on exact F1 vs stand-in LLM judges (issue 38).

No capable judge model runs on this CPU, so the judges are stand-ins served through the real judge path
(the judge's own gateway, trajectories rendered from spans, the JSON protocol, the cache, the judge
store, reward assembly; examples/rag_agent/judge.py); only the judge model is replaced:

- ``f1``: exact F1 (with the format bonus), no judge: the reference;
- ``j01`` / ``j03``: relative mode (one call per group), each trajectory scored F1 + N(0, sigma^2) noise,
  sigma 0.1 / 0.3, clipped to [0, 1], seeded by the run's seed and the trajectory's text;
- ``rubric``: absolute mode (one call per rollout), 1 / 0.5 / 0 for F1 >= 0.8 / > 0 / 0 against the
  gold answer as reference.

Held-out reward stays exact F1 (all 244 held-out questions, or the first N with ``--val-tasks N``):
only what training sees changes. Each run is the 128-demonstration recipe of
examples/rag_agent/README.md (warm start ``--warm-start DIR``, 8 steps x 4 questions x 4 rollouts at
temperature 1.0, lr 2e-4, 16 runners), one subprocess at a time, the sources interleaved per seed so
that a change of machine load hits them alike, finished runs skipped (the matrix survives being
stopped). The seeds are fixed here, before anything runs.

    python bench/judge_learning.py --build-warm-start     # runs/rag_sft128 if missing (~10 min)
    python bench/judge_learning.py                        # 4 sources x seeds 0 1 2 (~22 min a run here)
    python bench/judge_learning.py --report-only          # the table and plot of the runs there
    python bench/judge_learning.py --val-tasks 72 --sources j01 rubric --seeds 1 2   # a part, 72-q check

Per run, from its metrics.jsonl: held-out F1 after, judge calls / prompt+completion tokens / seconds
per step, skipped groups, wall time and the machine's load. Per source: mean held-out, seed range, and
the difference from exact F1's mean. Plot: ``ROOT/judge_learning.png``.
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
HELDOUT = 244  # rag_agent's held-out questions
SOURCES: dict[str, list[str]] = {
    "f1": [],
    "j01": ["--judge", "noisy-f1", "--judge-sigma", "0.1"],
    "j03": ["--judge", "noisy-f1", "--judge-sigma", "0.3"],
    "rubric": ["--judge", "rubric"],
}
LABELS = {
    "f1": "exact F1",
    "j01": "judge: F1 + noise 0.1 (relative)",
    "j03": "judge: F1 + noise 0.3 (relative)",
    "rubric": "judge: rubric (absolute)",
}
RECIPE = (
    "--steps", "8", "--tasks-per-step", "4", "--group-size", "4", "--val-every", "0",
    "--no-val-before", "--max-tokens", "64", "--temperature", "1.0", "--learning-rate", "2e-4",
    "--runners", "16", "--gradient-checkpointing", "off", "--micro-batch-tokens", "1024",
)  # fmt: skip
WARM_START = (
    [sys.executable, "-m", "examples.rag_agent", "dev", "--oracle", "--split", "train", "-n", "128",
     "--store", "sqlite:///{root}/rag_demos128.db"],
    [sys.executable, "-m", "agl.cli", "sft", "--store", "sqlite:///{root}/rag_demos128.db", "--agents",
     "researcher", "--min-reward", "1", "--out", "{out}", "--epochs", "1", "--batch-size", "4",
     "--learning-rate", "5e-4", "--threads", "{threads}"],
)  # fmt: skip


def command(
    source: str, seed: int, run_dir: Path, warm_start: Path, threads: int, val_tasks: int = HELDOUT
) -> list[str]:
    judge = list(SOURCES[source])
    if judge and judge[1] == "noisy-f1":
        judge += ["--judge-seed", str(seed)]
    return [
        sys.executable, "-m", "examples.rag_agent", "--threads", str(threads), "train",
        "--warm-start", str(warm_start), "--seed", str(seed), "--run-dir", str(run_dir), *RECIPE,
        "--val-tasks", str(val_tasks), *judge,
    ]  # fmt: skip


def build_warm_start(out: Path, threads: int) -> None:
    """The recipe's 128 oracle demonstrations and its SFT, unless ``out`` already holds a model."""
    if (out / "model").exists():
        print(f"[skip] {out} (done)", flush=True)
        return
    root = out.parent
    root.mkdir(parents=True, exist_ok=True)
    for template in WARM_START:
        cmd = [a.format(root=root, out=out, threads=threads) for a in template]
        print("[run]", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def run_one(root: Path, source: str, seed: int, warm_start: Path, threads: int, val_tasks: int) -> None:
    run_dir = root / f"{source}_s{seed}"
    cmd = command(source, seed, run_dir, warm_start, threads, val_tasks)
    run_once(run_dir, cmd, f"{source} seed={seed}")


def judge_gap(run_dir: Path) -> float | None:
    """Mean |task reward - judge score| over every rollout the run's judge scored, read back from the
    judge store's recorded verdicts and the run store's reward spans (None: no judge). It is the
    divergence monitor's figure over the whole run; runs made before that monitor compared the
    reported task reward (aed4ce5) logged 0 for it, so the bench recomputes it from the stores."""
    if not (run_dir / "judge.db").exists():
        return None
    import agl.store
    from agl import semconv as sc
    from agl.reports.inspect import final_reward_of

    judge_store = agl.store.open(f"sqlite:///{run_dir / 'judge.db'}")
    run_store = agl.store.open(f"sqlite:///{run_dir / 'store.db'}")
    try:
        verdicts: dict[str, float] = {}
        for span in judge_store.query_spans(name=sc.SPAN_OBJECT):
            record = json.loads(span.attributes[sc.AGL_OBJECT_JSON])
            verdicts.update(
                zip(record.get("judged", []), (s for s, _ in record.get("scores", [])), strict=True)
            )
        gaps = []
        for rollout in run_store.query_rollouts(ids=list(verdicts)):
            task = final_reward_of(run_store, rollout)
            if task is not None:
                gaps.append(abs(task - verdicts[rollout.id]))
        return statistics.fmean(gaps) if gaps else None
    finally:
        judge_store.close()
        run_store.close()


def heldout_first(run_dir: Path, n: int) -> float | None:
    """Held-out F1 over the first ``n`` held-out questions of the run's final check, read from its
    store (tasks ``val-0`` .. ``val-{n-1}``, the same questions as ``--val-tasks n``); None until all
    ``n`` have finished. For a run whose 244-question check was cut short."""
    import agl.store
    from agl.reports.inspect import final_reward_of

    store = agl.store.open(f"sqlite:///{run_dir / 'store.db'}")
    try:
        wanted = {f"val-{i}" for i in range(n)}
        done = [
            r for r in store.query_rollouts(mode="val") if r.task_id in wanted and r.status == "succeeded"
        ]
        if len({r.task_id for r in done}) < n:
            return None
        return statistics.fmean(final_reward_of(store, r) or 0.0 for r in done)
    finally:
        store.close()


def summarise(run_dir: Path, first: int | None = None) -> dict[str, Any]:
    """One run's figures from its metrics.jsonl and wall.json; with ``first``, held-out F1 over the
    first ``first`` held-out questions (from the store), also for a run whose final check was cut."""
    steps = [r for r in records(run_dir) if "train_reward" in r]

    def per_step(key: str) -> float:
        return statistics.fmean([float(r.get(key) or 0.0) for r in steps] or [0.0])

    if finished(run_dir):
        base = summary(run_dir, "source")
    else:
        name, _, seed = run_dir.name.rpartition("_s")
        base = {
            "run": run_dir.name,
            "source": name,
            "seed": int(seed),
            "val_after": None,
            "wall_s": None,
            "load": None,
        }
    if first:
        base["val_after"] = heldout_first(run_dir, first)
    return {
        **base,
        "judge_calls": per_step("judge_calls"),
        "judge_tokens": per_step("judge_prompt_tokens") + per_step("judge_completion_tokens"),
        "judge_s": per_step("judge_s"),
        "judge_skipped": sum(int(r.get("judge_groups_skipped") or 0) for r in steps),
        "judge_gap": judge_gap(run_dir),
    }


def report(root: Path, first: int | None = None, val_tasks: int = HELDOUT) -> list[dict[str, Any]]:
    """Print the per-run and per-source tables, write summary.json and the plot; returns the rows.
    ``first``: held-out over the first ``first`` questions, including runs that trained every step but
    whose 244-question check was stopped."""
    dirs = [d for d in sorted(root.iterdir()) if d.is_dir() and (d / "metrics.jsonl").exists()]
    rows = [summarise(d, first) for d in dirs if finished(d) or first]
    rows = [r for r in rows if finished(root / r["run"]) or r["val_after"] is not None]
    print(
        f"| run | held-out F1 ({first or val_tasks}) | judge calls / step | judge tokens / step | judge s / step | groups skipped | mean \\|task − judge\\| | wall min | load |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['run']} | {fmt(r['val_after'])} | {r['judge_calls']:.1f} | {r['judge_tokens']:.0f} | "
            f"{r['judge_s']:.2f} | {r['judge_skipped']} | {fmt(r['judge_gap'])} | {_wall(r)} |"
        )
    means: dict[str, float] = {}
    for source in SOURCES:
        after = [r["val_after"] for r in rows if r["source"] == source and r["val_after"] is not None]
        if not after:
            continue
        means[source] = statistics.fmean(after)
        delta = (
            f", {means[source] - means['f1']:+.3f} vs exact F1" if "f1" in means and source != "f1" else ""
        )
        print(
            f"{LABELS[source]}: {len(after)} seed{'s' * (len(after) != 1)}, held-out F1 {means[source]:.3f} "
            f"(range {max(after) - min(after):.3f}){delta}"
        )
    (root / "summary.json").write_text(json.dumps(rows, indent=1))
    if rows:
        plot(rows, root / "judge_learning.png", first or val_tasks)
    return rows


def _wall(r: dict[str, Any]) -> str:
    if r["wall_s"] is None:
        return "— | —"  # its final check was stopped: no wall time
    return f"{r['wall_s'] / 60:.1f} | {r['load'][0]:.1f}–{r['load'][1]:.1f}"


def plot(rows: list[dict[str, Any]], out: Path, n: int = HELDOUT) -> None:
    """Held-out F1 per reward source: one dot per seed, a bar at the mean."""
    groups = [
        (LABELS[s].replace(": ", ":\n"), [r["val_after"] for r in rows if r["source"] == s and r["val_after"] is not None], "#c6dbef")
        for s in SOURCES
    ]  # fmt: skip
    dot_plot(
        groups,
        f"held-out F1 ({n} questions)",
        "rag_agent: what training on a judge's scores costs (dots: seeds)",
        out,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=Path("runs/judge_learning"))
    parser.add_argument("--warm-start", type=Path, default=Path("runs/rag_sft128"))
    parser.add_argument("--sources", nargs="+", choices=list(SOURCES), default=list(SOURCES))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--build-warm-start", action="store_true", help="build --warm-start first if missing")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--heldout-first",
        type=int,
        metavar="N",
        help="report held-out F1 over the first N held-out questions (from each run's store)",
    )
    parser.add_argument(
        "--val-tasks",
        type=int,
        default=HELDOUT,
        metavar="N",
        help="held-out questions in each run's final check (the first N of the 244; default all)",
    )
    args = parser.parse_args()
    if not 1 <= args.val_tasks <= HELDOUT:
        parser.error(f"--val-tasks must be in 1..{HELDOUT}, got {args.val_tasks}")
    if args.heldout_first is not None and args.heldout_first < 1:
        parser.error(f"--heldout-first must be >= 1, got {args.heldout_first}")
    args.root.mkdir(parents=True, exist_ok=True)
    if args.build_warm_start:
        build_warm_start(args.warm_start, args.threads)
    if not args.report_only:
        if not (args.warm_start / "model").exists():
            raise SystemExit(f"no warm start at {args.warm_start}: run with --build-warm-start first")
        for seed in args.seeds:
            for source in args.sources:
                run_one(args.root, source, seed, args.warm_start, args.threads, args.val_tasks)
    report(args.root, args.heldout_first, args.val_tasks)


if __name__ == "__main__":
    main()
