"""``agl store serve``: run the store server (DESIGN §5).

Imports stay inside the command function so ``agl --help`` and ``agl store --help`` load nothing heavy,
and the server answers its first request quickly after start.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

__all__ = ["register_cli"]

TOKEN_ENV = "AGL_STORE_TOKEN"


def register_cli(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="store_command", metavar="SUBCOMMAND")
    serve = sub.add_parser(
        "serve",
        help="serve a store over HTTP (+ OTLP/HTTP at /v1/traces)",
        description="Serve a store over HTTP/JSON, with OTLP/HTTP trace ingestion at /v1/traces. "
        "Binds 127.0.0.1 unless told otherwise; any other address needs a token.",
    )
    where = serve.add_mutually_exclusive_group()
    where.add_argument("--db", metavar="PATH", default=None, help="SQLite database file (default: agl.db)")
    where.add_argument(
        "--store", metavar="URL", default=None, help="store URL instead: memory:// or sqlite:///path.db"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=4747, help="port (default: 4747; 0 picks a free one)")
    serve.add_argument(
        "--token",
        default=None,
        help=f"bearer token every request but /health must carry (default: ${TOKEN_ENV})",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        metavar="N",
        help="largest request body accepted; larger ones get 413 (default: 32 MiB)",
    )
    serve.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )
    serve.set_defaults(func=_serve)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _open(args: argparse.Namespace) -> Any:
    """The store to serve."""
    from agl.store import open as open_store

    return open_store(args.store or f"sqlite:///{Path(args.db or 'agl.db')}")


def _serve(args: argparse.Namespace) -> int:
    # pydantic scans every installed distribution for plugins when it builds its first model; a store
    # server has no use for them and answers sooner without the scan (set the variable to override).
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    from agl.store.server import DEFAULT_MAX_BODY_BYTES, is_loopback, serve

    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    if not token and not is_loopback(args.host):
        raise ValueError(
            f"refusing to listen on {args.host!r} without a token: anyone who can reach it could read and "
            f"change the store. Pass --token or set {TOKEN_ENV}, or bind 127.0.0.1"
        )
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0-65535, got {args.port}")
    from agl.cli import check_port_free

    check_port_free(args.host, args.port)
    max_body = args.max_body_bytes if args.max_body_bytes is not None else DEFAULT_MAX_BODY_BYTES
    if max_body <= 0:
        raise ValueError(f"--max-body-bytes must be positive, got {max_body}")
    store = _open(args)
    serve(
        store,
        host=args.host,
        port=args.port,
        token=token,
        max_body_bytes=max_body,
        log_level=args.log_level,
    )
    return 0
