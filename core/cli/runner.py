"""``agl runner``: run an agent against a store — claim rollouts, run them, report (DESIGN §7).

A thin layer over :class:`agl.runner.runner.Runner`: the flags become its arguments; the library never
imports argparse.
"""

from __future__ import annotations

import argparse
import contextlib
import logging

from agl.cli._util import add_store_args, open_store_from_args, store_url
from agl.errors import UsageError
from agl.runner.runner import Runner, instrument_imported_frameworks, load_agent

__all__ = ["register_cli"]

log = logging.getLogger("agl.runner")


def register_cli(parser: argparse.ArgumentParser) -> None:
    add_store_args(parser, what="store to claim rollouts from")
    parser.add_argument("--agent", required=True, help="the agent function as module:function")
    parser.add_argument("--concurrency", type=int, default=1, help="rollouts run at once (default 1)")
    parser.add_argument(
        "--worker-id", default=None, help="name of this runner in attempts (default host-pid)"
    )
    parser.add_argument("--max-rollouts", type=int, default=None, help="exit after this many rollouts")
    parser.add_argument("--timeout-s", type=float, default=None, help="per-rollout timeout in seconds")
    parser.add_argument(
        "--mode", action="append", choices=["train", "val", "test"], help="only claim these modes"
    )
    parser.add_argument(
        "--max-hung",
        type=int,
        default=None,
        metavar="N",
        help="stop claiming while N sync agents still run after their rollouts timed out (Python cannot "
        "stop a thread; default: max(4, concurrency))",
    )
    parser.add_argument("--until-idle", action="store_true", help="exit when no work arrives for a while")
    parser.add_argument("--idle-s", type=float, default=5.0, help="long-poll wait per claim (default 5 s)")
    parser.add_argument(
        "--no-instrument",
        action="store_true",
        help="do not instrument the integrations of the frameworks the agent's module imports",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="log every store request (INFO)")
    parser.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:

    if args.concurrency < 1:
        raise UsageError("--concurrency must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.verbose:  # one line per HTTP request drowns the runner's own messages
        for noisy in ("httpx", "httpcore"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    agent = load_agent(args.agent)
    if not args.no_instrument:
        names = instrument_imported_frameworks()
        log.info("agl runner: instrumented %s", ", ".join(names) or "nothing (no framework imported)")
    store = open_store_from_args(args)
    runner = Runner(
        agent,
        store,
        concurrency=args.concurrency,
        worker_id=args.worker_id,
        timeout_s=args.timeout_s,
        modes=args.mode,
        claim_timeout_s=args.idle_s,
        max_hung=args.max_hung,
    )
    log.info(
        "agl runner %s: %s on %s, concurrency %d",
        runner.worker_id,
        agent.name,
        store_url(args),
        args.concurrency,
    )
    try:
        stats = runner.run(max_rollouts=args.max_rollouts, until_idle=args.until_idle)
    finally:
        with contextlib.suppress(Exception):
            from agl.tracing.provider import flush

            flush(10.0)
        with contextlib.suppress(Exception):
            store.close()
    print(stats.as_dict())
    return 0
