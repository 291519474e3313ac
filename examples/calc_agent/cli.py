"""``python -m examples.calc_agent dev|train|data``: run the agent without training, train it, or
print the problems. See README.md for what each prints and the figures measured."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

from examples._cli import example_parser, model_arg, oracle_backend

__all__ = ["dev", "main", "parser", "train"]


def parser() -> argparse.ArgumentParser:
    p, _ = example_parser(
        "calc_agent",
        __doc__,
        train_help="train the solver with LightningRL",
        data_help="print a summary and a few problems",
        item="problems",
        train_defaults={
            "steps": 8, "val_tasks": 48, "val_every": 4, "learning_rate": 5e-4, "micro_batch_tokens": 2048,
        },
    )  # fmt: skip
    return p


def _val_tasks(tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Held-out tasks are decoded greedily, so before/after figures compare policies, not luck."""
    return [{**t, "temperature": 0.0} for t in tasks]


def dev(
    args: argparse.Namespace,
    *,
    model: Any = None,
    tokenizer: Any = None,
    script: Any = None,
    **trainer_kw: Any,
) -> Any:
    from agl import Trainer
    from examples.calc_agent import data
    from examples.calc_agent.agent import AGENT, make_rollout

    tasks = data.load_tasks(args.split, limit=args.tasks)
    oracle_backend(args)
    if args.backend == "scripted" and script is None:
        from examples.calc_agent.scripted import ScriptedCalc

        script = ScriptedCalc(oracle=args.oracle)
    if args.store is not None:
        trainer_kw.setdefault("store", args.store)
    is_path = args.model is not None and os.path.isdir(args.model)
    trainer = Trainer(
        model=model if model is not None else (args.model if is_path else None),
        tokenizer=tokenizer,
        backend=args.backend,
        script=script,
        agents=[AGENT],
        runners=min(len(tasks), 4),
        sampling={"max_tokens": args.max_tokens, "temperature": args.temperature},
        progress=False,
        **trainer_kw,
    )
    return trainer.dev(
        make_rollout(),
        tasks,
        base_url=args.base_url,
        model=None if is_path else args.model,
        api_key=args.api_key or (os.environ.get("OPENAI_API_KEY") if args.base_url else None),
    )


def train(args: argparse.Namespace, *, model: Any = None, tokenizer: Any = None, **trainer_kw: Any) -> Any:
    from agl import LightningRL, Trainer
    from examples.calc_agent import data
    from examples.calc_agent.agent import AGENT, make_rollout

    algorithm = LightningRL(
        credit=args.credit,
        advantage_level=args.advantage_level,
        group_size=args.group_size,
        learning_rate=args.learning_rate,
        lora_r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        micro_batch_tokens=args.micro_batch_tokens,
    )
    kw: dict[str, Any] = {
        "agents": [AGENT],
        "runners": args.runners,
        "run_dir": args.run_dir,
        "sampling": {"max_tokens": args.max_tokens, "temperature": args.temperature},
        "tasks_per_step": args.tasks_per_step,
        "steps": args.steps,
        "val_every": args.val_every,
        "seed": args.seed,
        "resume": args.resume,
        **trainer_kw,
    }
    trainer = Trainer(
        algorithm,
        model=model if model is not None else model_arg(args),
        tokenizer=tokenizer,
        backend=args.backend,
        vllm_url=args.vllm_url,
        model_name=args.model_name,
        **kw,
    )
    val = _val_tasks(data.load_tasks("test", limit=args.val_tasks)) if args.val_tasks else None
    summary = trainer.fit(make_rollout(), data.load_tasks("train"), val)
    print(
        json.dumps(
            {k: summary[k] for k in ("run_dir", "steps", "val_reward_before", "val_reward_after")}, indent=2
        )
    )
    return summary


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
    else:
        train(args)
    return 0
