"""The ``dev``/``train``/``data`` command line shared by the examples that differ only in defaults."""

from __future__ import annotations

import argparse
from typing import Any


def example_parser(
    name: str,
    doc: str | None,
    *,
    train_help: str,
    data_help: str,
    item: str,
    train_defaults: dict[str, Any],
) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The parser of ``python -m examples.<name>``; returns it with its sub-parsers to add to."""
    p = argparse.ArgumentParser(prog=f"python -m examples.{name}", description=doc)
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: torch's default; 1 is best on a busy CPU)"
    )
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("dev", help="run a few rollouts and print their transitions and rewards")
    d.add_argument(
        "--backend",
        choices=["transformers", "scripted"],
        default="transformers",
        help="the embedded SmolLM2-135M (default) or the scripted model of scripted.py",
    )
    d.add_argument("--base-url", default=None, help="any OpenAI-compatible endpoint instead")
    d.add_argument("--model", default=None, help="model name at --base-url, or a local model path")
    d.add_argument("--api-key", default=None, help="API key for --base-url (default: $OPENAI_API_KEY)")
    d.add_argument("--split", choices=["train", "test"], default="test")
    d.add_argument("-n", "--tasks", type=int, default=4, help=f"how many {item} (default 4)")
    d.add_argument("--max-tokens", type=int, default=64)
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument(
        "--oracle",
        action="store_true",
        help="serve the example's oracle teacher (gold answers, scripted backend): demonstrations for `agl sft`",
    )
    d.add_argument(
        "--store",
        default=None,
        help="record the rollouts in this store (e.g. sqlite:///runs/demos.db; default: in memory)",
    )

    t = sub.add_parser("train", help=train_help)
    t.add_argument("--model", default=None, help="a local model path (default: embedded SmolLM2-135M)")
    t.add_argument(
        "--warm-start",
        default=None,
        metavar="SFT_DIR",
        help="start RL from an `agl sft` output (its merged model; overrides --model)",
    )
    t.add_argument("--backend", choices=["transformers", "vllm"], default="transformers")
    t.add_argument("--vllm-url", default=None, help="the vLLM OpenAI server (with --backend vllm)")
    t.add_argument("--model-name", default=None, help="the name the vLLM server serves the model under")
    t.add_argument("--run-dir", default=f"runs/{name}")
    t.add_argument("--steps", type=int)
    t.add_argument("--tasks-per-step", type=int, default=2)
    t.add_argument("--group-size", type=int, default=8)
    t.add_argument("--val-tasks", type=int, help=f"held-out {item} evaluated (0: none)")
    t.add_argument("--val-every", type=int)
    add_schedule_options(t)
    t.add_argument("--max-tokens", type=int, default=64)
    t.add_argument("--temperature", type=float, default=0.7)
    t.add_argument("--learning-rate", type=float)
    t.add_argument("--lora-r", type=int, default=16)
    t.add_argument(
        "--kl-coef",
        type=float,
        default=0.0,
        help="KL penalty to the starting policy (keeps RL near the warm start)",
    )
    t.add_argument(
        "--credit",
        choices=["identical", "discounted"],
        default="identical",
        help="LightningRL credit assignment (discounted: AIR penalties count per call)",
    )
    t.add_argument("--advantage-level", choices=["rollout", "transition"], default="rollout")
    add_update_options(t)
    t.add_argument("--runners", type=int, default=16, help="rollouts run at once")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--resume", action="store_true")
    t.set_defaults(**train_defaults)

    sub.add_parser("data", help=data_help)
    return p, sub


def add_schedule_options(t: argparse.ArgumentParser) -> None:
    """``train``'s options every example shares for how a run samples and validates."""
    t.add_argument(
        "--no-val-before",
        action="store_true",
        help="skip the held-out check before the first update (the warm start's figure is already known)",
    )
    t.add_argument(
        "--dynamic-sampling",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="DAPO dynamic sampling: up to ROUNDS extra rounds of fresh tasks while a step has fewer than "
        "--tasks-per-step groups with reward variance (default 0: off)",
    )


def oracle_backend(args: argparse.Namespace) -> None:
    """``dev --oracle`` is the scripted backend serving the example's oracle teacher."""
    if getattr(args, "oracle", False):
        args.backend = "scripted"


def add_update_options(t: argparse.ArgumentParser) -> None:
    """``train``'s options for the policy update: its memory and speed (``--micro-batch-tokens``,
    ``--gradient-checkpointing``, read back with :func:`checkpointing_arg`) and ``--mask-truncated``."""
    t.add_argument("--micro-batch-tokens", type=int, help="tokens per forward/backward (memory bound)")
    t.add_argument(
        "--gradient-checkpointing",
        choices=["auto", "on", "off"],
        default="auto",
        help="activation checkpointing in the update (auto: on for a GPU or a large micro-batch; off with "
        "--micro-batch-tokens 1024 is ~1.9x faster on a CPU for ~0.7 GB more, bench/README.md)",
    )
    t.add_argument(
        "--mask-truncated",
        action="store_true",
        help="leave calls cut at --max-tokens out of the loss (DAPO's overlong filtering)",
    )


def checkpointing_arg(args: argparse.Namespace) -> bool | None:
    """``train --gradient-checkpointing``: None (auto) lets the update choose per device and budget."""
    return {"auto": None, "on": True, "off": False}[args.gradient_checkpointing]


def model_arg(args: argparse.Namespace) -> str | None:
    """``train``'s model: the warm start's merged model when given, else ``--model``."""
    if getattr(args, "warm_start", None):
        from agl.algorithms.sft import warm_start_model

        return str(warm_start_model(args.warm_start))
    return args.model
