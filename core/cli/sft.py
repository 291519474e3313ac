"""``agl sft``: a supervised warm start on demonstrations read from a store (:class:`agl.SFT`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from agl.algorithms.sft import SFT
from agl.cli._util import add_store_args, open_store_from_args
from agl.cli.config_args import add_config_arguments, config_from_args
from agl.cli.config_file import add_config_file_arguments

__all__ = ["register_cli"]

#: SFT's fields that are flags of ``agl sft``, and their ``dest``s (``--full``, ``--per-call`` and
#: ``--keep-penalised`` turn ``lora``, ``merge_turns`` and ``drop_penalised`` off)
_SFT_FLAGS = {
    "min_reward": "min_reward",
    "best_of_group": "best_of_group",
    "drop_penalised": "keep_penalised",
    "epochs": "epochs",
    "batch_size": "batch_size",
    "learning_rate": "learning_rate",
    "lora_r": "lora_r",
    "lora": "full",
    "max_length": "max_length",
    "precision": "precision",
    "merge_turns": "per_call",
    "adapter_per_agent": "adapter_per_agent",
}


def register_cli(parser: argparse.ArgumentParser) -> None:
    add_store_args(parser, what="store with the demonstrations")
    sel = parser.add_mutually_exclusive_group()
    sel.add_argument("--agents", help="comma-separated agent names to train on (default: all)")
    sel.add_argument("--agents-regex", help="agents whose name fully matches this regular expression")
    add_config_arguments(
        parser,
        SFT,
        only=["min_reward", "best_of_group", "drop_penalised"],
        overrides={
            "min_reward": {"help": "keep rollouts whose final reward is >= this"},
            "drop_penalised": {
                "flags": ["--keep-penalised"],
                "help": "also train on calls AIR penalised (by default a call that wrote a failing tool "
                "call is left out of the demonstrations)",
            },
        },
    )
    parser.add_argument("--mode", choices=("train", "val", "test"), help="only rollouts of this mode")
    parser.add_argument("--model", help="a local model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--out", required=True, help="run directory: checkpoints, metrics, the merged model")
    add_config_arguments(
        parser,
        SFT,
        only=["epochs", "batch_size", "learning_rate", "lora_r", "lora", "max_length", "precision"],
        overrides={"lora": {"flags": ["--full"], "help": "full fine-tuning instead of LoRA"}},
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the data order and the adapter")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--no-merge", action="store_true", help="keep only the LoRA checkpoint")
    add_config_arguments(
        parser,
        SFT,
        only=["merge_turns", "adapter_per_agent"],
        overrides={
            "merge_turns": {
                "flags": ["--per-call"],
                "help": "one sequence per LLM call instead of one per agent conversation (--merge-turns off)",
            }
        },
    )
    add_config_file_arguments(parser)
    parser.set_defaults(func=_cmd_sft)


def _cmd_sft(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    agents: Any = None
    if args.agents is not None:
        agents = [a.strip() for a in args.agents.split(",") if a.strip()]
    elif args.agents_regex is not None:
        agents = args.agents_regex
    if args.model is not None and not Path(args.model).is_dir():
        raise FileNotFoundError(f"--model {args.model}: not a local model directory")
    cfg = config_from_args(  # refuses bad knob values with agl.errors.UsageError
        SFT, args, _SFT_FLAGS, lora_alpha=2 * args.lora_r
    )
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    store = open_store_from_args(args)
    try:
        selection = None if cfg.adapter_per_agent else agents  # per agent: fit names what is missing
        transitions = cfg.read(store, agents=selection, mode=args.mode, progress=sys.stderr.isatty())
    finally:
        store.close()
    summary = cfg.fit(
        transitions,
        args.model,
        agents=agents if cfg.adapter_per_agent else None,  # read by agents already; per agent: named
        run_dir=args.out,
        seed=args.seed,
        merge=not args.no_merge,
        progress=sys.stderr.isatty(),
    )
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
    return 0
