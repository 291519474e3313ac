"""``agl store serve``: run the store server (DESIGN §5).

Imports stay inside the command function so ``agl --help`` and ``agl store --help`` load nothing heavy,
and the server answers its first request quickly after start.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from agl.cli._util import check_port, check_port_free, read_secret
from agl.errors import UsageError
from agl.http_limits import HttpLimits
from agl.store.base import STORE_TOKEN_ENV

__all__ = ["register_cli"]

TOKEN_ENV = STORE_TOKEN_ENV


def register_cli(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="store_command", metavar="SUBCOMMAND")
    serve = sub.add_parser(
        "serve",
        help="serve a store over HTTP (+ OTLP/HTTP at /v1/traces)",
        description="Serve a store over HTTP/JSON, with OTLP/HTTP trace ingestion at /v1/traces. "
        "Binds 127.0.0.1 unless told otherwise; any other address needs a token "
        f"(${TOKEN_ENV} or --token-file).",
    )
    where = serve.add_mutually_exclusive_group()
    where.add_argument(
        "--db",
        metavar="PATH|URL",
        default=None,
        help="SQLite database file (default: agl.db), or postgresql://user@host/db: any number of servers "
        "may serve one PostgreSQL database",
    )
    where.add_argument(
        "--store",
        metavar="URL",
        default=None,
        help="store URL instead: memory://, sqlite:///path.db or postgresql://...",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=4747, help="port (default: 4747; 0 picks a free one)")
    token = serve.add_mutually_exclusive_group()
    token.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="file holding the bearer token every request but /health must carry (its first line)",
    )
    token.add_argument(
        "--token",
        default=None,
        help=f"the bearer token itself; prefer ${TOKEN_ENV} or --token-file: a value given here is "
        "visible to every user of the machine in the process list (default: $" + TOKEN_ENV + ")",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        metavar="N",
        help="largest request body accepted; larger ones get 413 (default: 32 MiB)",
    )
    HttpLimits.add_arguments(serve)
    serve.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )
    serve.set_defaults(func=_serve)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _open(args: argparse.Namespace) -> Any:
    """The store to serve."""
    from agl.store import open as open_store

    db = args.db or "agl.db"
    return open_store(
        args.store or (db if db.startswith(("postgresql://", "postgres://")) else f"sqlite:///{Path(db)}")
    )


def _serve(args: argparse.Namespace) -> int:
    # pydantic scans every installed distribution for plugins when it builds its first model; a store
    # server has no use for them and answers sooner without the scan (set the variable to override).
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    from agl.store.server import DEFAULT_MAX_BODY_BYTES, is_loopback, serve

    token = read_secret(args.token, args.token_file, TOKEN_ENV, "store token")
    if not token and not is_loopback(args.host):
        raise UsageError(
            f"refusing to listen on {args.host!r} without a token: anyone who can reach it could read and "
            f"change the store. Set {TOKEN_ENV} or pass --token-file, or bind 127.0.0.1"
        )
    limits = HttpLimits.from_args(args)
    check_port(args.port)
    check_port_free(args.host, args.port)
    max_body = args.max_body_bytes if args.max_body_bytes is not None else DEFAULT_MAX_BODY_BYTES
    if max_body <= 0:
        raise UsageError(f"--max-body-bytes must be positive, got {max_body}")
    from agl.dashboard.mount import ui_mounts

    store = _open(args)
    serve(
        store,
        mounts=ui_mounts(store),  # the dashboard at /ui
        host=args.host,
        port=args.port,
        token=token,
        max_body_bytes=max_body,
        log_level=args.log_level,
        limits=limits,
    )
    return 0
