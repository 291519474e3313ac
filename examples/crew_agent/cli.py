"""``python -m examples.crew_agent dev|train|data``: run the crew without training, train its writer,
or print a summary of the fact base. See README.md for what each prints and the figures measured."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

from agl.cli.config_args import add_engine_arguments
from agl.config import LoopConfig, RunConfig
from agl.run.settings import Serving
from examples._cli import (
    add_config_options,
    add_schedule_options,
    fit,
)

__all__ = ["dev", "main", "parser", "train"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.crew_agent", description=__doc__)
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (fewer than the cores helps on a busy CPU)"
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
    d.add_argument("--max-tokens", type=int, default=128)
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument(
        "--store",
        default=None,
        help="record the rollouts in this store (e.g. sqlite:///runs/demos.db; default: in memory)",
    )

    t = sub.add_parser("train", help="train the writer with LightningRL")
    t.add_argument("--model", default=None, help="a local model path (default: embedded SmolLM2-135M)")
    t.add_argument("--backend", choices=["transformers", "vllm"], default="transformers")
    t.add_argument("--vllm-url", default=None, help="the vLLM OpenAI server (with --backend vllm)")
    add_config_options(t, Serving, ["run_dir"], run_dir={"default": "runs/crew_agent"})
    add_config_options(
        t, LoopConfig, ["steps", "tasks_per_step"], steps={"default": 16}, tasks_per_step={"default": 4}
    )
    t.add_argument("--group-size", type=int, default=4)
    t.add_argument("--val-tasks", type=int, default=24, help="held-out tasks evaluated (0: none)")
    add_config_options(t, LoopConfig, ["val_every", "val_samples"], val_every={"default": 8})
    add_schedule_options(t)
    add_config_options(
        t,
        RunConfig,
        ["max_tokens", "temperature", "learning_rate", "lora_r"],
        max_tokens={"help": "the longest reply the writer may write"},
        temperature={"default": 0.7, "help": "the sampling temperature (the update's too)"},
        learning_rate={"default": 3e-4, "help": "the update's learning rate"},
        lora_r={"help": "LoRA rank"},
    )
    add_config_options(t, Serving, ["runners"], runners={"default": 8, "help": "rollouts run at once"})
    add_engine_arguments(t, only=["batched_lora"])
    add_config_options(t, LoopConfig, ["seed", "resume", "checkpoint_every"])

    for sp in (d, t):
        g = sp.add_argument_group("researcher on a fixed model (default: the same model as the writer)")
        g.add_argument("--researcher-base-url", default=None, help="an OpenAI-compatible endpoint")
        g.add_argument("--researcher-model", default=None, help="the model name there")
        g.add_argument("--researcher-api-key", default=None, help="its API key (default: $OPENAI_API_KEY)")
        g.add_argument(
            "--scripted-researcher",
            action="store_true",
            help="serve a scripted researcher that always looks the company up (isolates the writer)",
        )

    sub.add_parser("data", help="print a summary of the fact base and the tasks")
    return p


@contextlib.contextmanager
def researcher(args: argparse.Namespace) -> Iterator[dict[str, str] | None]:
    """The researcher's fixed endpoint, if one was asked for (a local scripted gateway with
    ``--scripted-researcher``, served for the duration of the run)."""
    if args.scripted_researcher:
        from agl.gateway.testing import ScriptedBackend, serve_gateway
        from examples.crew_agent.scripted import ScriptedCrew

        backend = ScriptedBackend(ScriptedCrew(only="good"), accept_any_model=True)
        with serve_gateway(backend) as url:
            yield {"base_url": str(url), "model": "scripted", "api_key": "agl"}
    elif args.researcher_base_url:
        if not args.researcher_model:
            raise SystemExit("--researcher-base-url needs --researcher-model")
        yield {
            "base_url": args.researcher_base_url,
            "model": args.researcher_model,
            "api_key": args.researcher_api_key or os.environ.get("OPENAI_API_KEY", "agl"),
        }
    else:
        yield None


def dev(
    args: argparse.Namespace,
    *,
    model: Any = None,
    tokenizer: Any = None,
    script: Any = None,
    **serving_kw: Any,
) -> Any:
    from agl import RunConfig, Serving, Trainer
    from examples.crew_agent import data
    from examples.crew_agent.agent import TRAINED_AGENTS, make_rollout

    tasks = data.load_tasks(args.split, limit=args.tasks)
    if args.backend == "scripted" and script is None:
        from examples.crew_agent.scripted import ScriptedCrew

        script = ScriptedCrew()
    if args.store is not None:
        serving_kw.setdefault("store", args.store)
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
    with researcher(args) as fixed:
        return trainer.dev(
            make_rollout(fixed),
            tasks,
            base_url=args.base_url,
            model=None if is_path else args.model,
            api_key=args.api_key or (os.environ.get("OPENAI_API_KEY") if args.base_url else None),
        )


def train(args: argparse.Namespace, *, model: Any = None, tokenizer: Any = None, **trainer_kw: Any) -> Any:
    from agl import LightningRL
    from examples.crew_agent import data
    from examples.crew_agent.agent import TRAINED_AGENTS, make_rollout

    algorithm = LightningRL(
        group_size=args.group_size,
        learning_rate=args.learning_rate,
        lora_r=args.lora_r,
        lora_alpha=2 * args.lora_r,
    )
    val = data.load_tasks("test", limit=args.val_tasks) if args.val_tasks else None
    with researcher(args) as fixed:
        return fit(
            args,
            trainer_kw,
            algorithm=algorithm,
            agents=TRAINED_AGENTS,
            rollout=make_rollout(fixed),
            train_tasks=data.load_tasks("train"),
            val_tasks=val,
            model=model,
            tokenizer=tokenizer,
        )


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # CrewAI's anonymous telemetry and trace upload stay off (agent.py sets these too)
    os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")
    # CrewAI warns on every call to a model it has no token counter for: say it once, not per call
    logging.getLogger("crewai.llms.base_llm").setLevel(logging.ERROR)
    args = parser().parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.command == "data":
        from examples.crew_agent import data

        print(data.summary())
        for task in data.load_tasks("test", limit=3):
            print(json.dumps(task))
    elif args.command == "dev":
        dev(args)
    else:
        train(args)
    return 0
