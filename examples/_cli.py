"""The ``dev``/``train``/``data`` command line shared by the examples that differ only in defaults."""

from __future__ import annotations

import argparse
from typing import Any

from agl.cli.config_args import add_config_arguments, add_engine_arguments, config_from_args, engine_from_args
from agl.config import LoopConfig, RunConfig
from agl.run.settings import Serving


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
    add_train_options(t, name, item)
    t.set_defaults(**train_defaults)

    sub.add_parser("data", help=data_help)
    return p, sub


def add_train_options(t: argparse.ArgumentParser, name: str, item: str) -> None:
    """``train``'s options: the model and backend, then the loop's and the update's numbers (flags
    from agl.config's fields: type, default, help, with the examples' own defaults where they differ)."""
    t.add_argument("--model", default=None, help="a local model path (default: embedded SmolLM2-135M)")
    t.add_argument(
        "--warm-start",
        default=None,
        metavar="SFT_DIR",
        help="start RL from an `agl sft` output (its merged model; overrides --model); with "
        "--adapter-per-agent, each agent's adapter from an `agl sft --adapter-per-agent` output, or "
        "fresh adapters on a shared `agl sft` output's merged model",
    )
    t.add_argument("--backend", choices=["transformers", "vllm"], default="transformers")
    t.add_argument("--vllm-url", default=None, help="the vLLM OpenAI server (with --backend vllm)")
    t.add_argument("--model-name", default=None, help="the name the vLLM server serves the model under")
    t.add_argument("--run-dir", default=f"runs/{name}")
    add_config_options(
        t, LoopConfig, ["steps", "tasks_per_step"], steps={"default": None}, tasks_per_step={"default": 2}
    )
    t.add_argument("--group-size", type=int, default=8)
    t.add_argument("--val-tasks", type=int, help=f"held-out {item} evaluated (0: none)")
    add_config_options(t, LoopConfig, ["val_every", "val_samples"], val_every={"default": None})
    add_schedule_options(t)
    add_config_options(
        t,
        RunConfig,
        ["max_tokens", "temperature", "learning_rate", "lora_r", "kl_coef", "loss_balance"],
        max_tokens={"help": "the longest reply the agent's model may write"},
        temperature={"default": 0.7, "help": "the sampling temperature (the update's too)"},
        learning_rate={"default": None, "help": "the update's learning rate (default: the example's)"},
        lora_r={"help": "LoRA rank"},
        kl_coef={"help": "KL penalty to the starting policy (keeps RL near the warm start)"},
        loss_balance={"choices": ["token", "transition", "rollout"]},
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
    add_engine_arguments(t, only=["batched_lora", "dtype", "deterministic", "prefix_cache_mb"])
    add_config_options(t, LoopConfig, ["seed", "resume", "checkpoint_every"])


def add_schedule_options(t: argparse.ArgumentParser) -> None:
    """``train``'s options every example shares for how a run samples and validates."""
    add_config_options(
        t,
        LoopConfig,
        ["val_before", "dynamic_sampling", "max_staleness", "adapter_per_agent"],
        dynamic_sampling={"metavar": "ROUNDS"},
        max_staleness={"metavar": "K"},
    )


def add_config_options(
    parser: argparse.ArgumentParser, cls: type, names: list[str], **overrides: dict[str, Any]
) -> None:
    """``--field-name`` flags for the fields ``names`` of the config dataclass ``cls``, generated by
    :func:`agl.cli.config_args.add_config_arguments` (type, default and help from the field;
    ``overrides[name]`` is an example's own default or help)."""
    add_config_arguments(parser, cls, only=names, overrides=overrides)


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


def _warm_adapters(args: argparse.Namespace) -> bool:
    """Whether ``train --adapter-per-agent --warm-start DIR`` starts each agent's adapter from DIR's
    per-agent adapters (an ``agl sft --adapter-per-agent`` run); False for a shared ``agl sft`` run,
    whose merged model is then every agent's frozen base, each adapter starting fresh on top of it."""
    if not (getattr(args, "warm_start", None) and getattr(args, "adapter_per_agent", False)):
        return False
    from agl.algorithms.per_agent_lora import warm_adapters_dir
    from agl.algorithms.sft import warm_start_model

    try:
        warm_adapters_dir(args.warm_start)
    except FileNotFoundError:
        try:
            warm_start_model(args.warm_start)
        except FileNotFoundError:  # neither: the per-agent path names what is missing
            return True
        return False  # a merged model and no per-agent adapters: a shared SFT run
    return True


def model_arg(args: argparse.Namespace) -> str | None:
    """``train``'s model: the warm start's merged model when given (a shared ``agl sft`` run, with or
    without ``--adapter-per-agent``), else ``--model``; from an ``agl sft --adapter-per-agent`` run,
    the base model its adapters were trained on (its ``sft_summary.json``)."""
    if _warm_adapters(args):
        import json
        from pathlib import Path

        summary = Path(args.warm_start) / "sft_summary.json"
        base = json.loads(summary.read_text()).get("base_model") if summary.is_file() else None
        return base or args.model
    if getattr(args, "warm_start", None):
        from agl.algorithms.sft import warm_start_model

        return str(warm_start_model(args.warm_start))
    return args.model


def warm_adapters_arg(args: argparse.Namespace) -> str | None:
    """``train --adapter-per-agent --warm-start SFT_DIR``: each agent's adapter starts from the
    ``agl sft --adapter-per-agent`` run's (``LoopConfig(warm_adapters=...)``); None otherwise (a shared
    warm start is the base model, see :func:`model_arg`)."""
    return str(args.warm_start) if _warm_adapters(args) else None


def train_settings(
    args: argparse.Namespace, keywords: dict[str, Any], **serving: Any
) -> tuple[LoopConfig, Serving, dict[str, Any]]:
    """The run's ``LoopConfig`` and ``Serving``, each built whole from ``train``'s generated flags
    (:func:`agl.cli.config_args.config_from_args`), the warm start resolved into the model and the
    per-agent adapters. ``keywords`` (a caller's overrides, e.g. a test's scripted backend) win over the
    flags for the ``LoopConfig`` and ``Serving`` fields they name; ``serving`` (a model or tokenizer
    object) wins where it is not None. Returns the two configs and the keywords that belong to neither
    (the Trainer's own arguments: ``judge``, ``reward``, ...)."""
    import dataclasses

    rest = dict(keywords)
    own = {cls: {f.name for f in dataclasses.fields(cls)} for cls in (LoopConfig, Serving)}
    loop_kw = {k: rest.pop(k) for k in list(rest) if k in own[LoopConfig]}
    serving_kw = {k: rest.pop(k) for k in list(rest) if k in own[Serving]}
    loop = config_from_args(LoopConfig, args, **{"warm_adapters": warm_adapters_arg(args), **loop_kw})
    values = {
        "model": model_arg(args),
        "engine": engine_from_args(args, process_threads=True),
        **{k: v for k, v in serving.items() if v is not None},
        **serving_kw,
    }
    return loop, config_from_args(Serving, args, **values), rest


def lightning_rl(args: argparse.Namespace, **more: Any) -> Any:
    """The LightningRL of ``train``'s update flags (``more``: an example's own, e.g. ``running_window``)."""
    from agl import LightningRL

    return LightningRL(
        credit=args.credit,
        advantage_level=args.advantage_level,
        group_size=args.group_size,
        learning_rate=args.learning_rate,
        lora_r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        kl_coef=args.kl_coef,
        gradient_checkpointing=checkpointing_arg(args),
        micro_batch_tokens=args.micro_batch_tokens,
        mask_truncated=args.mask_truncated,
        loss_balance=args.loss_balance,
        **more,
    )


def fit(
    args: argparse.Namespace,
    keywords: dict[str, Any],
    *,
    algorithm: Any,
    agents: Any,
    rollout: Any,
    train_tasks: list[dict[str, Any]],
    val_tasks: list[dict[str, Any]] | None,
    **serving: Any,
) -> Any:
    """``train``: the Trainer from the flags (:func:`train_settings`), fitted; held-out tasks decoded
    greedily (before/after figures then compare policies, not luck); prints the run's summary line."""
    import json

    from agl import Trainer

    loop, serving_config, rest = train_settings(args, keywords, **serving)
    trainer = Trainer(
        algorithm,
        serving=serving_config,
        loop=loop,
        agents=agents,
        config=RunConfig(max_tokens=args.max_tokens, temperature=args.temperature),
        **rest,
    )
    val = [{**t, "temperature": 0.0} for t in val_tasks] if val_tasks else None
    summary = trainer.fit(rollout, train_tasks, val)
    keys = ("run_dir", "steps", "val_reward_before", "val_reward_after")
    print(json.dumps({k: summary.get(k) for k in keys}, indent=2))
    return summary
