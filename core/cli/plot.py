"""``agl plot RUN_DIR...``: draw the reward curve of training or APO runs (:func:`agl.run.plot.plot_runs`)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

from agl.errors import UsageError
from agl.run.plot import plot_runs

__all__ = ["register_cli"]


def register_cli(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="Trainer run directories (metrics.jsonl)"
    )
    parser.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/reward_curve.png)")
    parser.add_argument("--title", default=None)
    parser.add_argument("--smooth", type=int, default=3, help="moving-mean window for the train curve")
    parser.add_argument(
        "--baseline",
        action="append",
        default=[],
        metavar="LABEL=VALUE",
        help="a held-out figure to draw as a dashed line (repeatable), e.g. 'warm start=0.083'",
    )
    parser.set_defaults(func=_cli)


def _baselines(items: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        label, sep, value = item.rpartition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or not label.strip() or not math.isfinite(number):
            raise UsageError(f"--baseline takes LABEL=VALUE with a number, got {item!r}")
        out[label.strip()] = number
    return out


def _cli(args: argparse.Namespace) -> int:
    out = args.out or str(Path(args.run_dirs[0]) / "reward_curve.png")
    path = plot_runs(
        args.run_dirs, out, title=args.title, smooth=args.smooth, baselines=_baselines(args.baseline)
    )
    print(path)
    return 0
