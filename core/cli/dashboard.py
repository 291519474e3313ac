"""``agl dashboard --store URL [--run-dir DIR] [--compare RUN]``: serve the dashboard (:mod:`agl.dashboard`)
for a store (and a trainer run; and a second run each rollout is compared with, as ``agl diff`` does).

Imports stay inside the command function so ``agl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import webbrowser
from typing import Any

from agl.cli._util import (
    STORE_TOKEN_ENV,
    add_store_args,
    check_port,
    open_store_from_args,
    store_token,
    store_url,
    tokenizer_from_arg,
)
from agl.errors import UsageError

__all__ = ["register_cli", "serve_dashboard"]


def register_cli(parser: argparse.ArgumentParser) -> None:
    add_store_args(
        parser,
        token_help=f"bearer token: sent to an http store, and required from browsers (default: ${STORE_TOKEN_ENV})",
    )
    parser.add_argument(
        "--run-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="trainer run directory with metrics.jsonl for the Runs page (repeat for several)",
    )
    parser.add_argument(
        "--compare",
        default=None,
        metavar="RUN",
        help="a second run (run directory, store file or store URL): each rollout page shows where the "
        "rollout at the same place in RUN first differs, as agl diff does",
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
    compare: Any = None,
) -> None:
    """Serve until SIGINT/SIGTERM; prints ``agl dashboard: serving http://host:port/`` once listening.
    ``compare``: a run (:func:`agl.reports.diff.open_run`) to compare rollouts with; its store is closed
    when the server stops."""
    import uvicorn

    from agl.dashboard.app import create_dashboard_app
    from agl.store.server import _bind, is_loopback

    if not token and not is_loopback(host):
        raise UsageError(
            f"refusing to listen on {host!r} without a token: the dashboard shows prompts and can cancel "
            f"rollouts. Pass --token or set {STORE_TOKEN_ENV}, or bind 127.0.0.1"
        )
    app = create_dashboard_app(
        store,
        token=token,
        run_dirs=list(run_dirs or []),
        tokenizer=tokenizer,
        store_label=store_label,
        compare=compare,
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
    token = store_token(args)
    tokenizer = None if args.tokenizer in ("none", "") else tokenizer_from_arg(args.tokenizer)
    compare = None
    if args.compare is not None:
        from agl.reports.diff import open_run

        compare = open_run(args.compare)
    try:
        store = open_store_from_args(args)
    except BaseException:
        if compare is not None:
            compare.store.close()
        raise
    try:
        serve_dashboard(
            store,
            host=args.host,
            port=args.port,
            token=token,
            run_dirs=args.run_dir,
            tokenizer=tokenizer,
            store_label=store_url(args),
            open_browser=args.open,
            compare=compare,
        )
    finally:
        store.close()
        if compare is not None:
            compare.store.close()  # closing twice is harmless; the app closes it too
    return 0
