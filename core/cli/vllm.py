"""``agl vllm serve``: start a vLLM OpenAI server with everything agl needs to train through it
(:class:`agl.engine.vllm_server.VLLMServer`), check it, print what it offers, and keep it
running until interrupted; ``agl gateway serve --backend vllm --upstream URL`` then fronts it."""

from __future__ import annotations

import argparse
import signal
import time
from typing import Any

from agl.cli._util import check_port, check_port_free

__all__ = ["register_cli"]


def register_cli(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="vllm_command", metavar="SUBCOMMAND")
    p = sub.add_parser(
        "serve",
        help="start a vLLM server set up for agl (runtime LoRA, pause API, token ids) and keep it running",
        description="Start vLLM's OpenAI server on a model with the flags and environment agl needs "
        "(--enable-lora, --max-lora-rank, --max-loras, --logprobs-mode processed_logprobs, "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, VLLM_SERVER_DEV_MODE=1), wait until it serves, check "
        "token ids, runtime LoRA loading and the pause API, print its URL and what it offers, and stop it "
        "on Ctrl-C. Flags after -- go to vLLM as they are.",
    )
    who = p.add_mutually_exclusive_group()
    who.add_argument("--python", help="an interpreter with vLLM installed (default: $AGL_VLLM_PYTHON)")
    who.add_argument("--command", help="the command that starts vLLM's server instead, e.g. 'vllm serve'")
    p.add_argument("--model", help="the model folder (default: the embedded SmolLM2-135M-Instruct, prepared)")
    p.add_argument("--served-model-name", help="the name clients use (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    p.add_argument("--lora-rank", type=int, default=16, help="the trained LoRA's rank (default: 16)")
    p.add_argument("--adapters", type=int, default=1, help="LoRA adapters served at once: one per agent")
    p.add_argument("--dtype", default="auto", help="vLLM's --dtype (default: auto, the checkpoint's)")
    p.add_argument("--max-model-len", type=int, help="vLLM's --max-model-len (default: the model's)")
    p.add_argument("--tool-parser", help="vLLM's tool-call parser (only for chats vLLM renders itself)")
    p.add_argument("--log", help="write the server's output to this file (default: vllm-<port>.log)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for it")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then more vLLM flags")
    p.set_defaults(func=_serve)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _serve(args: argparse.Namespace) -> int:
    from agl.engine.vllm_probe import probe
    from agl.engine.vllm_server import VLLMServer

    check_port(args.port)
    check_port_free(args.host, args.port)
    model = args.model
    if model is None:
        from agl.chat.models import prepare_default_model

        model = str(prepare_default_model())
    extra = [a for a in args.vllm_args if a != "--"]
    server = VLLMServer(
        model,
        python=args.python,
        command=args.command,
        served_name=args.served_model_name,
        host=args.host,
        port=args.port,
        lora_rank=args.lora_rank,
        adapters=args.adapters,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        tool_parser=args.tool_parser,
        extra_args=extra,
        log_path=args.log or f"vllm-{args.port}.log",
        startup_timeout_s=args.startup_timeout,
    )
    # Ctrl-C, or SIGTERM (a service manager; a shell's background job ignores SIGINT): stop cleanly
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupted)
    print(f"agl vllm: starting {' '.join(server.command())}", flush=True)
    print(f"agl vllm: its output goes to {server.log_path}", flush=True)
    server.start()
    try:
        print(probe(server.url).report(), flush=True)
        print(
            f"agl vllm: front it with: agl gateway serve --backend vllm --upstream {server.url}", flush=True
        )
        print(f"agl vllm: serving on {server.url}", flush=True)
        while server.alive():
            time.sleep(1.0)
        print("agl vllm: the server exited; see its log", flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
