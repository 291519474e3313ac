"""The ``agl`` command: the dispatcher of the CLI floor.

Each top-level command is one thin module of this package (``agl.cli.store``, ``agl.cli.gateway``, ...)
over library code that never imports argparse. A command module is imported only when its command
runs, so ``agl --help`` stays fast and never imports torch or a framework. It exposes
``register_cli(parser: argparse.ArgumentParser) -> None``: it adds its own arguments (or sub-commands)
and sets ``func=callable(args) -> int | None`` with ``parser.set_defaults``. Shared helpers live in
:mod:`agl.cli._util`.

A command that trains (``train``, ``sft``, ``apo``) also takes ``--config FILE`` (YAML or TOML, keyed by
its flags' names; a flag overrides the file) and ``--print-config``: :mod:`agl.cli.config_file`, which
:func:`main` applies before parsing.

Errors: an :class:`agl.errors.AglError` (a ``UsageError`` for a user's mistake, a ``StoreError``, ...),
a missing file the user named (``FileNotFoundError``) or a refused permission (``PermissionError``)
prints as one line, ``agl CMD: error: ...``, exit status 2; a missing optional module names the extra
to install. Anything else — a bare ``KeyError`` or ``ValueError`` from agl's own code — is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from agl.cli._util import EXTRAS, check_port_free, missing_module_message, read_secret
from agl.errors import AglError

__all__ = [
    "COMMANDS",
    "EXTRAS",
    "build_parser",
    "check_port_free",
    "main",
    "missing_module_message",
    "read_secret",
]

#: command -> (module that owns it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "store": ("agl.cli.store", "serve a store over HTTP (agl store serve)"),
    "rollouts": ("agl.cli.inspect", "list rollouts or show one (attempts, status, error)"),
    "spans": ("agl.cli.inspect", "print the span tree of a rollout"),
    "transitions": ("agl.cli.export", "print the transitions a rollout would train on"),
    "export": ("agl.cli.export", "export transitions, SFT or DPO data as JSONL"),
    "diff": ("agl.cli.diff", "compare two runs call by call: where they first part, and why"),
    "train": ("agl.cli.train", "train an agent with LightningRL: agent module, task files, a config file"),
    "sft": ("agl.cli.sft", "supervised warm start on demonstrations from a store (agl.SFT)"),
    "judge": ("agl.cli.judge", "score a store's rollouts with an LLM judge; calls recorded beside them"),
    "gateway": ("agl.cli.gateway", "serve the OpenAI-compatible gateway (agl gateway serve)"),
    "models": ("agl.cli.models", "prepare the embedded default model (agl models prepare)"),
    "vllm": ("agl.cli.vllm", "start a vLLM server set up for training through agl (agl vllm serve)"),
    "runner": ("agl.cli.runner", "run an agent against a store: claim rollouts, run them, report"),
    "apo": ("agl.cli.apo", "optimise an agent's prompts with any LLM (automatic prompt optimisation)"),
    "plot": ("agl.cli.plot", "plot the reward curve of a training or APO run"),
    "dashboard": ("agl.cli.dashboard", "open the dashboard: runs, rollouts, span trees, transitions"),
    "doctor": ("agl.cli.doctor", "installed frameworks, instrumented integrations, their hooks, the tracer"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agl", description="agl: train existing LLM agents with RL.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).register_cli(p)
    return parser


def _command_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    """The sub-parser of ``command`` (None when no command was named)."""
    if command is None:
        return None
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    if command is not None and command not in COMMANDS:
        print(f"agl: unknown command {command!r}; try: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    parser = build_parser(command)
    sub = _command_parser(parser, command)
    try:
        if sub is not None and "--config" in sub._option_string_actions:
            from agl.cli.config_file import apply_config_file

            apply_config_file(sub, args_list)  # the file's settings become defaults; flags win
    except (AglError, FileNotFoundError) as exc:
        print(f"agl {command}: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(args_list)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0 if command is None else 2
    if getattr(args, "print_config", False) and sub is not None:
        from agl.cli.config_file import format_config

        print(format_config(sub, args), end="")
        return 0
    try:
        rc = func(args)
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:
        print(f"agl {command}: error: {missing_module_message(exc)}", file=sys.stderr)
        return 2
    except (AglError, FileNotFoundError, PermissionError) as exc:
        print(f"agl {command}: error: {exc}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
