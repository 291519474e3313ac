"""``python -m examples.calc_agent dev|train|apo|data``: run the agent without training, train it, or
print the problems. See README.md for what each prints and the figures measured."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

from examples._cli import (
    example_parser,
    fit,
    lightning_rl,
    oracle_backend,
)

__all__ = ["dev", "main", "parser", "train"]


def parser() -> argparse.ArgumentParser:
    p, sub = example_parser(
        "calc_agent",
        __doc__,
        train_help="train the solver with LightningRL",
        data_help="print a summary and a few problems",
        item="problems",
        train_defaults={
            "steps": 8, "val_tasks": 48, "val_every": 4, "learning_rate": 5e-4, "micro_batch_tokens": 2048,
        },
    )  # fmt: skip
    a = sub.add_parser("apo", help="optimise the solver's system prompt with APO (no training)")
    a.add_argument("--base-url", default=None, help="the agent's endpoint (default: embedded SmolLM2)")
    a.add_argument("--model", default=None, help="model name at --base-url, or a local model path")
    a.add_argument("--api-key", default=None, help="API key for --base-url (default: $OPENAI_API_KEY)")
    a.add_argument("--optimizer-base-url", default=None, help="the optimiser (default: the agent's model)")
    a.add_argument("--optimizer-model", default=None)
    a.add_argument("--optimizer-api-key", default=None, help="default: $OPENAI_API_KEY")
    a.add_argument("--optimizer-max-tokens", type=int, default=256)
    a.add_argument(
        "--rewrite-format",
        choices=["json", "text"],
        default=None,
        help="json for capable optimisers (default with --optimizer-base-url), text for SmolLM2",
    )
    a.add_argument("--rounds", type=int, default=2)
    a.add_argument("--beam-width", type=int, default=2)
    a.add_argument("--branch-factor", type=int, default=2)
    a.add_argument("--rollouts-per-candidate", type=int, default=8)
    a.add_argument("--max-optimizer-tokens", type=int, default=None)
    a.add_argument("--val-tasks", type=int, default=16, help="training problems held back for selection")
    a.add_argument("--test-tasks", type=int, default=32, help="held-out test problems: initial vs best")
    a.add_argument("--max-tokens", type=int, default=64)
    a.add_argument("--runners", type=int, default=8)
    a.add_argument("--run-dir", default="runs/calc_apo")
    a.add_argument("--seed", type=int, default=0)
    return p


def apo(args: argparse.Namespace, **serving_kw: Any) -> Any:
    """APO on the solver's system prompt: failures on training problems drive the rewrites,
    candidates are chosen on held-back training problems, and the initial and best prompts are
    compared on held-out test problems. Every problem is decoded greedily. ``serving_kw``: fields of
    the run's ``Serving`` that win over the flags (the tests' scripted backend, no progress bar)."""
    from agl import APO, LoopConfig, RunConfig, Serving, Trainer
    from examples.calc_agent import data
    from examples.calc_agent.agent import AGENT, make_rollout

    hosted = args.optimizer_base_url is not None
    algorithm = APO(
        rounds=args.rounds,
        beam_width=args.beam_width,
        branch_factor=args.branch_factor,
        rollouts_per_candidate=args.rollouts_per_candidate,
        max_optimizer_tokens=args.max_optimizer_tokens,
        agents=[AGENT],
        optimizer_base_url=args.optimizer_base_url,
        optimizer_model=args.optimizer_model,
        optimizer_api_key=args.optimizer_api_key,
        optimizer_sampling={"temperature": 1.0, "max_tokens": args.optimizer_max_tokens},
        rewrite_format=args.rewrite_format or ("json" if hosted else "text"),
        max_failures=3,
        trace_chars=800,
    )
    serving: dict[str, Any] = {
        "model": args.model if args.base_url is None else None,
        "backend": "openai" if args.base_url else "transformers",
        "base_url": args.base_url,
        "api_key": args.api_key or (os.environ.get("OPENAI_API_KEY") if args.base_url else None),
        "model_name": args.model if args.base_url else None,
        "runners": args.runners,
        "run_dir": args.run_dir,
        **serving_kw,
    }
    trainer = Trainer(
        algorithm,
        serving=Serving(**serving),
        loop=LoopConfig(seed=args.seed),
        config=RunConfig(max_tokens=args.max_tokens, temperature=0.0),
    )
    train = data.load_tasks("train")
    val, train = train[-args.val_tasks :], train[: -args.val_tasks]
    test = data.load_tasks("test", limit=args.test_tasks)
    summary = algorithm.fit(trainer, make_rollout(), train, val, test=test)
    keys = (
        "run_dir", "rounds", "val_reward_before", "val_reward_after", "test_reward_before",
        "test_reward_after", "best_prompts", "candidates", "optimizer_calls", "optimizer_tokens",
        "optimizer_failures", "wall_s",
    )  # fmt: skip
    print(json.dumps({k: summary.get(k) for k in keys}, indent=2))
    return summary


def dev(
    args: argparse.Namespace,
    *,
    model: Any = None,
    tokenizer: Any = None,
    script: Any = None,
    **serving_kw: Any,
) -> Any:
    from agl import RunConfig, Serving, Trainer
    from examples.calc_agent import data
    from examples.calc_agent.agent import AGENT, make_rollout

    tasks = data.load_tasks(args.split, limit=args.tasks)
    oracle_backend(args)
    if args.backend == "scripted" and script is None:
        from examples.calc_agent.scripted import ScriptedCalc

        script = ScriptedCalc(oracle=args.oracle)
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
        agents=[AGENT],
        serving=serving,
        config=RunConfig(max_tokens=args.max_tokens, temperature=args.temperature),
    )
    return trainer.dev(
        make_rollout(),
        tasks,
        base_url=args.base_url,
        model=None if is_path else args.model,
        api_key=args.api_key or (os.environ.get("OPENAI_API_KEY") if args.base_url else None),
    )


def train(args: argparse.Namespace, *, model: Any = None, tokenizer: Any = None, **trainer_kw: Any) -> Any:
    from examples.calc_agent import data
    from examples.calc_agent.agent import AGENT, make_rollout

    val = data.load_tasks("test", limit=args.val_tasks) if args.val_tasks else None
    return fit(
        args,
        trainer_kw,
        algorithm=lightning_rl(args),
        agents=[AGENT],
        rollout=make_rollout(),
        train_tasks=data.load_tasks("train"),
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
        from examples.calc_agent import data

        for split in ("train", "test"):
            tasks = data.load_tasks(split)
            print(f"{split}: {len(tasks)} problems")
        for task in data.load_tasks("test", limit=5):
            print(json.dumps(task))
    elif args.command == "dev":
        dev(args)
    elif args.command == "apo":
        apo(args)
    else:
        train(args)
    return 0
