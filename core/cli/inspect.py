"""``agl rollouts list|show`` and ``agl spans ROLLOUT_ID``: look into a store as a person would.

Works on any store URL (``--store``, else ``$AGL_STORE``, else ``sqlite:///agl.db``), so the same
commands read a local run or a remote ``agl store serve``. ``--json`` prints the records instead.
The text comes from :mod:`agl.reports.inspect`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from agl.cli._util import add_store_args, open_store_from_args
from agl.errors import UsageError
from agl.reports.inspect import (
    attempt_kinds_of,
    failure_kind_of,
    final_reward_of,
    format_rollout,
    format_rollouts,
    format_span_tree,
    with_span_errors,
)

__all__ = ["register_cli"]


def register_cli(parser: argparse.ArgumentParser) -> None:
    command = parser.prog.split()[-1]
    if command == "spans":
        add_store_args(parser, json=True)
        parser.add_argument("rollout_id", metavar="ROLLOUT_ID")
        parser.add_argument("--attempt", type=int, default=None, help="attempt number (default: the latest)")
        parser.add_argument("--all-attempts", action="store_true", help="every attempt, one tree each")
        parser.add_argument("--no-stale", action="store_true", help="hide spans of attempts that were lost")
        parser.add_argument("--width", type=int, default=100, help="longest line before details are cut")
        parser.set_defaults(func=_cmd_spans)
        return
    sub = parser.add_subparsers(dest="rollouts_command", metavar="SUBCOMMAND")
    ls = sub.add_parser("list", help="rollouts, oldest first, with status and attempts")
    add_store_args(ls, json=True)
    ls.add_argument("--status", action="append", help="only this status (repeat for several)")
    ls.add_argument("--mode", choices=["train", "val", "test"])
    ls.add_argument("--group", dest="group_id", help="only this group id")
    ls.add_argument("--limit", type=int, default=None, help="at most this many (the newest ones)")
    ls.set_defaults(func=_cmd_list)
    show = sub.add_parser("show", help="one rollout: its attempts, status, errors")
    add_store_args(show, json=True)
    show.add_argument("rollout_id", metavar="ID")
    show.add_argument("--traceback", action="store_true", help="print each failed attempt's traceback")
    show.set_defaults(func=_cmd_show)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _run(args: argparse.Namespace, body: Any) -> int:
    from agl.store.base import StoreError

    store = open_store_from_args(args)
    try:
        body(store, sys.stdout)
    except StoreError as exc:
        print(f"agl: error: {exc}", file=sys.stderr)
        return 2
    finally:
        store.close()
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 0:
        raise UsageError(f"--limit must be >= 0, got {args.limit}")

    def body(store: Any, out: TextIO) -> None:
        rollouts = store.query_rollouts(status=args.status, mode=args.mode, group_id=args.group_id)
        if args.limit is not None:
            rollouts = rollouts[len(rollouts) - args.limit :] if args.limit else []
        rollouts = [with_span_errors(store, r) for r in rollouts]
        if args.json:
            out.write(json.dumps([r.model_dump(mode="json") for r in rollouts], indent=2) + "\n")
        else:
            rewards = {r.id: final_reward_of(store, r) for r in rollouts}
            kinds = {r.id: failure_kind_of(store, r) for r in rollouts}
            out.write(format_rollouts(rollouts, rewards, kinds) + "\n")

    return _run(args, body)


def _cmd_show(args: argparse.Namespace) -> int:
    def body(store: Any, out: TextIO) -> None:
        rollout = with_span_errors(store, store.get_rollout(args.rollout_id))
        counts = {}
        for a in rollout.attempts:
            counts[a.number] = len(store.query_spans(rollout_id=rollout.id, attempt=a.number))
        if args.json:
            out.write(json.dumps(rollout.model_dump(mode="json"), indent=2) + "\n")
        else:
            kinds = attempt_kinds_of(store, rollout)
            out.write(
                format_rollout(rollout, span_counts=counts, tracebacks=args.traceback, kinds=kinds) + "\n"
            )

    return _run(args, body)


def _cmd_spans(args: argparse.Namespace) -> int:
    def body(store: Any, out: TextIO) -> None:
        rollout = store.get_rollout(args.rollout_id)
        if args.all_attempts:
            numbers = [a.number for a in rollout.attempts]
        elif args.attempt is not None:
            numbers = [args.attempt]
        else:
            numbers = [rollout.attempts[-1].number] if rollout.attempts else []
        if not numbers:
            out.write(f"rollout {rollout.id} is {rollout.status} and has no attempts yet\n")
            return
        records = []
        for n in numbers:
            spans = store.query_spans(rollout_id=rollout.id, attempt=n, include_stale=not args.no_stale)
            if args.json:
                records.extend(s.model_dump(mode="json") for s in spans)
                continue
            attempt = next((a for a in rollout.attempts if a.number == n), None)
            status = attempt.status if attempt is not None else "unknown attempt"
            out.write(f"rollout {rollout.id} attempt {n} ({status}): {len(spans)} span(s)\n")
            out.write(format_span_tree(spans, width=args.width) + "\n")
        if args.json:
            out.write(json.dumps(records, indent=2) + "\n")

    return _run(args, body)
