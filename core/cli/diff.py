"""``agl diff RUN_A RUN_B``: where two runs first part, call by call (:mod:`agl.reports.diff`).

Each run is a run directory (its ``store.db`` and ``metrics.jsonl``), a SQLite store file or a store
URL. Prints the first step, rollout and call where the runs diverge, the two token sequences side by
side from the first token that differs, and the likely reason; or that the runs are identical. Exit
status 0: identical, 1: they differ (like ``diff``), 2: a run could not be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from agl.reports.diff import CallView, RunDiff, diff_runs, first_difference, open_run

__all__ = ["format_diff", "register_cli"]


def register_cli(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", metavar="RUN_A", help="a run directory, a store.db file or a store URL")
    parser.add_argument("run_b", metavar="RUN_B", help="the run to compare it with (same forms)")
    parser.add_argument(
        "--tokenizer", default=None, help="decode the token ids: 'default' (SmolLM2) or a tokenizer directory"
    )
    parser.add_argument("--tokens", type=int, default=16, help="tokens shown from the first difference")
    parser.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    parser.set_defaults(func=_cli)


def _side(view: CallView | None, start: int, n: int, tok: Any) -> tuple[str, str]:
    if view is None:
        return "-", ""
    ids = view.response_ids[start : start + n]
    text = repr(tok.decode(ids)) if tok is not None else ""
    more = " …" if len(view.response_ids) > start + n else ""
    return f"{ids}{more}", text


def format_diff(result: RunDiff, *, tokens: int = 16, tok: Any = None, file: TextIO) -> None:
    """The comparison as text: one verdict line, then the divergence side by side."""
    for note in result.notes:
        print(f"note: {note}", file=file)
    if result.identical:
        print(
            f"identical: {result.rollouts} rollout(s), {result.calls} LLM call(s), same token ids"
            + (", same metrics" if result.metrics is None else ""),
            file=file,
        )
        return
    d = result.first
    if d is None:
        print(f"same {result.rollouts} rollout(s) and {result.calls} call(s), token for token", file=file)
    else:
        where = f"step {d.step}, " if d.step is not None else ""
        call = f", call {d.call}" if d.call is not None else ""
        print(f"first divergence: {where}rollout {d.place}{call}", file=file)
        print(f"  reason: {d.reason}", file=file)
        if d.a is not None or d.b is not None:
            ra = d.a.rollout_id if d.a else "-"
            rb = d.b.rollout_id if d.b else "-"
            print(f"  rollouts: A {ra}  B {rb}", file=file)
            for name, v in (("A", d.a), ("B", d.b)):
                if v is not None:
                    print(
                        f"  {name}: seed={v.seed} ({v.seed_source})  weights v{v.weight_version}  "
                        f"prompt={len(v.prompt_ids)} tok  response={len(v.response_ids)} tok  span={v.span_id}",
                        file=file,
                    )
            if d.first_token is not None:
                start = d.first_token
                same = d.a is not None and d.b is not None and d.a.response_ids == d.b.response_ids
                head = "the same tokens, log-probs differ" if same else f"the first {start} are the same"
                print(f"  responses from token {start} ({head}):", file=file)
                rows = [(n, *_side(v, start, tokens, tok)) for n, v in (("A", d.a), ("B", d.b))]
                width = max(len(r[1]) for r in rows)
                for n, ids, text in rows:
                    print(f"    {n} {ids.ljust(width)}  {text}", file=file)
            elif d.a is not None and d.b is not None:
                start = first_difference(d.a.prompt_ids, d.b.prompt_ids) or 0
                print(f"  prompts differ from token {start}:", file=file)
                for n, v in (("A", d.a), ("B", d.b)):
                    ids = v.prompt_ids[start : start + tokens]
                    text = repr(tok.decode(ids)) if tok is not None else ""
                    print(f"    {n} {ids}  {text}", file=file)
    if result.metrics is not None:
        step, key, va, vb = result.metrics
        print(f"metrics first differ at step {step}: {key} A={va} B={vb}", file=file)


def _cli(args: argparse.Namespace) -> int:
    from agl.store.base import StoreError

    if args.tokens < 1:
        from agl.errors import UsageError

        raise UsageError(f"--tokens must be at least 1, got {args.tokens}")
    tok = None
    if args.tokenizer:
        from agl.cli._util import tokenizer_from_arg

        tok = tokenizer_from_arg(args.tokenizer)
    a = open_run(args.run_a)
    try:
        b = open_run(args.run_b)
    except BaseException:
        a.store.close()
        raise
    try:
        result = diff_runs(a, b)
    except StoreError as exc:
        print(f"agl: error: {exc}", file=sys.stderr)
        return 2
    finally:
        a.store.close()
        b.store.close()
    if args.json:
        print(json.dumps(result.as_dict(), default=str))
    else:
        format_diff(result, tokens=args.tokens, tok=tok, file=sys.stdout)
    return 0 if result.identical else 1
