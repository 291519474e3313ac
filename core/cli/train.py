"""``agl train``: train an agent with LightningRL from the command line — the agent as ``module:function``,
tasks from data files, every setting a flag or a key of a YAML/TOML config file.

    agl train --agent my_agent:agent --train train.jsonl --val val.jsonl --config run.yaml --steps 20

The flags (and the config file's keys, :mod:`agl.cli.config_file`) are generated from the typed
configs' fields with their help (:mod:`agl.cli.config_args`): :class:`agl.run.Serving`,
:class:`agl.config.LoopConfig`, :class:`agl.config.RolloutConfig` (as ``rollout_timeout_s``,
``lease_s``, ``max_attempts``, the Trainer's keywords), :class:`agl.LightningRL` and the sampling
fields of :class:`agl.config.RunConfig`. A flag overrides the file; ``--print-config`` prints the
resolved settings, and the run directory keeps them as ``config.yaml``, which runs again unchanged.

The agent is imported as ``agl runner --agent`` imports it, and the integrations of the frameworks its
module imported are instrumented the same way. Tasks come from :func:`agl.task_files.load_tasks`
(JSONL, JSON, CSV, Parquet, a saved ``datasets`` dataset, a cached Hub dataset, ``module:attribute``);
every task is read and checked before anything starts, so a bad row fails with its file and line
and nothing is written. ``--dev N`` runs ``Trainer.dev`` on N held-out tasks instead of training.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from agl.algorithms.lightning_rl import LightningRL
from agl.cli._util import tokenizer_from_arg
from agl.cli.config_args import add_config_arguments, add_engine_arguments, config_from_args, engine_from_args
from agl.cli.config_file import add_config_file_arguments, format_config
from agl.config import LoopConfig, RolloutConfig, RunConfig
from agl.errors import UsageError
from agl.run.settings import BACKENDS, Serving

__all__ = ["register_cli"]

log = logging.getLogger("agl.train")

#: Serving's fields that are not flags: objects only Python can hand over (a loaded model or tokenizer
#: object stays a path here), and ``script``, which is read from a file or module (--script)
_SERVING_SKIP = ("script", "engine")
#: settings never written into the run directory's config.yaml (give them by environment variable)
_SECRETS = ("api_key", "gateway_api_key")
#: RolloutConfig's fields -> the Trainer keywords (and flags) they are known by
_ROLLOUT = {"timeout_s": "rollout_timeout_s", "lease_s": "lease_s", "max_attempts": "max_attempts"}


def register_cli(parser: argparse.ArgumentParser) -> None:
    """``agl train``'s flags: the command's own, then one group per typed config."""
    a = parser.add_argument_group("agent and tasks")
    a.add_argument("--agent", required=True, help="the agent's rollout function as module:function")
    a.add_argument(
        "--train",
        default=None,
        help="training tasks: a .jsonl/.json/.csv/.tsv/.parquet file, a saved datasets folder, a "
        "cached Hub dataset id, or module:attribute",
    )
    a.add_argument("--val", default=None, help="held-out tasks (the same forms as --train)")
    a.add_argument("--train-split", default=None, help="the split of a dataset with several (default: train)")
    a.add_argument("--val-split", default=None, help="the split of --val's dataset (default: its only one)")
    a.add_argument("--dataset-name", default=None, help="a Hub dataset's configuration name")
    a.add_argument(
        "--agents",
        default=None,
        help="comma-separated agent names whose LLM calls are trained (default: all)",
    )
    a.add_argument(
        "--dev",
        type=int,
        default=0,
        metavar="N",
        help="no training: run N held-out tasks (training tasks without --val) with Trainer.dev and print "
        "what each would train on",
    )
    a.add_argument(
        "--no-instrument",
        action="store_true",
        help="turn off: instrument the integrations of the frameworks the agent's module imports",
    )
    dests: dict[str, dict[str, str]] = {}
    s = parser.add_argument_group("serving: the model, the backend, where the run goes (agl.Serving)")
    dests["serving"] = add_config_arguments(
        s,
        Serving,
        skip=_SERVING_SKIP,
        overrides={
            "backend": {"choices": list(BACKENDS)},
            "model": {"help": "a local model folder (default: the embedded SmolLM2-135M-Instruct)"},
            "tokenizer": {"help": "a local tokenizer folder (default: the model's)"},
            "report_to": {"nargs": "+", "metavar": "TRACKER"},
            "gateway_api_key": {
                "help": "the gateway's bearer token (prefer $AGL_GATEWAY_API_KEY: a flag shows in ps)"
            },
        },
    )
    s.add_argument(
        "--script",
        default=None,
        help="scripted backend (a dry run without a model's replies): a .json/.jsonl file of replies, "
        "or module:function taking the request",
    )
    e = parser.add_argument_group("engine: the embedded transformers engine (agl.engine.EngineSettings)")
    dests["engine"] = add_engine_arguments(e)
    lp = parser.add_argument_group("loop: steps, held-out checks, checkpoints (agl.LoopConfig)")
    dests["loop"] = add_config_arguments(lp, LoopConfig)
    dests["rollout"] = add_config_arguments(
        lp,
        RolloutConfig,
        overrides={name: {"flags": ["--" + flag.replace("_", "-")]} for name, flag in _ROLLOUT.items()},
    )
    al = parser.add_argument_group("algorithm: credit, advantages, the policy update (agl.LightningRL)")
    dests["algorithm"] = add_config_arguments(al, LightningRL)
    sm = parser.add_argument_group("sampling: what the agents' model calls use (agl.RunConfig)")
    add_config_arguments(sm, RunConfig, only=["temperature", "top_p", "max_tokens"])
    add_config_file_arguments(parser)
    parser.set_defaults(func=lambda args: _cli(args, parser, dests))


def _cli(args: argparse.Namespace, parser: argparse.ArgumentParser, dests: dict[str, dict[str, str]]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    train, val = _tasks(args)  # every task read and checked before anything starts
    agent = _agent(args)
    trainer = _trainer(args, dests)
    if args.threads:  # the trainer's threads too: it shares the process with the engine
        import torch

        torch.set_num_threads(args.threads)
    if args.dev:
        trainer.dev(agent, (val or train)[: args.dev])
        return 0
    if not train:
        raise UsageError("agl train needs --train (training tasks), or --dev N to only look")
    trainer.config.check_trainable()  # fit() would refuse these too, after the run directory exists
    if trainer.serving.backend == "openai":
        raise UsageError("--backend openai serves a hosted model agl cannot update: use it with --dev N")
    run_dir = Path(trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(format_config(parser, args, secrets=_SECRETS))
    summary = trainer.fit(agent, train, val or None)
    summary.pop("history", None)
    print(json.dumps(summary, indent=2))
    return 0


def _tasks(args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    from agl.task_files import load_tasks
    from agl.types import as_tasks

    train = load_tasks(args.train, split=args.train_split, name=args.dataset_name) if args.train else []
    val = load_tasks(args.val, split=args.val_split, name=args.dataset_name) if args.val else []
    if not train and not (args.dev and val):
        raise UsageError("agl train needs --train (training tasks), or --dev N with --val to only look")
    return as_tasks(train, "train"), as_tasks(val, "val")


def _agent(args: argparse.Namespace) -> Any:
    from agl.runner.runner import instrument_imported_frameworks, load_agent

    agent = load_agent(args.agent)
    if not args.no_instrument and args.runners > 0:  # as `agl runner` does for the agents it runs
        names = instrument_imported_frameworks()
        log.info("agl train: instrumented %s", ", ".join(names) or "nothing (no framework imported)")
    return agent


def _script(spec: str | None) -> Any:
    """``--script``: replies from a JSON array or JSONL file, or a ``module:function`` of the request."""
    if spec is None:
        return None
    path = Path(spec)
    if path.is_file():
        if path.suffix.lower() == ".json":
            try:
                replies = json.loads(path.read_text(encoding="utf-8"))
            except ValueError as exc:
                raise UsageError(f"--script {path} is not JSON: {exc}") from None
            if not isinstance(replies, list) or not replies:
                raise UsageError(f"--script {path} must hold a non-empty array of replies")
            return replies
        from agl.task_files import load_tasks

        return load_tasks(path)  # JSONL: one reply per line, each line checked with its number
    if ":" in spec:
        from agl.task_files import import_object

        return import_object(spec, "--script")
    raise FileNotFoundError(f"--script {spec}: no such file (or give module:function)")


def _trainer(args: argparse.Namespace, dests: dict[str, dict[str, str]]) -> Any:
    """The Trainer the settings describe; each typed config validates its own fields."""
    from agl.trainer.trainer import Trainer

    for name in ("model", "tokenizer"):
        value = getattr(args, name)
        if value is not None and not Path(value).exists():
            raise FileNotFoundError(f"--{name} {value}: no such local folder")
    tokenizer = tokenizer_from_arg(args.tokenizer) if args.tokenizer else None
    engine = engine_from_args(args, dests["engine"], process_threads=True)
    serving = config_from_args(
        Serving, args, dests["serving"], script=_script(args.script), tokenizer=tokenizer, engine=engine
    )
    loop = config_from_args(LoopConfig, args, dests["loop"])
    rollout = config_from_args(RolloutConfig, args, dests["rollout"])
    algorithm = config_from_args(LightningRL, args, dests["algorithm"])
    sampling = RunConfig(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    agents = [a.strip() for a in args.agents.split(",") if a.strip()] if args.agents else None
    try:
        return Trainer(algorithm, serving=serving, loop=loop, rollout=rollout, config=sampling, agents=agents)
    except ValueError as exc:  # the Trainer's own checks of the settings: the user's to fix
        if isinstance(exc, UsageError):
            raise
        raise UsageError(str(exc)) from None
