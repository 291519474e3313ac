"""``python -m examples.solve_check train|compare|dev`` — see README.md in this directory.

- ``train``: one LightningRL run of both agents, on one shared policy or (``--adapter-per-agent``) on
  an adapter per agent; held-out reward per agent before and after;
- ``compare``: shared and per-agent for each seed (interleaved), then the table README.md reports and
  one PNG of the held-out curves;
- ``dev``: a few rollouts without training, printing each agent's transitions and rewards.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from agl.cli.config_args import add_config_arguments, config_from_args  # noqa: E402 (after the environment defaults)
from agl.config import LoopConfig, RunConfig  # noqa: E402
from agl.run.settings import Serving  # noqa: E402

SETUPS = ("shared", "per_agent")


def _trainer(args: argparse.Namespace, seed: int, run_dir: Path, per_agent: bool, **serving_kw: Any) -> Any:
    """One run's Trainer from the flags; ``serving_kw``: Serving fields that win (a test's tokenizer)."""
    import agl
    from examples.solve_check.agent import AGENTS

    algo = agl.LightningRL(
        group_size=args.group_size,
        learning_rate=args.lr,
        lora_r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        clip_eps=0.2,
        kl_coef=0.0,
        micro_batch_tokens=args.micro_batch_tokens,
    )
    model, warm_adapters = _warm_start(args, per_agent)
    store = f"sqlite:///{(run_dir / 'store.db').resolve()}"  # inspectable, and read for the table
    return agl.Trainer(
        algo,
        serving=config_from_args(
            Serving, args, model=model, backend="transformers", run_dir=run_dir, store=store, **serving_kw
        ),
        loop=config_from_args(
            LoopConfig, args, seed=seed, adapter_per_agent=per_agent, warm_adapters=warm_adapters
        ),
        agents=AGENTS,
        config=RunConfig(temperature=args.temperature, max_tokens=args.max_tokens),
    )


def _warm_start(args: argparse.Namespace, per_agent: bool) -> tuple[Any, str | None]:
    """The run's model and per-agent warm adapters: without a warm start ``--model``; shared, the
    merged model of ``--warm-start`` (an ``agl sft`` output); per agent, the base model and each
    agent's adapter of the ``agl sft --adapter-per-agent`` output (``--warm-start`` for ``train
    --adapter-per-agent``, ``--warm-start-per-agent`` for ``compare``)."""
    from examples._cli import model_arg, warm_adapters_arg

    warm = getattr(args, "warm_start", None)
    if per_agent and hasattr(args, "warm_start_per_agent"):
        warm = args.warm_start_per_agent
    if not warm:
        return args.model, None
    ns = argparse.Namespace(warm_start=warm, adapter_per_agent=per_agent, model=args.model)
    return model_arg(ns), warm_adapters_arg(ns)


def held_out_by_agent(store: Any) -> dict[int, dict[str, float]]:
    """Per held-out check (keyed by step): each agent's mean score over the check's rollouts,
    recomputed from the stored transitions (each agent's reply, exact ids decoded by the adapter)."""
    from agl.adapter import Adapter
    from examples.solve_check.agent import agent_scores

    rollouts = store.query_rollouts(mode="val", status="succeeded")
    transitions = Adapter().from_store(store, [r.id for r in rollouts])
    replies: dict[str, dict[str, str | None]] = {}
    for t in transitions:
        replies.setdefault(t.rollout_id, {})[t.agent or ""] = t.response_text
    by_step: dict[int, dict[str, list[float]]] = {}
    for r in rollouts:
        step = int(r.metadata.get("step", -1))
        for agent, score in agent_scores(r.input, replies.get(r.id, {})).items():
            by_step.setdefault(step, {}).setdefault(agent, []).append(score)
    return {s: {a: statistics.fmean(v) for a, v in d.items()} for s, d in sorted(by_step.items())}


def _train_one(
    args: argparse.Namespace, seed: int, run_dir: Path, per_agent: bool, **serving_kw: Any
) -> dict[str, Any]:
    import agl.store
    from examples.solve_check.agent import solve_check
    from examples.solve_check.data import split

    train, val = split(n_val=args.val_size)
    t0 = time.perf_counter()
    out = _trainer(args, seed, run_dir, per_agent, **serving_kw).fit(solve_check, train, val)
    out["wall_s"] = time.perf_counter() - t0
    out["seed"], out["setup"] = seed, "per_agent" if per_agent else "shared"
    store = agl.store.open(f"sqlite:///{run_dir / 'store.db'}")
    try:
        checks = held_out_by_agent(store)
    finally:
        store.close()
    out["held_out_by_agent"] = {str(k): v for k, v in checks.items()}
    if checks:
        out["held_out_before"], out["held_out_after"] = checks[min(checks)], checks[max(checks)]
    (run_dir / "summary.json").write_text(
        json.dumps({k: v for k, v in out.items() if k != "history"}, indent=2)
    )
    return out


def _setup(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


def _run_dir(args: argparse.Namespace, name: str, *, resume: bool = False) -> Path:
    """The run directory; ``resume``: an existing one is kept (compare skips the runs it finished)."""
    path = Path(args.run_dir) if args.run_dir else Path("runs") / name / time.strftime("%Y%m%d-%H%M%S")
    if path.exists() and any(path.iterdir()) and not resume:
        if not args.overwrite:
            raise SystemExit(f"{path} already holds a run; pass --overwrite to replace it")
        import shutil

        shutil.rmtree(path)
    return path


def _fmt(d: dict[str, float] | None, agent: str) -> str:
    return "—" if not d or agent not in d else f"{d[agent]:.3f}"


def cmd_train(args: argparse.Namespace) -> int:
    _setup(args)
    run_dir = _run_dir(args, "solve_check")
    out = _train_one(args, args.seed, run_dir, args.adapter_per_agent)
    b, a = out.get("held_out_before"), out.get("held_out_after")
    print(
        f"{out['setup']}: held-out solver {_fmt(b, 'solver')} -> {_fmt(a, 'solver')}, checker "
        f"{_fmt(b, 'checker')} -> {_fmt(a, 'checker')} in {out['steps']} steps, {out['wall_s'] / 60:.1f} min"
    )
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from agl.run.plot import plot_runs

    if bool(args.warm_start) != bool(args.warm_start_per_agent):
        raise SystemExit(
            "compare starts both setups from the same demonstrations: give both --warm-start (an "
            "`agl sft` output) and --warm-start-per-agent (an `agl sft --adapter-per-agent` one), or neither"
        )
    _setup(args)
    root = _run_dir(args, "solve_check_compare", resume=not args.overwrite)
    results = []
    for seed in args.seeds:  # interleaved, so a change of machine load hits both setups alike
        for setup in SETUPS:
            run_dir = root / f"{setup}_s{seed}"
            if (run_dir / "summary.json").exists():  # finished by an earlier compare: kept
                results.append(json.loads((run_dir / "summary.json").read_text()))
                continue
            if run_dir.exists():  # an unfinished one: again from the start
                import shutil

                shutil.rmtree(run_dir)
            results.append(_train_one(args, seed, run_dir, setup == "per_agent"))
    print("\n| setup | seed | solver before → after | checker before → after | minutes |")
    print("|---|---:|---|---|---:|")
    for r in results:
        b, a = r.get("held_out_before"), r.get("held_out_after")
        print(
            f"| {r['setup']} | {r['seed']} | {_fmt(b, 'solver')} → {_fmt(a, 'solver')} | "
            f"{_fmt(b, 'checker')} → {_fmt(a, 'checker')} | {r['wall_s'] / 60:.1f} |"
        )
    for setup in SETUPS:
        rows = [r for r in results if r["setup"] == setup and r.get("held_out_after")]
        for agent in ("solver", "checker"):
            after = [r["held_out_after"][agent] for r in rows if agent in r["held_out_after"]]
            if after:
                print(
                    f"{setup} {agent}: held-out after {statistics.fmean(after):.3f} "
                    f"(range {max(after) - min(after):.3f}, {len(after)} seeds)"
                )
    png = plot_runs([root / f"{s}_s{seed}" for seed in args.seeds for s in SETUPS], root / "reward_curve.png",
                    title="solve_check: shared policy vs an adapter per agent")  # fmt: skip
    print(f"curves: {png}")
    (root / "compare.json").write_text(json.dumps(results, indent=2, default=str))
    return 0


def cmd_dev(args: argparse.Namespace) -> int:
    import agl
    from examples.solve_check.agent import AGENTS, oracle, solve_check
    from examples.solve_check.data import split

    _setup(args)
    train, val = split()
    tasks = (train if args.split == "train" else val)[: args.n]
    run_dir = _run_dir(args, "solve_check_dev")
    scripted = {"backend": "scripted", "script": oracle} if args.backend == "scripted" else {}
    serving = Serving(
        **({"backend": "transformers", "model": args.model} | scripted),
        runners=args.runners,
        run_dir=run_dir,
        store=args.store or f"sqlite:///{(run_dir / 'store.db').resolve()}",
    )
    trainer = agl.Trainer(
        agents=AGENTS,
        serving=serving,
        config=RunConfig(temperature=args.temperature, max_tokens=args.max_tokens),
    )
    trainer.dev(solve_check, tasks, base_url=args.base_url, model=args.model_name)
    return 0


def _common(sp: argparse.ArgumentParser) -> None:
    add_config_arguments(
        sp,
        Serving,
        only=["model", "runners"],
        overrides={
            "model": {"help": "local HF model dir (default: embedded SmolLM2-135M-Instruct)"},
            "runners": {"default": 8, "help": "rollouts run at once (the gateway batches their calls)"},
        },
    )
    add_config_arguments(
        sp,
        RunConfig,
        only=["temperature", "max_tokens"],
        overrides={
            "temperature": {"help": "sampling temperature (default: 1.0)"},
            "max_tokens": {"default": 16, "help": "longest reply in tokens (default: 16)"},
        },
    )
    sp.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    sp.add_argument("--run-dir", default=None, help="default: a new runs/<name>/<timestamp> directory")
    sp.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --run-dir")


def _train_flags(sp: argparse.ArgumentParser) -> None:
    add_config_arguments(
        sp,
        LoopConfig,
        only=["steps", "tasks_per_step", "val_every", "val_samples"],
        overrides={
            "steps": {"default": 8, "help": "LightningRL steps (default: 8)"},
            "tasks_per_step": {"default": 4, "help": "tasks per step (default: 4)"},
            "val_every": {"default": 2, "help": "held-out check every N steps (default: 2)"},
        },
    )
    sp.add_argument("--group-size", type=int, default=4, help="rollouts per task (default: 4)")
    add_config_arguments(
        sp,
        RunConfig,
        only=["learning_rate", "lora_r", "micro_batch_tokens"],
        overrides={
            "learning_rate": {"flags": ["--lr"], "default": 1e-3, "help": "learning rate (default: 1e-3)"},
            "lora_r": {"help": "LoRA rank; alpha is 2r (default: 16)"},
            "micro_batch_tokens": {"default": 2048, "help": "tokens per update micro-batch (default: 2048)"},
        },
    )
    sp.add_argument("--val-size", type=int, default=24, help="held-out questions (default: 24)")


def parser() -> argparse.ArgumentParser:
    """``python -m examples.solve_check``'s parser: ``train``, ``compare`` and ``dev``."""
    p = argparse.ArgumentParser(prog="python -m examples.solve_check", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="one run: both agents on a shared policy, or an adapter each")
    _common(t)
    _train_flags(t)
    t.add_argument("--adapter-per-agent", action="store_true", help="an adapter per agent (default: shared)")
    t.add_argument(
        "--warm-start",
        default=None,
        metavar="SFT_DIR",
        help="start from an `agl sft` output (its merged model); with --adapter-per-agent, from an "
        "`agl sft --adapter-per-agent` output (each agent's adapter)",
    )
    add_config_arguments(
        t, LoopConfig, only=["seed"], overrides={"seed": {"help": "random seed (default: 0)"}}
    )
    c = sub.add_parser("compare", help="shared vs per-agent for each seed: the table and the curves")
    _common(c)
    _train_flags(c)
    c.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default: 0 1 2)")
    c.add_argument(
        "--warm-start", default=None, metavar="SFT_DIR", help="the shared setup's `agl sft` output"
    )
    c.add_argument(
        "--warm-start-per-agent",
        default=None,
        metavar="SFT_DIR",
        help="the per-agent setup's `agl sft --adapter-per-agent` output (on the same demonstrations)",
    )
    d = sub.add_parser("dev", help="a few rollouts without training: each agent's transitions")
    _common(d)
    d.add_argument("-n", type=int, default=4, help="tasks to run")
    d.add_argument(
        "--backend",
        choices=["transformers", "scripted"],
        default="transformers",
        help="the embedded SmolLM2-135M (default) or the scripted oracle (each agent's right reply)",
    )
    d.add_argument(
        "--split",
        choices=["val", "train"],
        default="val",
        help="held-out tasks (default) or training ones (to record demonstrations for `agl sft`)",
    )
    d.add_argument("--store", default=None, help="record into this store URL (default: the run's own SQLite)")
    d.add_argument("--base-url", default=None, help="any OpenAI-compatible endpoint instead")
    d.add_argument("--model-name", default=None, help="model name at --base-url")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return {"train": cmd_train, "compare": cmd_compare, "dev": cmd_dev}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
