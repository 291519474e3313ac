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
    python bench/per_agent_learning.py --repairs 4 --build-warm-start   # issue 56: the same, from demos
                                                            # where every 4th question shows a repair
    python bench/per_agent_learning.py --repairs 4 --setups per_agent_running   # the running baseline

With ``--repairs N`` the oracle's demonstrations also show repairs (``dev --oracle --repairs N``: the
writer's query broken, the rewriter's fix), so the warm start covers the rewriter too; its runs are
named ``*_rN_*`` and kept apart from the others. With ``--branches K`` the runs branch the rewriter
at its call where a question's group leaves it no signal (``train --branches K``, issue 56); they are
named ``*_bK_*`` and compared with the same warm start.

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
#: ``per_agent`` compares a sometimes-acting agent over its calls in the step only (``--running-window
#: 0``: the rule the 2026-11-29 matrix was declared with); ``per_agent_running`` also falls back to its
#: own last 4 steps where the step leaves its calls no spread (LightningRL's default since then)
SETUPS = ("shared", "per_agent", "per_agent_running")
RUNNING_WINDOW = {"per_agent": "0", "per_agent_running": "4"}
RECIPE = (
    "--steps", "16", "--tasks-per-step", "6", "--group-size", "4", "--val-tasks", "90", "--val-every", "0",
    "--no-val-before", "--max-tokens", "64", "--temperature", "1.0", "--learning-rate", "2e-4",
    "--runners", "16", "--gradient-checkpointing", "off", "--micro-batch-tokens", "1024",
)  # fmt: skip


def _demos_db(root: Path, repairs: int) -> Path:
    return root / (f"sql_demos128_r{repairs}.db" if repairs else "sql_demos128.db")


def _tag(repairs: int) -> str:
    return f"_r{repairs}" if repairs else ""


def _sft(root: Path, out: Path, threads: int, repairs: int = 0) -> list[str]:
    return [
        sys.executable, "-m", "agl.cli", "sft", "--store", f"sqlite:///{_demos_db(root, repairs)}",
        "--agents", "writer,rewriter", "--min-reward", "1", "--out", str(out), "--epochs", "1",
        "--batch-size", "4", "--learning-rate", "5e-4", "--threads", str(threads),
    ]  # fmt: skip


def _train(threads: int, warm: Path, run_dir: Path, setup: str, extra: list[str]) -> list[str]:
    window = RUNNING_WINDOW.get(setup)
    return [
        sys.executable, "-m", "examples.sql_agent", "--threads", str(threads), "train",
        "--warm-start", str(warm), "--run-dir", str(run_dir),
        *(["--adapter-per-agent", "--running-window", window] if window else []), *extra,
    ]  # fmt: skip


def warm_dir(root: Path, repairs: int = 0) -> Path:
    """The one warm start of both setups: a shared ``agl sft`` run (its merged model)."""
    return root / f"sft_shared{_tag(repairs)}"


def build_warm_starts(root: Path, threads: int, repairs: int = 0) -> None:
    """The 128 oracle demonstrations (with a repair every ``repairs`` questions), the SFT on them, and
    the warm start's held-out check."""
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    db = _demos_db(root, repairs)
    if not db.exists():
        demos = [sys.executable, "-m", "examples.sql_agent", "dev", "--oracle", "--split", "train", "-n", "128",
                 "--store", f"sqlite:///{db}", *(["--repairs", str(repairs)] if repairs else [])]  # fmt: skip
        subprocess.run(demos, check=True, env=env)
    out = warm_dir(root, repairs)
    if not (out / "sft_summary.json").exists():
        subprocess.run(_sft(root, out, threads, repairs), check=True, env=env)
    check = root / f"warm_shared{_tag(repairs)}_s0"
    extra = ["--steps", "0", "--val-tasks", "90", "--runners", "16"]
    run_once(check, _train(threads, out, check, "shared", extra), "warm start")


def rescues(run_dir: Path) -> tuple[int, int]:
    """``(rescued, repaired)`` over the run's held-out rollouts: those where the rewriter acted, and
    of them those that ended right (the rewriter's rescue rate on held-out is their ratio)."""
    db = run_dir / "store.db"
    if not db.exists():
        return 0, 0
    import agl.store
    from agl.adapter import Adapter

    store = agl.store.open(f"sqlite:///{db}")
    try:
        ids = [r.id for r in store.query_rollouts(mode="val")]
        ts = Adapter(agents=["writer", "rewriter"]).from_store(store, ids) if ids else []
    finally:
        store.close()
    repaired = {t.rollout_id: t.final_reward for t in ts if t.agent == "rewriter"}
    return sum(1 for r in repaired.values() if r >= 1.0), len(repaired)


def trained_per_agent(run_dir: Path) -> dict[str, float]:
    """Transitions each agent trained on over the run (the step metrics' ``trained_transitions/*``)."""
    out: dict[str, float] = {}
    for r in records(run_dir):
        for k, v in r.items():
            if k.startswith("trained_transitions/"):
                out[k.split("/", 1)[1]] = out.get(k.split("/", 1)[1], 0.0) + float(v)
    return out


def summarise(run_dir: Path) -> dict[str, Any]:
    steps = sum(1 for r in records(run_dir) if "train_reward" in r)
    rescued, repaired = rescues(run_dir)
    return {**summary(run_dir, "setup"), "steps": steps, "rescued": rescued, "repaired": repaired,
            "trained": trained_per_agent(run_dir)}  # fmt: skip


def _mine(setup: str, tag: str, btag: str) -> str | None:
    """``setup`` without its tags when it is a run of these repairs (``tag``) and branches (``btag``;
    the warm start carries ``tag`` only), else None."""
    if setup.startswith("warm"):
        ok = setup.endswith(tag) if tag else "_r" not in setup
        return setup[: len(setup) - len(tag)] if ok else None
    if not (setup.endswith(tag + btag) and (tag or "_r" not in setup) and (btag or "_b" not in setup)):
        return None
    return setup[: len(setup) - len(tag + btag)]


def report(root: Path, repairs: int = 0, branches: int = 0) -> list[dict[str, Any]]:
    """The table of every finished run in ``root``; the bar and the plot for the runs of ``repairs``
    (and ``branches``)."""
    rows = [summarise(d) for d in sorted(root.iterdir()) if d.is_dir() and finished(d)]
    print(
        "| run | held-out (90) | rescued / repaired (held-out) | trained per agent | steps | wall min | load |"
    )
    print("|---|---:|---:|---|---:|---:|---|")
    for r in rows:
        trained = ", ".join(f"{a} {n:.0f}" for a, n in sorted(r["trained"].items())) or "—"
        print(
            f"| {r['run']} | {fmt(r['val_after'])} | {r['rescued']} / {r['repaired']} | {trained} | "
            f"{r['steps']} | {r['wall_s'] / 60:.1f} | {r['load'][0]:.1f}–{r['load'][1]:.1f} |"
        )
    tag, btag = _tag(repairs), (f"_b{branches}" if branches else "")
    mine = [{**r, "setup": base} for r in rows if (base := _mine(r["setup"], tag, btag)) is not None]
    for setup in SETUPS:
        after = [r["val_after"] for r in mine if r["setup"] == setup and r["val_after"] is not None]
        warm = [r["val_after"] for r in mine if r["setup"] == "warm_shared" and r["val_after"] is not None]
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
    if mine:
        plot(mine, root / f"per_agent_learning{tag}{btag}.png")
    return rows


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    """Held-out per setup, warm start and after RL: one dot per seed, a bar at the mean."""
    labels = {"warm_shared": "warm start\n(both setups)", "shared": "RL, shared\npolicy",
              "per_agent": "RL, adapter\nper agent", "per_agent_running": "adapter per agent,\n+ running baseline"}  # fmt: skip
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
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS[:2]))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--build-warm-start", action="store_true", help="demos, the SFT and its check first")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--repairs", type=int, default=0, metavar="N", help="demonstrations with a repair every N questions"
    )
    parser.add_argument("--warm-only", action="store_true", help="build and check the warm start, no RL runs")
    parser.add_argument(
        "--branches", type=int, default=0, metavar="K",
        help="train --branches K: K rewriter continuations where its group has no signal (runs *_bK_*)",
    )  # fmt: skip
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    if args.build_warm_start:
        build_warm_starts(args.root, args.threads, args.repairs)
    if not (args.report_only or args.warm_only):
        warm = warm_dir(args.root, args.repairs)
        if not (warm / "sft_summary.json").exists():
            raise SystemExit(f"no warm start in {args.root}: run with --build-warm-start first")
        for seed in args.seeds:
            for setup in args.setups:
                btag = f"_b{args.branches}" if args.branches else ""
                run_dir = args.root / f"{setup}{_tag(args.repairs)}{btag}_s{seed}"
                extra = ["--seed", str(seed), *RECIPE, *(["--branches", str(args.branches)] if btag else [])]
                cmd = _train(args.threads, warm, run_dir, setup, extra)
                run_once(run_dir, cmd, f"{setup} seed={seed}")
    report(args.root, args.repairs, args.branches)


if __name__ == "__main__":
    main()
