"""The ``agl`` command.

Each top-level command lives in the module that owns the concept and is imported only when used, so
``agl --help`` stays fast and never imports torch or a framework. A command module exposes
``register_cli(parser: argparse.ArgumentParser) -> None``: it adds its own arguments (or sub-commands)
and sets ``func=callable(args) -> int | None`` with ``parser.set_defaults``.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import socket
import sys
from collections.abc import Sequence

from agl.store.base import StoreError

#: a missing optional module -> the extra that installs it
EXTRAS: dict[str, str] = {
    "torch": "train",
    "transformers": "train",
    "trl": "train",
    "peft": "train",
    "datasets": "train",
    "accelerate": "train",
    "matplotlib": "train",
    "tensorboard": "train",
    "gguf": "train",
    "openai": "openai",
    "psycopg": "postgres",
    "psycopg_pool": "postgres",
}

#: command -> (module that owns it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "store": ("agl.store.cli", "serve a store over HTTP (agl store serve)"),
    "rollouts": ("agl.inspect", "list rollouts or show one (attempts, status, error)"),
    "spans": ("agl.inspect", "print the span tree of a rollout"),
    "transitions": ("agl.export", "print the transitions a rollout would train on"),
    "export": ("agl.export", "export transitions, SFT or DPO data as JSONL"),
    "sft": ("agl.algorithms.sft", "supervised warm start on demonstrations from a store (agl.SFT)"),
    "gateway": ("agl.gateway.cli", "serve the OpenAI-compatible gateway (agl gateway serve)"),
    "models": ("agl.gateway.models", "prepare the embedded default model (agl models prepare)"),
    "runner": ("agl.runner", "run an agent against a store: claim rollouts, run them, report"),
    "apo": ("agl.algorithms.apo", "optimise an agent's prompts with any LLM (automatic prompt optimisation)"),
    "plot": ("agl.plot", "plot the reward curve of a training or APO run"),
    "dashboard": ("agl.dashboard.cli", "open the dashboard: runs, rollouts, span trees, transitions"),
    "doctor": ("agl.doctor", "installed frameworks, instrumented integrations, their hooks, the tracer"),
}


def check_port_free(host: str, port: int) -> None:
    """Refuse a busy port with one line before a server announces itself (uvicorn would log a bind
    error after the banner). Port 0 (any free port) always passes."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ValueError(
                    f"port {port} on {host} is already in use; pick another with --port (0 picks a free one)"
                ) from None
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def read_secret(value: str | None, path: str | None, env: str, what: str) -> str | None:
    """A server's secret from ``--X`` (``value``), ``--X-file`` (``path``, first line) or ``$env``, in
    that order; None when none is set.

    The file and the variable keep the secret out of the process list, where ``--X VALUE`` shows it
    to every user of the machine (``ps``); the flag stays for quick local use.
    """
    import os

    if value is not None and path is not None:
        raise ValueError(f"give the {what} once: by value or by file, not both")
    if path is not None:
        try:
            text = open(path, encoding="utf-8").read()  # noqa: SIM115 - read once, closed by GC
        except OSError as exc:
            raise ValueError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from None
        secret = text.strip().splitlines()[0].strip() if text.strip() else ""
        if not secret:
            raise ValueError(f"the {what} file {path} is empty")
        return secret
    if value is not None:
        if not value.strip():
            raise ValueError(f"the {what} is empty")
        return value
    return os.environ.get(env) or None


def missing_module_message(exc: ModuleNotFoundError) -> str:
    """One line naming the extra to install for a missing optional dependency."""
    name = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(name)
    if extra is None:
        return f"missing module {name!r}: {exc}"
    return f"this needs {name}, which is not installed: pip install 'agl[{extra}]'"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agl", description="agl: train existing LLM agents with RL.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).register_cli(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    if command is not None and command not in COMMANDS:
        print(f"agl: unknown command {command!r}; try: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    parser = build_parser(command)
    args = parser.parse_args(args_list)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0 if command is None else 2
    try:
        rc = func(args)
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:
        print(f"agl {command}: error: {missing_module_message(exc)}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, FileNotFoundError, StoreError) as exc:
        print(f"agl {command}: error: {exc}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
