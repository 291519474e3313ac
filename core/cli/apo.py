"""``agl apo``: APO (:mod:`agl.algorithms.apo`) from the command line — tasks from task files (agl.cli.task_files), settings from flags or a --config file, the agent as ``module:function``,
the optimiser as any OpenAI-compatible endpoint. It builds an ``agl.Trainer`` with an ``agl.APO`` and
runs it, printing the summary as JSON; bad input is a one-line error and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from agl.algorithms.apo.algorithm import APO
from agl.cli.config_args import add_config_arguments, config_from_args
from agl.cli.config_file import add_config_file_arguments
from agl.config import LoopConfig, RunConfig
from agl.errors import UsageError
from agl.run.settings import Serving

__all__ = ["load_jsonl", "register_cli"]

log = logging.getLogger("agl.apo")

#: APO's budget fields, flags of ``agl apo`` (with ``failure_below``)
_BUDGETS = ("rounds", "beam_width", "branch_factor", "rollouts_per_candidate", "max_optimizer_tokens")


def load_jsonl(path: str | os.PathLike[str]) -> list[Any]:
    """Task inputs from a task file (:func:`agl.cli.task_files.load_tasks`: JSONL, JSON, CSV, Parquet, a saved
    dataset); errors name the file and line."""
    from agl.cli.task_files import load_tasks

    return load_tasks(path)


def register_cli(parser: argparse.ArgumentParser) -> None:
    """``agl apo``: optimise an agent's prompts (see :mod:`agl.algorithms.apo`)."""
    a = parser.add_argument
    a("--agent", required=True, help="the agent function as module:function (reads agl.prompt)")
    a("--train", required=True, help="training tasks: a .jsonl/.json/.csv/.parquet file (as agl train)")
    a("--val", required=True, help="validation tasks (the same forms): candidates are chosen on them")
    a("--test", default=None, help="held-out tasks (the same forms): initial vs best prompt at the end")
    a(
        "--prompt",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="a starting prompt (default: the agent's own)",
    )
    a("--agents", action="append", default=None, metavar="NAME", help="optimise only these prompts")
    g = parser.add_argument_group("optimiser (any OpenAI-compatible endpoint; default: the agent's model)")
    add_config_arguments(g, APO, only=["optimizer_base_url", "optimizer_model", "optimizer_api_key"])
    g.add_argument("--optimizer-temperature", type=float, default=1.0, help="the optimiser's temperature")
    g.add_argument("--optimizer-max-tokens", type=int, default=1024, help="per optimiser reply")
    add_config_arguments(g, APO, only=["rewrite_format"])
    b = parser.add_argument_group("budgets")
    add_config_arguments(b, APO, only=[*_BUDGETS, "failure_below"])
    m = parser.add_argument_group("the agent's model")
    add_config_arguments(
        m,
        Serving,
        only=["base_url", "model", "api_key", "vllm_url"],
        overrides={
            "base_url": {"help": "an OpenAI-compatible endpoint for the agent"},
            "model": {"help": "model name at --base-url, or a local model path"},
            "api_key": {"help": "API key for --base-url (default: $OPENAI_API_KEY)"},
            "vllm_url": {"help": "a vLLM server for the agent instead"},
        },
    )
    add_config_arguments(
        m,
        RunConfig,
        only=["temperature", "max_tokens"],
        overrides={
            "temperature": {"default": 0.0, "help": "the agent's sampling temperature (0: greedy)"},
            "max_tokens": {"default": 256, "help": "the longest reply the agent's model may write"},
        },
    )
    r = parser.add_argument_group("run")
    add_config_arguments(
        r,
        Serving,
        only=["store", "runners", "run_dir"],
        overrides={
            "store": {"help": "store URL (default: sqlite in --run-dir)"},
            "runners": {"help": "rollouts run at once (0: external agl runner)"},
            "run_dir": {"default": "runs/apo"},
        },
    )
    add_config_arguments(r, LoopConfig, only=["seed"], overrides={"seed": {"help": "seed of the task order"}})
    add_config_arguments(r, Serving, only=["progress"])
    r.add_argument(
        "--no-instrument",
        action="store_true",
        help="do not instrument the integrations of the frameworks the agent's module imports",
    )
    add_config_file_arguments(parser)
    parser.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    from agl.runner.runner import load_agent
    from agl.trainer.trainer import Trainer

    prompts: dict[str, str] = {}
    for spec in args.prompt:
        name, sep, path = spec.partition("=")
        if not sep or not name:
            raise UsageError(f"--prompt must be NAME=FILE, got {spec!r}")
        if not Path(path).is_file():
            raise FileNotFoundError(f"--prompt {name}: no such file: {path}")
        prompts[name] = Path(path).read_text().strip()
    apo = config_from_args(
        APO,
        args,
        {name: name for name in (*_BUDGETS, "failure_below", "rewrite_format")},
        prompts=prompts or None,
        agents=args.agents,
        optimizer_base_url=args.optimizer_base_url,
        optimizer_model=args.optimizer_model,
        optimizer_api_key=args.optimizer_api_key,
        optimizer_sampling={
            "temperature": args.optimizer_temperature,
            "max_tokens": args.optimizer_max_tokens,
        },
    )
    train, val = load_jsonl(args.train), load_jsonl(args.val)
    test = load_jsonl(args.test) if args.test else None
    agent = load_agent(args.agent)
    if not args.no_instrument and args.runners > 0:  # as `agl runner` does for the agents it runs
        from agl.runner.runner import instrument_imported_frameworks

        names = instrument_imported_frameworks()
        log.info("agl apo: instrumented %s", ", ".join(names) or "nothing (no framework imported)")
    backend = "openai" if args.base_url else ("vllm" if args.vllm_url else "transformers")
    # the Trainer checks the flags it is given: a refusal is a UsageError, printed in one line
    serving = Serving(
        backend=backend,
        model=args.model if backend == "transformers" else None,
        base_url=args.base_url,
        api_key=args.api_key,
        vllm_url=args.vllm_url,
        model_name=args.model if backend != "transformers" else None,
        store=args.store,
        runners=args.runners,
        run_dir=args.run_dir,
        progress=not args.no_progress,
    )
    trainer = Trainer(
        apo,
        serving=serving,
        loop=LoopConfig(seed=args.seed),
        config=RunConfig(temperature=args.temperature, max_tokens=args.max_tokens),
    )
    if test is None:
        summary = trainer.fit(agent, train, val)
    else:  # Trainer.fit has no held-out split; APO.fit is the same run with the Trainer's settings
        summary = apo.fit(trainer, agent, train, val, test=test)
    summary.pop("history", None)
    print(json.dumps(summary, indent=2))
    return 0
