"""``agl gateway serve``: run the OpenAI-compatible gateway in front of one backend."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from agl.cli._util import (
    STORE_ENV,
    add_store_args,
    check_port,
    check_port_free,
    open_store_from_args,
    read_secret,
)
from agl.cli.config_args import add_engine_arguments
from agl.errors import UsageError
from agl.gateway.serve import API_KEY_ENV, check_public_bind
from agl.http_limits import HttpLimits

__all__ = [
    "API_KEY_ENV",
    "build_backend",
    "engine_settings",
    "check_public_bind",
    "register_cli",
]  # the two bind names: from agl.gateway.serve

log = logging.getLogger("agl.gateway")


def register_cli(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="gateway_command", metavar="SUBCOMMAND")
    p = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible gateway",
        description="Serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/responses, "
        "/v1/models) in front of one backend, recording every call as a span with its exact token ids. "
        "Agents reach it per rollout at /rollouts/{rollout_id}/attempts/{n}/v1.",
    )
    _add_backend_options(p)
    add_store_args(p, what="store for the spans (none given and no $AGL_STORE: spans are not recorded)")
    _add_bind_options(p)
    p.add_argument(
        "--span-writes",
        choices=["before-reply", "after-reply"],
        default="before-reply",
        help="store each call's span before its reply is sent (default; a runner may finish its attempt "
        "right after) or just after it, batched (lower latency; readers must POST /agl/v1/flush first)",
    )
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="transformers, vllm: serve the peft LoRA adapter in DIR as NAME (an agent's adapter: a "
        "checkpoint's NAME/ folder; vllm loads DIR itself); repeat for each agent. Clients reach it by "
        "model '<model>:NAME' or the baggage agl.agent=NAME",
    )
    add_engine_arguments(p.add_argument_group("transformers backend: the engine (agl.engine.EngineSettings)"))
    _add_sampling_options(p)
    HttpLimits.add_arguments(p)
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level; debug also logs every request (default: info)",
    )
    p.set_defaults(func=_serve)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _add_backend_options(p: argparse.ArgumentParser) -> None:
    """The backend and the model names it serves."""
    p.add_argument(
        "--backend",
        choices=["transformers", "scripted", "vllm", "openai"],
        default="transformers",
        help="transformers (embedded, default), scripted (tests), vllm (proxy), openai (pass-through)",
    )
    p.add_argument(
        "--model",
        help="transformers: a local checkpoint path or an `agl export model` folder (default: "
        "SmolLM2-135M-Instruct, prepared on first use); "
        "vllm: the policy's model name (default: the upstream's first model); scripted: the model name",
    )
    p.add_argument(
        "--model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="a name clients use for the policy; repeat for several (transformers: the first is the "
        "model's own name). Any other name is served by the policy too, unless --only-model-names",
    )
    p.add_argument(
        "--only-model-names",
        action="store_true",
        help="strict: serve only the backend's names, --model-name and --serve names; any other model "
        "name is a 404 (by default every name a program asks for is served by the policy)",
    )
    p.add_argument(
        "--serve",
        action="append",
        default=[],
        metavar="NAME=TARGET",
        help="serve model NAME with TARGET: 'policy', 'base' (no adapter), an --adapter name, a "
        "checkpoint directory (transformers: a second, frozen model), a script file (scripted) or an "
        "http(s) URL (an OpenAI-compatible server; vllm: exact token ids); repeat for several",
    )
    p.add_argument("--upstream", help="vllm/openai: the upstream base URL (e.g. http://gpu:8000/v1)")
    p.add_argument(
        "--upstream-api-key",
        help="openai/vllm: API key for the upstream (default: $OPENAI_API_KEY, which keeps it out of the "
        "process list)",
    )
    p.add_argument(
        "--script", help="scripted: a JSON file with a list of replies (strings or {content, tool_calls})"
    )


def _add_bind_options(p: argparse.ArgumentParser) -> None:
    """Where the gateway listens and the bearer token that guards it."""
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: 127.0.0.1); any other address needs an API key",
    )
    p.add_argument("--port", type=int, default=8765, help="port (default: 8765; 0 picks a free one)")
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="file holding the bearer token clients must send (its first line); it guards every route, "
        "the control routes (/agl/v1/status, weights, adapters) included",
    )
    key.add_argument(
        "--api-key",
        help=f"the bearer token itself; prefer ${API_KEY_ENV} or --api-key-file: a value given here is "
        f"visible to every user of the machine in the process list (default: ${API_KEY_ENV})",
    )


def engine_settings(args: Any) -> Any:
    """The :class:`~agl.engine.EngineSettings` the engine flags give (the defaults for a namespace
    without them); validated there, so a bad value is a UsageError naming the setting."""
    from agl.cli.config_args import engine_from_args

    return engine_from_args(args)


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    """Sampling defaults and caps for programs that set none (agl.gateway.sampling)."""
    p.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="the most tokens a reply may have: the default for a request that sets no max_tokens and "
        "the cap for one that asks more (default: none; the transformers engine's own default is 512)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        metavar="T",
        help="the sampling temperature of a request that sets none (a program's own value wins)",
    )


def gateway_options(args: Any, backend: Any) -> dict[str, Any]:
    """The gateway's model-name and sampling options from the command line (``create_app`` keywords)."""
    from agl.gateway.sampling import SamplingLimits

    names = list(args.model_name or [])
    if args.backend == "transformers" and names:
        names = names[1:]  # the first is the model's own name (build_backend gives it to the engine)
    return {
        "model_names": names,
        "only_model_names": bool(args.only_model_names),
        "serve": _serve_targets(args, backend),
        "sampling": SamplingLimits(max_tokens=args.max_tokens, temperature=args.temperature),
    }


def _serve_targets(args: Any, backend: Any) -> dict[str, Any]:
    """``--serve NAME=TARGET`` values as ``{name: backend or adapter name}`` (module docstring of
    agl.gateway.model_names); a malformed or repeated name, or a target that names nothing, is a
    UsageError before anything loads."""
    from agl.gateway.model_names import BASE_TARGET, POLICY_TARGET

    adapters = list(_adapter_args(getattr(args, "adapter", None) or []))
    out: dict[str, Any] = {}
    for value in args.serve or []:
        name, sep, target = (part.strip() for part in value.partition("="))
        if not sep or not name or not target:
            raise UsageError(f"--serve takes NAME=TARGET, got {value!r}")
        if name.casefold() in {n.casefold() for n in out}:
            raise UsageError(f"--serve {name} is given twice")
        if target in (POLICY_TARGET, BASE_TARGET) or target in adapters:
            out[name] = target
        else:
            out[name] = _target_backend(args, name, target, adapters)
    return out


def _target_backend(args: Any, name: str, target: str, adapters: list[str]) -> Any:
    """The backend of a ``--serve NAME=TARGET`` that is no adapter: a URL, a script, a checkpoint."""
    from agl.gateway.backends import from_spec
    from agl.gateway.model_names import BASE_TARGET, POLICY_TARGET

    if target.startswith(("http://", "https://")):
        kind = "vllm" if args.backend == "vllm" else "openai"
        if kind == "vllm":
            return from_spec("vllm", url=target, api_key=args.upstream_api_key)
        return from_spec("openai", url=target, api_key=args.upstream_api_key)
    path = Path(target)
    if args.backend == "scripted" and path.is_file():
        return from_spec("scripted", script=_read_script(target), models=[name], on_exhausted="cycle")
    if args.backend == "transformers" and path.is_dir():
        return from_spec("transformers", model=str(path), model_name=name, settings=engine_settings(args))
    what = {"scripted": "a script file", "transformers": "a checkpoint directory"}.get(args.backend)
    choices = [
        f"'{POLICY_TARGET}'",
        f"'{BASE_TARGET}'",
        f"an --adapter name ({', '.join(adapters) or 'none given'})",
    ]
    choices += [what] if what else []
    raise UsageError(f"--serve {name}={target}: {target!r} is none of {', '.join(choices)}, an http(s) URL")


def build_backend(args: Any) -> Any:
    """The backend the command-line arguments describe (through :func:`agl.gateway.backends.from_spec`)."""
    from agl.gateway.backends import from_spec

    settings = engine_settings(args)
    if args.backend != "transformers":
        settings.check_backend(args.backend)  # e.g. --prefix-cache-mb with --backend vllm: refused by name
    if args.backend == "transformers":
        _require_torch()
        model, tokenizer = _export_model(args)
        return from_spec(
            "transformers",
            model=model,
            tokenizer=tokenizer,
            model_name=(args.model_name or [None])[0],
            adapters=_adapter_args(getattr(args, "adapter", None) or []) or None,
            settings=settings,
        )
    if args.backend == "scripted":
        return from_spec(
            "scripted",
            script=_read_script(args.script),
            models=[args.model or "scripted"],
            on_exhausted="cycle",
        )
    if not args.upstream:
        raise UsageError(f"--backend {args.backend} needs --upstream URL")
    if args.backend == "vllm":
        adapters = _adapter_args(getattr(args, "adapter", None) or []) or None
        return from_spec(
            "vllm", url=args.upstream, model=args.model, api_key=args.upstream_api_key, adapters=adapters
        )
    return from_spec(
        "openai", url=args.upstream, api_key=args.upstream_api_key, models=[args.model] if args.model else ()
    )


def _export_model(args: Any) -> tuple[Any, Any]:
    """``--model DIR`` of an ``agl export model`` folder (:func:`agl.reports.model_export.serving_plan`):
    a shared LoRA export is merged onto its base and served as the policy (under every name); an
    adapter per agent serves each adapter on the base under its agent's name (``--adapter`` and
    ``--serve`` added). Returns the model (a path or a loaded model) and its tokenizer (or None)."""
    if args.model is None or not Path(args.model).is_dir():
        return args.model, None
    from agl.reports.model_export import load_merged, serving_plan

    plan = serving_plan(args.model)
    if plan is None:
        return args.model, None
    if plan.merge is not None:
        if not args.model_name:
            args.model_name = [Path(args.model).name]
        return load_merged(plan)
    given = _adapter_args(list(args.adapter or []))
    args.adapter = list(args.adapter or []) + [f"{n}={d}" for n, d in plan.adapters.items() if n not in given]
    mapped = {value.partition("=")[0].strip() for value in args.serve or []}
    args.serve = list(args.serve or []) + [f"{a}={n}" for a, n in plan.serve.items() if a not in mapped]
    return plan.model, None


def _names_line(options: dict[str, Any]) -> str:
    serve = ", ".join(
        f"{n} -> {t if isinstance(t, str) else f'{t.name} backend'}" for n, t in options["serve"].items()
    )
    rule = (
        "only the names given" if options["only_model_names"] else "any name a program asks for (the policy)"
    )
    return rule + (f"; {serve}" if serve else "")


def _adapter_args(values: list[str]) -> dict[str, str]:
    """``--adapter NAME=DIR`` values as ``{name: dir}``; a malformed or repeated name is a UsageError."""
    out: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--adapter takes NAME=DIR, got {value!r}")
        if name in out:
            raise UsageError(f"--adapter {name} is given twice")
        out[name] = path
    return out


def _read_script(path_arg: str | None) -> list[Any]:
    """``--script``: a JSON list of replies (a greeting when none is given)."""
    if not path_arg:
        return ["Hello from the agl scripted backend."]
    path = Path(path_arg)
    if not path.exists():
        raise FileNotFoundError(f"script file {path} not found")
    try:
        script = json.loads(path.read_text())
    except ValueError as exc:
        raise UsageError(f"{path} is not JSON: {exc}") from None
    if not isinstance(script, list) or not script:
        raise UsageError(f"{path}: a script is a non-empty JSON list of replies")
    return script


def _require_torch() -> None:
    """The embedded backend needs the training extras; say so in one line before announcing anything."""
    import importlib.util

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(
            f"the transformers backend needs {' and '.join(missing)}: pip install 'agl[train]' (on CPU with "
            "torch==2.13.0), or serve another backend: --backend scripted|vllm|openai"
        )


def _serve(args: Any) -> int:
    if getattr(args, "gateway_command", None) != "serve":
        print("usage: agl gateway serve [--backend ...] (see agl gateway serve --help)")
        return 2
    import uvicorn

    from agl.gateway.app import create_app

    engine_settings(args)  # a bad engine flag fails first, naming the setting, before anything binds
    api_key = read_secret(args.api_key, args.api_key_file, API_KEY_ENV, "API key")
    check_public_bind(args.host, api_key)
    limits = HttpLimits.from_args(args)
    check_port(args.port)
    check_port_free(args.host, args.port)
    backend = build_backend(args)
    options = gateway_options(args, backend)
    store = None
    if args.store or os.environ.get(STORE_ENV):  # the gateway alone has no default store
        store = open_store_from_args(args, must_exist=False)
    else:
        print("agl gateway: no --store given: calls are served but no spans are recorded")
    app = create_app(
        backend, store, api_key=api_key, span_writes=args.span_writes.replace("-", "_"), **options
    )
    print(f"agl gateway: {args.backend} backend on http://{args.host}:{args.port}/v1", flush=True)
    print(
        f"  per-rollout base URL: http://{args.host}:{args.port}/rollouts/{{rollout_id}}/attempts/{{n}}/v1",
        flush=True,
    )
    print(f"  model names: {_names_line(options)}", flush=True)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        http=limits.protocol(),  # read timeouts, per-client connection cap
    )
    return 0
