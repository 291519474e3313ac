"""``agl doctor``: installed frameworks, instrumented integrations, their hooks, the tracer
(:func:`agl.reports.doctor.report`). Exit status 1 when a hook was lost or a framework is unsupported.
``agl doctor --upstream URL``: what a vLLM server offers agl (:func:`agl.engine.vllm_probe.probe`)."""

from __future__ import annotations

import argparse

from agl.reports.doctor import report

__all__ = ["register_cli"]


def _run(args: argparse.Namespace) -> int:
    import agl

    if args.upstream:  # a vLLM server: what it offers agl, nothing of this process
        from agl.engine.vllm_probe import probe

        support = probe(args.upstream, generate=args.generate, api_key=args.upstream_api_key)
        print(support.report())
        return 0 if support.reachable and not support.missing() else 1

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
    parser.add_argument(
        "--upstream",
        metavar="URL",
        help="report what the vLLM server at URL offers agl instead: token ids, runtime LoRA loading, "
        "LoRA enabled, the pause API, the token-in route, sleep/wake_up (exit status 1 if it lacks one "
        "agl needs, naming the flag)",
    )
    parser.add_argument(
        "--generate",
        action="store_true",
        help="with --upstream: also make one one-token completion (token ids seen, not inferred) and load "
        "a missing adapter (whether --enable-lora is on)",
    )
    parser.add_argument("--upstream-api-key", help="with --upstream: the server's API key")
    parser.set_defaults(func=_run)
