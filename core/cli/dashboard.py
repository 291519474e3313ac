"""``agl dashboard --store URL [--run-dir DIR]``: serve the dashboard (:mod:`agl.dashboard`) for a store
(and a trainer run).

Imports stay inside the command function so ``agl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import webbrowser
from typing import Any

from agl.cli._util import check_port, tokenizer_from_arg
from agl.errors import UsageError

__all__ = ["register_cli", "serve_dashboard"]

TOKEN_ENV = "AGL_STORE_TOKEN"
STORE_ENV = "AGL_STORE"


def register_cli(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help=f"store URL: http://host:port, sqlite:///path.db (default: ${STORE_ENV} or sqlite:///agl.db)",
    )
    parser.add_argument(
        "--run-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="trainer run directory with metrics.jsonl for the Runs page (repeat for several)",
    )
    parser.add_argument(
        "--token",
        default=None,
        help=f"bearer token: sent to an http store, and required from browsers (default: ${TOKEN_ENV})",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=4748, help="port (default: 4748; 0 picks a free one)")
    parser.add_argument(
        "--tokenizer",
        default="default",
        help="decode token ids with this tokenizer: 'default' (shipped SmolLM2), a local HF directory, "
        "or 'none' to show ids",
    )
    parser.add_argument("--open", action="store_true", help="open the page in a web browser")
    parser.set_defaults(func=_cmd)


def _open_store(url: str, token: str | None) -> Any:
    import agl.store

    if url.startswith("sqlite:"):
        rest = url.split("://", 1)[1]
        path = rest[1:] if rest.startswith("/") else rest
        if not os.path.exists(path):
            raise FileNotFoundError(f"no store at {path!r}; pass --store URL or set {STORE_ENV}")
    if url.startswith(("http://", "https://")):
        return agl.store.open(url, token=token, retry_timeout_s=5.0)
    return agl.store.open(url)


def serve_dashboard(
    store: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 4748,
    token: str | None = None,
    run_dirs: list[str] | None = None,
    tokenizer: Any = None,
    store_label: str = "",
    open_browser: bool = False,
) -> None:
    """Serve until SIGINT/SIGTERM; prints ``agl dashboard: serving http://host:port/`` once listening."""
    import uvicorn

    from agl.dashboard.app import create_dashboard_app
    from agl.store.server import _bind, is_loopback

    if not token and not is_loopback(host):
        raise UsageError(
            f"refusing to listen on {host!r} without a token: the dashboard shows prompts and can cancel "
            f"rollouts. Pass --token or set {TOKEN_ENV}, or bind 127.0.0.1"
        )
    app = create_dashboard_app(
        store, token=token, run_dirs=list(run_dirs or []), tokenizer=tokenizer, store_label=store_label
    )
    sock = _bind(host, port)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}/"

    class _Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(f"agl dashboard: serving {url}", flush=True)
                if open_browser:
                    webbrowser.open(url)

    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=2
    )
    try:
        _Server(config).run(sockets=[sock])
    finally:
        sock.close()


def _cmd(args: argparse.Namespace) -> int:
    check_port(args.port)
    for d in args.run_dir:
        if not os.path.isdir(d):
            raise FileNotFoundError(f"--run-dir {d!r} is not a directory")
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    url = args.store or os.environ.get(STORE_ENV) or "sqlite:///agl.db"
    tokenizer = None if args.tokenizer in ("none", "") else tokenizer_from_arg(args.tokenizer)
    store = _open_store(url, token)
    try:
        serve_dashboard(
            store,
            host=args.host,
            port=args.port,
            token=token,
            run_dirs=args.run_dir,
            tokenizer=tokenizer,
            store_label=url,
            open_browser=args.open,
        )
    finally:
        store.close()
    return 0
