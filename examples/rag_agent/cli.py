"""``python -m examples.rag_agent dev|train|data``: run the agent without training, train it, or
build the corpus and its embedding cache. See README.md for what each prints and the figures measured."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from agl.cli.config_args import add_engine_arguments
from agl.config import LoopConfig, RunConfig
from agl.run.settings import Serving
from examples._cli import (
    add_config_options,
    add_schedule_options,
    add_update_options,
    checkpointing_arg,
    fit,
    oracle_backend,
)

__all__ = ["dev", "main", "parser", "train"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.rag_agent", description=__doc__)
    p.add_argument(
        "--data-dir", default=None, help="where the embeddings are cached (default: the agl cache)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (fewer than the cores helps on a busy CPU)"
    )
    p.add_argument(
        "--scale", type=int, default=None, help="people in the world (default 1100: 2522 passages)"
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
    d.add_argument("-n", "--tasks", type=int, default=4, help="how many tasks (default 4)")
    d.add_argument("--max-tokens", type=int, default=96)
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument(
        "--oracle",
        action="store_true",
        help="serve the oracle teacher (gold searches and answer, scripted backend): demonstrations for `agl sft`",
    )
    d.add_argument("--store", default=None, help="record the rollouts in this store (default: in memory)")

    t = sub.add_parser("train", help="train the researcher with LightningRL")
    t.add_argument("--model", default=None, help="a local model path (default: embedded SmolLM2-135M)")
    t.add_argument(
        "--warm-start",
        default=None,
        metavar="SFT_DIR",
        help="start RL from an `agl sft` output (overrides --model)",
    )
    t.add_argument("--backend", choices=["transformers", "vllm"], default="transformers")
    t.add_argument("--vllm-url", default=None, help="the vLLM OpenAI server (with --backend vllm)")
    add_config_options(t, Serving, ["run_dir"], run_dir={"default": "runs/rag_agent"})
    add_config_options(
        t, LoopConfig, ["steps", "tasks_per_step"], steps={"default": 10}, tasks_per_step={"default": 4}
    )
    t.add_argument("--group-size", type=int, default=4)
    t.add_argument("--val-tasks", type=int, default=24, help="held-out questions evaluated (0: none)")
    add_config_options(t, LoopConfig, ["val_every", "val_samples"], val_every={"default": 5})
    add_schedule_options(t)
    add_update_options(t)
    add_config_options(
        t,
        RunConfig,
        ["max_tokens", "temperature", "learning_rate", "lora_r", "kl_coef"],
        max_tokens={"help": "the longest reply the agent's model may write"},
        temperature={"help": "the sampling temperature (the update's too)"},
        learning_rate={"default": 1e-4, "help": "the update's learning rate"},
        lora_r={"help": "LoRA rank"},
        kl_coef={"help": "KL penalty to the starting policy (keeps RL near the warm start)"},
    )
    add_config_options(t, Serving, ["runners"], runners={"default": 8, "help": "rollouts run at once"})
    add_engine_arguments(t, only=["batched_lora"])
    add_config_options(t, LoopConfig, ["seed", "resume", "checkpoint_every"])
    t.add_argument(
        "--judge",
        choices=["none", "noisy-f1", "rubric"],
        default="none",
        help="train on a stand-in LLM judge's scores instead of F1 (examples/rag_agent/judge.py)",
    )
    t.add_argument("--judge-sigma", type=float, default=0.1, help="noise of the noisy-f1 stand-in")
    t.add_argument("--judge-seed", type=int, default=0, help="seed of the noisy-f1 stand-in's noise")

    sub.add_parser("data", help="build the corpus, cache its embeddings, print a summary")
    return p


def _scale(args: argparse.Namespace) -> int:
    from examples.rag_agent import data

    return args.scale if args.scale is not None else data.DEFAULT_SCALE


def _prepare_index(args: argparse.Namespace) -> None:
    """Embed the corpus before any rollout starts (once; later runs read the cache)."""
    from examples.rag_agent.agent import get_index

    get_index(_scale(args), data_dir=args.data_dir)


def dev(
    args: argparse.Namespace,
    *,
    model: Any = None,
    tokenizer: Any = None,
    script: Any = None,
    **serving_kw: Any,
) -> Any:
    from agl import RunConfig, Serving, Trainer
    from examples.rag_agent import data
    from examples.rag_agent.agent import TRAINED_AGENTS, make_rollout

    tasks = data.load_tasks(args.split, scale=_scale(args), limit=args.tasks)
    oracle_backend(args)
    if args.backend == "scripted" and script is None:
        from examples.rag_agent.scripted import ScriptedRAG

        script = ScriptedRAG(_scale(args), oracle=args.oracle)
    if args.store is not None:
        serving_kw.setdefault("store", args.store)
    _prepare_index(args)
    is_path = args.model is not None and os.path.isdir(args.model)
    serving = Serving(
        model=model if model is not None else (args.model if is_path else None),
        tokenizer=tokenizer,
        backend=args.backend,
        script=script,
        runners=min(len(tasks), 4) or 1,
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


def _judge_kw(args: argparse.Namespace) -> dict[str, Any]:
    """``--judge``: the Trainer's judge and reward (the held-out reward stays F1: only training changes)."""
    choice = getattr(args, "judge", "none")
    if choice == "none":
        return {}
    from examples.rag_agent.judge import noisy_f1_judge, rubric_judge

    judge = noisy_f1_judge(args.judge_sigma, args.judge_seed) if choice == "noisy-f1" else rubric_judge()
    return {"judge": judge, "reward": "judge"}


def train(args: argparse.Namespace, *, model: Any = None, tokenizer: Any = None, **trainer_kw: Any) -> Any:
    from agl import LightningRL
    from examples.rag_agent import data
    from examples.rag_agent.agent import TRAINED_AGENTS, make_rollout

    algorithm = LightningRL(
        group_size=args.group_size,
        learning_rate=args.learning_rate,
        lora_r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        kl_coef=args.kl_coef,
        gradient_checkpointing=checkpointing_arg(args),
        micro_batch_tokens=args.micro_batch_tokens,
        mask_truncated=args.mask_truncated,
    )
    scale = _scale(args)
    _prepare_index(args)
    val = data.load_tasks("test", scale=scale, limit=args.val_tasks) if args.val_tasks else None
    return fit(
        args,
        {**_judge_kw(args), **trainer_kw},
        algorithm=algorithm,
        agents=TRAINED_AGENTS,
        rollout=make_rollout(args.data_dir),
        train_tasks=data.load_tasks("train", scale=scale),
        val_tasks=val,
        model=model,
        tokenizer=tokenizer,
    )


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The Agents SDK's default trace processor uploads to OpenAI: agl replaces it (agent.py says so too).
    os.environ.setdefault("AGL_OPENAI_AGENTS_REPLACE_EXPORTER", "1")
    args = parser().parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.command == "data":
        from examples.rag_agent import data

        _prepare_index(args)
        print(data.summary(_scale(args)))
        print(f"embeddings cached under {args.data_dir or data.default_data_dir()}")
    elif args.command == "dev":
        dev(args)
    else:
        train(args)
    return 0
