"""The fake vLLM server as a program taking vLLM's command line, for the managed-server tests
(:class:`agl.engine.vllm_server.VLLMServer` with ``command=[python, this file]``).

Like ``vllm.entrypoints.openai.api_server`` it reads ``--model``, ``--served-model-name``, ``--host``,
``--port`` and ``--max-model-len`` (other flags are accepted and ignored), serves the LoRA routes only
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and the pause routes only with ``VLLM_SERVER_DEV_MODE=1``.
``--fake-no-lora`` leaves the LoRA routes out whatever the environment; ``--fake-exit N`` prints an error and exits with status N at once (a server that fails to start).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--fake-exit", type=int)
    p.add_argument("--fake-token-delay", type=float, default=0.0)
    p.add_argument("--fake-no-lora", action="store_true", help="no LoRA routes whatever the environment")
    args, _ = p.parse_known_args()
    if args.fake_exit is not None:
        print("ValueError: this fake vLLM was told to fail at start", file=sys.stderr, flush=True)
        return args.fake_exit
    import uvicorn
    from fake_vllm import FakeVLLM

    fake = FakeVLLM(
        ["Hello from the managed fake."],
        model=args.served_model_name or args.model,
        root=args.model,
        max_model_len=args.max_model_len,
        token_delay_s=args.fake_token_delay,
        lora_api=not args.fake_no_lora
        and os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        pause_api="keep" if os.environ.get("VLLM_SERVER_DEV_MODE") == "1" else "none",
    )
    print(f"fake vLLM on {args.host}:{args.port}, pid {os.getpid()}", flush=True)
    uvicorn.run(fake.app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
