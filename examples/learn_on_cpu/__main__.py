"""``python -m examples.learn_on_cpu train|seeds|dev`` — see README.md in this directory.

- ``train``: one LightningRL run (held-out reward measured before, every few steps, and after);
- ``seeds``: the same run for several seeds, then a table of held-out reward before/after and the
  curves of all seeds in one PNG (what README.md reports);
- ``dev``: a few rollouts without training, printing the transitions and rewards (``--base-url`` for
  any OpenAI-compatible endpoint instead of the embedded model).
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

from agl.cli.config_args import (  # noqa: E402 (after the environment defaults)
    add_config_arguments,
    add_engine_arguments,
    config_from_args,
    engine_from_args,
)
from agl.config import LoopConfig, RunConfig  # noqa: E402
from agl.run.settings import Serving  # noqa: E402


def _trainer(args: argparse.Namespace, seed: int, run_dir: Path) -> Any:
    import agl

    algo = agl.LightningRL(
        group_size=args.group_size,
        learning_rate=args.lr,
        lora_r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        clip_eps=0.2,
        kl_coef=0.0,
        micro_batch_tokens=args.micro_batch_tokens,
        loss_balance=args.loss_balance,
    )
    store = f"sqlite:///{(run_dir / 'store.db').resolve()}"  # inspectable after the run
    return agl.Trainer(
        algo,
        serving=config_from_args(
            Serving, args, run_dir=run_dir, store=store, engine=engine_from_args(args, process_threads=True)
        ),
        loop=config_from_args(LoopConfig, args, seed=seed),
        agents=["calculator_agent"],
        config=RunConfig(temperature=args.temperature, max_tokens=args.max_tokens),
    )


def _setup(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


def _fresh_run_dir(args: argparse.Namespace) -> Path:
    """The run directory: a new timestamped one by default, so a rerun never overwrites (or mixes its
    TensorBoard events with) an earlier run; an existing non-empty ``--run-dir`` needs ``--overwrite``."""
    if args.run_dir is None:
        root = Path("runs") / args.default_name
        path = root / time.strftime("%Y%m%d-%H%M%S")
        n = 1
        while path.exists():
            path = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{n}"
            n += 1
        return path
    path = Path(args.run_dir)
    if path.exists() and any(path.iterdir()):
        if not args.overwrite:
            raise SystemExit(
                f"{path} already holds a run; pass --overwrite to replace it, or leave out --run-dir "
                "for a fresh timestamped directory"
            )
        import shutil

        shutil.rmtree(path)
    return path


def _train_one(args: argparse.Namespace, seed: int, run_dir: Path) -> dict[str, Any]:
    from examples.learn_on_cpu.agent import calc_agent
    from examples.learn_on_cpu.data import split

    train, val = split(n_val=args.val_size)
    t0 = time.perf_counter()
    out = _trainer(args, seed, run_dir).fit(calc_agent, train, val)
    out["wall_s"] = time.perf_counter() - t0
    out["seed"] = seed
    (run_dir / "summary.json").write_text(
        json.dumps({k: v for k, v in out.items() if k != "history"}, indent=2)
    )
    return out


def cmd_train(args: argparse.Namespace) -> int:
    _setup(args)
    run_dir = _fresh_run_dir(args)
    out = _train_one(args, args.seed, run_dir)
    print(
        f"held-out reward ({out.get('val_decoding')}) {out['val_reward_before']:.3f} -> "
        f"{out['val_reward_after']:.3f} in {out['steps']} steps, {out['wall_s'] / 60:.1f} min; curve: {run_dir / 'reward_curve.png'}"
    )
    return 0


def cmd_seeds(args: argparse.Namespace) -> int:
    from agl.run.plot import plot_runs

    _setup(args)
    root = _fresh_run_dir(args)
    results = [_train_one(args, seed, root / f"seed{seed}") for seed in args.seeds]
    print("\n| seed | held-out reward before | after | change | minutes |")
    print("|---:|---:|---:|---:|---:|")
    for r in results:
        b, a = r["val_reward_before"], r["val_reward_after"]
        print(f"| {r['seed']} | {b:.3f} | {a:.3f} | {a - b:+.3f} | {r['wall_s'] / 60:.1f} |")
    before = [r["val_reward_before"] for r in results]
    after = [r["val_reward_after"] for r in results]
    gains = [a - b for a, b in zip(after, before, strict=True)]
    spread = max(after) - min(after) if len(after) > 1 else 0.0
    print(
        f"\nmean before {statistics.mean(before):.3f}, mean after {statistics.mean(after):.3f}, "
        f"smallest gain {min(gains):+.3f}, seed-to-seed spread of the final reward {spread:.3f}"
    )
    png = plot_runs(
        [root / f"seed{s}" for s in args.seeds],
        root / "reward_curve.png",
        title="learn_on_cpu: SmolLM2-135M + LoRA",
    )
    print(f"curves: {png}")  # each seed's run printed its inspect commands when it finished
    (root / "seeds.json").write_text(
        json.dumps([{k: v for k, v in r.items() if k != "history"} for r in results], indent=2)
    )
    return 0 if min(gains) > spread else 1


def cmd_dev(args: argparse.Namespace) -> int:
    import agl
    from examples.learn_on_cpu.agent import calc_agent
    from examples.learn_on_cpu.data import split

    _setup(args)
    _, val = split(n_val=args.n)
    run_dir = _fresh_run_dir(args)
    serving = Serving(
        backend=args.backend,
        vllm_url=args.vllm_url,
        vllm_python=args.vllm_python,
        vllm_args=args.vllm_args,
        model=args.model,
        runners=args.runners,
        run_dir=run_dir,
        store=f"sqlite:///{(run_dir / 'store.db').resolve()}",
    )
    trainer = agl.Trainer(
        agents=["calculator_agent"],
        serving=serving,
        config=RunConfig(temperature=args.temperature, max_tokens=args.max_tokens),
    )
    trainer.dev(calc_agent, val[: args.n], base_url=args.base_url, model=args.model_name)
    return 0


def _common(sp: argparse.ArgumentParser) -> None:
    """The model, sampling and run-directory flags of every sub-command (from Serving/RunConfig fields)."""
    add_config_arguments(
        sp,
        Serving,
        only=["model", "runners"],
        overrides={
            "model": {"help": "local HF model dir (default: embedded SmolLM2-135M-Instruct)"},
            "runners": {"default": 8, "help": "rollouts run at once (the gateway batches them)"},
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
    add_engine_arguments(sp, only=["threads", "deterministic", "dtype", "prefix_cache_mb"])
    add_config_arguments(
        sp,
        Serving,
        only=["backend", "vllm_url", "vllm_python", "vllm_args"],
        overrides={
            "backend": {
                "choices": ["transformers", "vllm"],
                "help": "transformers (embedded, default) or vllm (give --vllm-python or --vllm-url)",
            }
        },
    )
    add_config_arguments(
        sp,
        Serving,
        only=["run_dir"],
        overrides={
            "run_dir": {
                "default": None,
                "help": "where metrics, checkpoints and the SQLite store go (default: a new "
                "runs/<name>/<timestamp> directory per run)",
            }
        },
    )
    sp.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --run-dir")


def _train_flags(sp: argparse.ArgumentParser, name: str) -> None:
    """``train``'s and ``seeds``' loop and update flags (from LoopConfig/RunConfig, this run's defaults)."""
    add_config_arguments(
        sp,
        LoopConfig,
        only=["steps", "tasks_per_step"],
        overrides={
            "steps": {"default": 8, "help": "LightningRL steps (default: 8)"},
            "tasks_per_step": {"default": 4, "help": "tasks per step (default: 4)"},
        },
    )
    sp.add_argument(
        "--group-size", type=int, default=4, help="rollouts per task, the GRPO group (default: 4)"
    )
    add_config_arguments(
        sp,
        RunConfig,
        only=["learning_rate", "lora_r", "micro_batch_tokens", "loss_balance"],
        overrides={
            "learning_rate": {"flags": ["--lr"], "default": 1e-3, "help": "learning rate (default: 1e-3)"},
            "lora_r": {"help": "LoRA rank; alpha is 2r (default: 16)"},
            "micro_batch_tokens": {
                "default": 2048,
                "help": "tokens per update micro-batch: lower it to use less memory (default: 2048)",
            },
        },
    )
    sp.add_argument("--val-size", type=int, default=24, help="held-out questions (default: 24)")
    add_config_arguments(
        sp,
        LoopConfig,
        only=["val_every", "val_samples", "max_staleness"],
        overrides={
            "val_every": {"default": 2, "help": "measure held-out reward every N steps (default: 2)"},
            "max_staleness": {"metavar": "K"},
        },
    )
    if name == "train":
        add_config_arguments(
            sp, LoopConfig, only=["seed"], overrides={"seed": {"help": "random seed (default: 0)"}}
        )
    else:
        sp.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds (default: 0 1)")


def parser() -> argparse.ArgumentParser:
    """``python -m examples.learn_on_cpu``'s parser: ``train``, ``seeds`` and ``dev``."""
    p = argparse.ArgumentParser(prog="python -m examples.learn_on_cpu", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    helps = {
        "train": "one LightningRL run: held-out reward before, during and after",
        "seeds": "the same run for several seeds, then the before/after table and one PNG of all curves",
        "dev": "a few rollouts without training: print their transitions and rewards",
    }
    for name in ("train", "seeds"):
        sp = sub.add_parser(name, help=helps[name], description=helps[name])
        _common(sp)
        sp.set_defaults(default_name="learn_on_cpu" if name == "train" else "learn_on_cpu_seeds")
        _train_flags(sp, name)
    sp = sub.add_parser("dev", help=helps["dev"], description=helps["dev"])
    _common(sp)
    sp.set_defaults(default_name="learn_on_cpu_dev")
    sp.add_argument("-n", type=int, default=4, help="tasks to run")
    sp.add_argument(
        "--base-url", default=None, help="any OpenAI-compatible endpoint instead of the embedded model"
    )
    sp.add_argument("--model-name", default=None, help="model name at --base-url")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return {"train": cmd_train, "seeds": cmd_seeds, "dev": cmd_dev}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
