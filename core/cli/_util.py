"""Helpers the ``agl`` commands share: secrets, ports, store flags, the missing-extra message.

Only command modules import this; library code never does (REDESIGN §5.6).
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
from typing import Any

from agl.errors import UsageError
from agl.store.base import DEFAULT_STORE, STORE_ENV, STORE_TOKEN_ENV

__all__ = [
    "DEFAULT_STORE",
    "EXTRAS",
    "STORE_ENV",
    "STORE_TOKEN_ENV",
    "add_store_args",
    "check_port",
    "check_port_free",
    "missing_module_message",
    "open_store_from_args",
    "read_secret",
    "store_token",
    "store_url",
    "tokenizer_from_arg",
]


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
    "pyarrow": "train",
    "trackio": "trackio",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "sqlalchemy": "mlflow",
    "alembic": "mlflow",
    "psycopg": "postgres",
    "psycopg_pool": "postgres",
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
                raise UsageError(
                    f"port {port} on {host} is already in use; pick another with --port (0 picks a free one)"
                ) from None
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def read_secret(value: str | None, path: str | None, env: str, what: str) -> str | None:
    """A server's secret from ``--X`` (``value``), ``--X-file`` (``path``, first line) or ``$env``, in
    that order; None when none is set.

    The file and the variable keep the secret out of the process list, where ``--X VALUE`` shows it
    to every user of the machine (``ps``); the flag stays for quick local use.
    """
    if value is not None and path is not None:
        raise UsageError(f"give the {what} once: by value or by file, not both")
    if path is not None:
        try:
            text = open(path, encoding="utf-8").read()  # noqa: SIM115 - read once, closed by GC
        except OSError as exc:
            raise UsageError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from None
        secret = text.strip().splitlines()[0].strip() if text.strip() else ""
        if not secret:
            raise UsageError(f"the {what} file {path} is empty")
        return secret
    if value is not None:
        if not value.strip():
            raise UsageError(f"the {what} is empty")
        return value
    return os.environ.get(env) or None


def missing_module_message(exc: ModuleNotFoundError) -> str:
    """One line naming the extra to install for a missing optional dependency."""
    name = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(name)
    if extra is None:
        return f"missing module {name!r}: {exc}"
    return f"this needs {name}, which is not installed: pip install 'agl[{extra}]'"


def check_port(port: int) -> None:
    """A port a user gave is 0-65535."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be 0-65535, got {port}")


def add_store_args(
    p: argparse.ArgumentParser, *, json: bool = False, token_help: str | None = None, what: str = "store"
) -> None:
    """``--store URL`` (default ``$AGL_STORE``, then ``sqlite:///agl.db``) and ``--token`` (default
    ``$AGL_STORE_TOKEN``): the store flags of every ``agl`` command, read back with :func:`store_url`,
    :func:`store_token` and :func:`open_store_from_args`. ``json`` adds ``--json``."""
    p.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help=f"the {what}: sqlite:///path.db, http://host:port, postgresql://..., memory:// "
        f"(default: ${STORE_ENV}, else {DEFAULT_STORE})",
    )
    p.add_argument(
        "--token",
        default=None,
        help=token_help
        or f"bearer token of an http store (prefer ${STORE_TOKEN_ENV}: a --token is visible in ps)",
    )
    if json:
        p.add_argument("--json", action="store_true", help="print JSON records instead of text")


def store_url(args: argparse.Namespace) -> str:
    """The store ``--store`` names, else ``$AGL_STORE``, else the default store."""
    return args.store or os.environ.get(STORE_ENV) or DEFAULT_STORE


def store_token(args: argparse.Namespace) -> str | None:
    """``--token``, else ``$AGL_STORE_TOKEN``, else none."""
    token = getattr(args, "token", None)
    return token if token is not None else os.environ.get(STORE_TOKEN_ENV) or None


def open_store_from_args(args: argparse.Namespace, *, must_exist: bool = True) -> Any:
    """The store of :func:`store_url`, opened. With ``must_exist`` a SQLite file that does not exist
    is refused rather than created empty (a typo would otherwise read as an empty store); an http
    store gets the token and a short retry window, so an unreachable server fails in seconds."""
    import agl.store

    url = store_url(args)
    if must_exist and url.startswith("sqlite:"):
        rest = url.split("://", 1)[1]
        path = rest[1:] if rest.startswith("/") else rest
        if not os.path.exists(path):  # opening would create an empty store: say what is wrong instead
            raise FileNotFoundError(f"no store at {path!r}; pass --store URL or set {STORE_ENV}")
    if url.startswith(("http://", "https://")):
        return agl.store.open(url, token=store_token(args), retry_timeout_s=5.0)
    return agl.store.open(url)


def tokenizer_from_arg(spec: str) -> Any:
    """The tokenizer ``--tokenizer`` names (:func:`agl.chat.tokenizer.load_tokenizer`, strict); its refusal — a missing
    ``transformers``, a directory that holds no tokenizer — is the user's to fix, so one line."""
    from agl.chat.tokenizer import load_tokenizer

    try:
        return load_tokenizer(spec, strict=True)
    except UsageError as exc:
        raise UsageError(f"--tokenizer {spec}: {exc}") from None
