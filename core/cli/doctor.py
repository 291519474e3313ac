"""``agl doctor``: installed frameworks, instrumented integrations, their hooks, the tracer
(:func:`agl.reports.doctor.report`). Exit status 1 when a hook was lost or a framework is unsupported."""

from __future__ import annotations

import argparse

from agl.reports.doctor import report

__all__ = ["register_cli"]


def _run(args: argparse.Namespace) -> int:
    import agl

    if args.instrument:  # every installed one, imported now: the point is to check all their hooks
        from agl.instrumentation import available_instrumentors, is_installed

        agl.instrument(*[name for name, cls in available_instrumentors().items() if is_installed(cls)])
    text = report()
    print(text)
    return 1 if "HOOKS LOST" in text or "UNSUPPORTED" in text else 0


def register_cli(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--instrument",
        action="store_true",
        help="instrument every installed integration first (importing its framework), then check that "
        "every integration's hooks are in place",
    )
    parser.set_defaults(func=_run)
