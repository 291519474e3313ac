"""``python -m examples.sql_agent dev|train|data``: run the agent without training, train it, or
build the databases. See README.md for what each prints and the figures measured."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from agl.algorithms.lightning_rl import LightningRL
from agl.config import LoopConfig
from examples._cli import (
    add_config_options,
    example_parser,
    fit,
    lightning_rl,
    oracle_backend,
)

__all__ = ["dev", "main", "parser", "train"]


def parser() -> argparse.ArgumentParser:
    p, sub = example_parser(
        "sql_agent",
        __doc__,
        train_help="train writer and rewriter with LightningRL",
        data_help="build the databases and print a summary",
        item="questions",
        train_defaults={
            "steps": 6, "val_tasks": 24, "val_every": 3, "learning_rate": 2e-4, "micro_batch_tokens": 1024,
        },
    )  # fmt: skip
    p.add_argument("--data-dir", default=None, help="where the databases go (default: the agl cache)")
    sub.choices["dev"].add_argument(
        "--repairs",
        type=int,
        default=0,
        metavar="N",
        help="with --oracle: every Nth question the writer breaks the gold query (a wrong column, a "
        "missing join, a wrong function) and the rewriter fixes it: repair demonstrations (0: none)",
    )
    add_config_options(
        sub.choices["train"],
        LoopConfig,
        ["branches"],
        branches={
            "metavar": "K",
            "help": "K rewriter continuations at its call where a question's group leaves it no signal "
            "(it acted once, or its calls scored alike): the writer's call replayed through the gateway, "
            "the rewriter's sampled K times (0: off; agl.trainer.branching)",
        },
    )
    add_config_options(
        sub.choices["train"],
        LightningRL,
        ["running_window"],
        running_window={
            "metavar": "N",
            "help": "with --adapter-per-agent: where a step leaves the rewriter's calls no spread (every "
            "repair failed alike), compare them with its own last N steps (0: they train nothing then)",
        },
    )
    return p


def dev(
    args: argparse.Namespace,
    *,
    model: Any = None,
    tokenizer: Any = None,
    script: Any = None,
    **serving_kw: Any,
) -> Any:
    from agl import RunConfig, Serving, Trainer
    from examples.sql_agent import data
    from examples.sql_agent.agent import TRAINED_AGENTS, make_rollout

    tasks = data.load_tasks(args.split, args.data_dir, limit=args.tasks)
    oracle_backend(args)
    if args.backend == "scripted" and script is None:
        from examples.sql_agent.scripted import ScriptedSQL

        repairs = getattr(args, "repairs", 0)
        if repairs and not args.oracle:
            raise SystemExit("--repairs N is a setting of the oracle teacher: give --oracle too")
        script = ScriptedSQL(args.data_dir, oracle=args.oracle, repair_every=repairs)
    if args.store is not None:
        serving_kw.setdefault("store", args.store)
    is_path = args.model is not None and os.path.isdir(args.model)
    serving = Serving(
        model=model if model is not None else (args.model if is_path else None),
        tokenizer=tokenizer,
        backend=args.backend,
        script=script,
        runners=min(len(tasks), 4),
        progress=False,
        **serving_kw,
    )
    trainer = Trainer(
        agents=TRAINED_AGENTS,
        serving=serving,
        config=RunConfig(max_tokens=args.max_tokens, temperature=args.temperature),
    )
    return trainer.dev(
        make_rollout(args.data_dir),
        tasks,
        base_url=args.base_url,
        model=None if is_path else args.model,
        api_key=args.api_key or (os.environ.get("OPENAI_API_KEY") if args.base_url else None),
    )


def train(args: argparse.Namespace, *, model: Any = None, tokenizer: Any = None, **trainer_kw: Any) -> Any:
    from examples.sql_agent import data
    from examples.sql_agent.agent import TRAINED_AGENTS, make_rollout

    val = data.load_tasks("test", args.data_dir, limit=args.val_tasks) if args.val_tasks else None
    return fit(
        args,
        trainer_kw,
        algorithm=lightning_rl(args, running_window=args.running_window),
        agents=TRAINED_AGENTS,
        rollout=make_rollout(args.data_dir),
        train_tasks=data.load_tasks("train", args.data_dir),
        val_tasks=val,
        model=model,
        tokenizer=tokenizer,
    )


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parser().parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.command == "data":
        from examples.sql_agent import data

        paths = data.build_databases(args.data_dir)
        print("\n".join(f"{db}: {path}" for db, path in paths.items()))
        print(data.summary(args.data_dir))
    elif args.command == "dev":
        dev(args)
    else:
        train(args)
    return 0
