"""``agl judge``: score the rollouts of an existing store with an LLM judge, offline.

The judge's calls are recorded beside the scored rollouts, in the same store (one ``test`` rollout per
call, with its chat span and the parsed scores), so a team can read a judge's verdicts — e.g. on
traces of a production agent — before training on them. A store that cannot be written is refused
with one line before the judge is asked anything. (Moves to ``agl.cli.judge`` with the CLI package.)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from agl.cli._util import add_store_args, open_store_from_args, store_url
from agl.errors import JudgeUnavailable, UsageError

__all__ = ["register_cli"]


def register_cli(parser: argparse.ArgumentParser) -> None:
    add_store_args(parser, what="store whose rollouts to score")
    parser.add_argument("--base-url", required=True, help="the judge's OpenAI-compatible endpoint")
    parser.add_argument("--model", required=True, help="the judge model's name at that endpoint")
    parser.add_argument("--rubric", required=True, help="a text file with the rubric")
    parser.add_argument("--mode", choices=("relative", "absolute"), default="relative")
    parser.add_argument("--reference", help="absolute mode: the task input key holding a reference answer")
    parser.add_argument("--api-key-file", help="a file holding the judge endpoint's API key")
    parser.add_argument("--rollouts", help="comma-separated rollout ids (default: every finished rollout)")
    parser.add_argument("--only", choices=("train", "val"), help="score only rollouts of this mode")
    parser.add_argument("--cache", help="a SQLite file caching verdicts across runs (default: none)")
    parser.add_argument(
        "--token-budget", type=int, default=1500, help="tokens per trajectory before clipping"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line per rollout")
    parser.set_defaults(func=_cmd_judge)


def _read_rubric(path: str) -> str:
    try:
        text = open(path, encoding="utf-8").read().strip()  # noqa: SIM115 - read once
    except OSError as exc:
        raise UsageError(f"cannot read the rubric file {path}: {exc.strerror or exc}") from None
    if not text:
        raise UsageError(f"the rubric file {path} is empty")
    return text


def _open_writable(args: argparse.Namespace) -> Any:
    """The store, or one line saying it cannot be opened for writing. A store that opens but refuses
    writes fails on the judge's first write — its rollout's enqueue, before the endpoint is asked."""
    first = (store_url(args).splitlines() or [""])[0]
    try:
        store = open_store_from_args(args)
    except Exception as exc:  # noqa: BLE001 - any failure to open is the one line below
        raise UsageError(f"cannot open the store {first} for writing: {str(exc).splitlines()[0]}") from None
    return store


def _targets(store: Any, args: argparse.Namespace) -> list[Any]:
    from agl.judge.record import META_KEY

    if args.rollouts:
        ids = [i.strip() for i in args.rollouts.split(",") if i.strip()]
        rollouts = store.query_rollouts(ids=ids)
        missing = sorted(set(ids) - {r.id for r in rollouts})
        if missing:
            raise UsageError(f"no rollout {', '.join(missing)} in the store")
    else:
        rollouts = store.query_rollouts(status=["succeeded", "failed"], mode=args.only)
    return [r for r in rollouts if META_KEY not in r.metadata and r.status in ("succeeded", "failed")]


def _cmd_judge(args: argparse.Namespace) -> int:
    import agl

    rubric = _read_rubric(args.rubric)
    api_key = None
    if args.api_key_file:
        from agl.cli import read_secret

        api_key = read_secret(None, args.api_key_file, "AGL_JUDGE_API_KEY", "judge API key")
    store = _open_writable(args)
    try:
        rollouts = _targets(store, args)
        if not rollouts:
            print("agl judge: no finished rollouts to score", file=sys.stderr)
            return 1
        judge = agl.Judge(
            base_url=args.base_url,
            model=args.model,
            rubric=rubric,
            mode=args.mode,
            reference=args.reference,
            api_key=api_key,
            store=store,
            cache=args.cache or False,
            token_budget=args.token_budget,
        )
        try:
            report = judge.score(store, rollouts)
        except Exception as exc:  # noqa: BLE001 - a store write that fails is one line, nothing half-done
            if isinstance(exc, JudgeUnavailable):
                raise UsageError(str(exc)) from None
            raise UsageError(f"cannot write judge calls to the store: {str(exc).splitlines()[0]}") from None
        finally:
            judge.close()
        _print(rollouts, report, args.json)
    finally:
        store.close()
    return 0


def _print(rollouts: list[Any], report: Any, as_json: bool) -> None:
    for r in rollouts:
        score = report.scores.get(r.id)
        if as_json:
            row = {"rollout_id": r.id, "score": score, "reason": report.reasons.get(r.id)}
            print(json.dumps({**row, "judge_rollout_id": report.judge_rollouts.get(r.id)}))
        else:
            shown = "skipped" if score is None else f"{score:.3f}"
            print(f"{r.id}  {shown}  {report.reasons.get(r.id, '')}")
    m = report.metrics()
    print(
        f"agl judge: {len(report.scores)} scored, {report.groups_skipped} groups skipped, "
        f"{m['judge_calls']} calls, {m['judge_prompt_tokens']}+{m['judge_completion_tokens']} tokens, "
        f"{m['judge_cache_hits']} cache hits, {m['judge_s']:.1f} s",
        file=sys.stderr,
    )
