"""Instructions per gateway request and per generated token: this checkout against another, counted by
valgrind's callgrind, so the figure does not move with the machine's load.

    python bench/instructions.py --vs-python /path/to/other/venv/bin/python [--requests 1000] [--calls 2]

Timings on a shared 2-core machine swing by 2x from one run to the next (the CPU time of a request as
much as its wall time: the other core's work evicts this one's caches). An instruction count is the
same for the same code and inputs whatever else runs. Each case runs twice under
``valgrind --tool=callgrind``: with 0 and with N repetitions after the same warm-up; the difference
divided by N is the cost of one repetition, free of the import and start-up that both runs share.

Cases (each in a fresh interpreter, ``--child CASE N``):

- ``stored``: one chat completion on a per-rollout URL through the gateway's ASGI app in-process
  (scripted backend, the span built and stored in a memory store: what training does);
- ``plain``: the same on ``/v1`` with no rollout (nothing stored);
- ``engine``: one greedy 32-token SmolLM2-135M reply through ``TransformersBackend.generate``, one
  torch thread (the embedded engine's scheduler, KV cache, sampling and parsing; the matmuls are
  torch's in both trees).

``--vs-python`` is an interpreter whose ``import agl`` is the other checkout (its own venv, or a
wrapper script that selects it and execs python: valgrind follows the exec). The two trees must both have ``agl.gateway.app.create_app``,
``ScriptedBackend`` and ``TransformersBackend``; the engine case takes either constructor
(``settings=EngineSettings(...)`` from 0.2, keywords before).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant that answers briefly."},
    {"role": "user", "content": "What is the capital of France? Answer in one word."},
]
REPLY = "The capital of France is Paris."
WARMUP = 200


# ------------------------------------------------------------------------------------ the children
async def _asgi_requests(n: int, plain: bool) -> None:
    """``WARMUP`` then ``n`` chat completions through the gateway's ASGI app (its lifespan run)."""
    import agl.store
    from agl.gateway.app import create_app
    from agl.gateway.backends.scripted import ScriptedBackend
    from agl.types import NewRollout

    store = agl.store.open("memory://")
    store.enqueue([NewRollout(id="ro-bench")])
    store.claim("bench")
    app = create_app(ScriptedBackend([REPLY], on_exhausted="repeat"), store)
    messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    started = asyncio.Event()

    async def life_send(message: dict[str, Any]) -> None:
        if message["type"].startswith("lifespan.startup"):
            started.set()

    await messages.put({"type": "lifespan.startup"})
    life = asyncio.create_task(
        app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, messages.get, life_send)
    )
    await started.wait()
    body = json.dumps({"model": "scripted", "messages": MESSAGES}).encode()
    path = "/v1/chat/completions" if plain else "/rollouts/ro-bench/attempts/1/v1/chat/completions"
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80), "state": {},
    }  # fmt: skip

    async def one() -> None:
        sent = False
        status: list[int] = []

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client stays connected
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])

        await app(dict(scope), receive, send)
        if status != [200]:
            raise SystemExit(f"the gateway answered {status}")

    for _ in range(WARMUP + n):
        await one()
    await messages.put({"type": "lifespan.shutdown"})
    await asyncio.wait_for(life, 30)


async def _engine_calls(n: int) -> None:
    """One warm-up then ``n`` greedy 32-token replies through ``TransformersBackend.generate``."""
    from agl.gateway.backends.base import GenerationRequest
    from agl.gateway.backends.transformers import TransformersBackend

    try:
        from agl.engine import EngineSettings
    except ImportError:  # before 0.2: the settings were the backend's keywords
        backend = TransformersBackend(max_batch_size=8, threads=1)
        backend._load_sync()
    else:
        backend = TransformersBackend(settings=EngineSettings(max_batch_size=8, threads=1))
        backend.engine.load()
    for _ in range(1 + n):
        request = GenerationRequest(
            model=backend.model_name,
            messages=[{"role": "user", "content": "Write a short poem about the sea."}],
            max_tokens=32,
            temperature=0.0,
        )
        result = await backend.generate(request)
        if len(result.choices[0].response_ids or ()) != 32:
            raise SystemExit("the reply stopped before 32 tokens: the case would not compare like with like")


def child(case: str, n: int) -> None:
    if case == "engine":
        asyncio.run(_engine_calls(n))
    else:
        asyncio.run(_asgi_requests(n, plain=case == "plain"))


# ---------------------------------------------------------------------------------------- the parent
def instructions(python: str, case: str, n: int) -> int:
    """The instructions callgrind counts for ``python bench/instructions.py --child CASE N``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = [
            "valgrind", "--tool=callgrind", "--trace-children=yes", f"--callgrind-out-file={out}",
            python, __file__, "--child", case, str(n),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONMALLOC": "malloc", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        found = re.findall(r"Collected : (\d+)", proc.stderr)  # the last: python, after a wrapper's exec
        if proc.returncode != 0 or not found:
            raise SystemExit(f"{case} under valgrind failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        return int(found[-1])


def per_repetition(python: str, case: str, n: int) -> float:
    return (instructions(python, case, n) - instructions(python, case, 0)) / n


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vs-python", required=False, help="an interpreter whose agl is the other checkout")
    parser.add_argument("--requests", type=int, default=1000, help="gateway requests counted (stored, plain)")
    parser.add_argument("--calls", type=int, default=2, help="engine replies counted (32 tokens each)")
    parser.add_argument(
        "--cases",
        default="stored,plain",
        help="stored, plain, engine (engine: over 10 min a run under callgrind)",
    )
    parser.add_argument("--child", nargs=2, metavar=("CASE", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    if not args.vs_python:
        parser.error("--vs-python is required (the interpreter of the checkout to compare with)")
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - {"stored", "plain", "engine"})
    if unknown:
        parser.error(f"unknown cases {unknown}: stored, plain, engine")
    print(f"load average before: {os.getloadavg()[0]:.2f} (instruction counts do not depend on it)")
    print(f"{'case':<8} {'unit':<22} {'this checkout':>14} {'--vs-python':>14} {'ratio':>7}")
    started = time.monotonic()
    for case in cases:
        n = args.calls if case == "engine" else args.requests
        unit = "per 32-token reply" if case == "engine" else "per request"
        here = per_repetition(sys.executable, case, n)
        there = per_repetition(args.vs_python, case, n)
        print(
            f"{case:<8} {unit:<22} {here / 1e6:>13.3f}M {there / 1e6:>13.3f}M {here / there:>7.3f}",
            flush=True,
        )
    print(f"({time.monotonic() - started:.0f} s under valgrind)")


if __name__ == "__main__":
    main()
