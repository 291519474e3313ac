"""Adapter throughput: spans of one attempt → transitions (target >= 100k spans/s, DESIGN §10).

Each attempt is a realistic multi-agent trace as the integrations and the gateway record it: a rollout
root, agents, and per LLM turn a client ``chat`` span with its gateway ``chat`` child (exact prompt /
response ids and logprobs, JSON messages), an ``execute_tool`` span (every 5th one failing, so AIR
works) and an ``agl.message`` span; a final reward. Spans are built beforehand (as a store returns
them); the timed part is ``Adapter.transitions`` — dedup, tree, attribution, rewards, AIR, credit and
the ``Transition`` objects.

    python bench/adapter.py                  # attempts of 10, 100 and 1000 spans
    python bench/adapter.py --prompt-tokens 4096 --sizes 1000
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from agl import semconv as sc
from agl.adapter import Adapter
from agl.types import Span, SpanStatus

TARGET = 100_000  # spans/s


def build_attempt(n_spans: int, *, prompt_tokens: int, response_tokens: int, seed: int = 0) -> list[Span]:
    rng = random.Random(seed)
    trace = f"{rng.getrandbits(128) or 1:032x}"
    spans: list[Span] = []

    def sid() -> str:
        return f"{rng.getrandbits(64) or 1:016x}"

    def add(name, start, end, parent=None, attrs=None, status="UNSET") -> Span:
        s = Span(
            trace_id=trace,
            span_id=sid(),
            parent_id=parent.span_id if parent is not None else None,
            name=name,
            start_ns=start,
            end_ns=end,
            status=SpanStatus(code=status),
            attributes=attrs or {},
            rollout_id="ro-bench",
            attempt=1,
            seq=len(spans) + 1,
        )
        spans.append(s)
        return s

    root = add(sc.SPAN_ROLLOUT, 0, 10**12)
    t = 1000
    turn = 0
    agent = None
    history = [{"role": "system", "content": "You are a careful assistant. " * 8}]
    while len(spans) < n_spans - 1:
        if turn % 5 == 0 and len(spans) < n_spans - 2:
            agent = add(
                sc.SPAN_INVOKE_AGENT,
                t,
                t + 10**9,
                root,
                {sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT, sc.GEN_AI_AGENT_NAME: f"agent{turn // 5 % 3}"},
            )
        room = n_spans - 1 - len(spans)
        call_id = f"call_{turn}"
        history.append({"role": "user", "content": f"step {turn}: compute {rng.random():.6f} * 7"})
        output = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}
            ],
        }
        msgs = json.dumps(history[-8:])
        out = json.dumps([output])
        if room >= 2:
            client = add(
                sc.SPAN_CHAT,
                t,
                t + 100,
                agent,
                {
                    sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT,
                    sc.AGL_SIDE: sc.SIDE_CLIENT,
                    sc.GEN_AI_REQUEST_MODEL: "m",
                    sc.GEN_AI_INPUT_MESSAGES: msgs,
                    sc.GEN_AI_OUTPUT_MESSAGES: out,
                },
            )
            add(
                sc.SPAN_CHAT,
                t + 1,
                t + 99,
                client,
                {
                    sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT,
                    sc.AGL_SIDE: sc.SIDE_SERVER,
                    sc.GEN_AI_REQUEST_MODEL: "m",
                    sc.GEN_AI_INPUT_MESSAGES: msgs,
                    sc.GEN_AI_OUTPUT_MESSAGES: out,
                    sc.AGL_LLM_PROMPT_TOKEN_IDS: [rng.randrange(50_000) for _ in range(prompt_tokens)],
                    sc.AGL_LLM_RESPONSE_TOKEN_IDS: [rng.randrange(50_000) for _ in range(response_tokens)],
                    sc.AGL_LLM_RESPONSE_LOGPROBS: [-rng.random() for _ in range(response_tokens)],
                    sc.AGL_LLM_WEIGHT_VERSION: 1,
                },
            )
        if len(spans) < n_spans - 1:
            add(
                sc.SPAN_EXECUTE_TOOL,
                t + 110,
                t + 150,
                agent,
                {
                    sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL,
                    sc.GEN_AI_TOOL_NAME: "calc",
                    sc.GEN_AI_TOOL_CALL_ID: call_id,
                },
                "ERROR" if turn % 5 == 4 else "OK",
            )
        if len(spans) < n_spans - 1:
            add(sc.SPAN_MESSAGE, t + 160, t + 160, agent, {sc.AGL_MESSAGE_BODY: "tool done"})
        t += 200
        turn += 1
    add(sc.SPAN_REWARD, t, t, root, {sc.AGL_REWARD_VALUE: 1.0, sc.AGL_REWARD_PRIMARY: True})
    return spans


def measure(spans: list[Span], adapter: Adapter, min_time_s: float) -> tuple[float, float, int]:
    """Median wall and CPU seconds per attempt over repeated runs lasting at least ``min_time_s``.

    CPU time (``time.process_time``) is reported next to wall time because the development machine is
    shared: other processes stretch wall time, not the CPU time the adapter itself needs.
    """
    walls, cpus = [], []
    n_trans = 0
    start = time.perf_counter()
    while time.perf_counter() - start < min_time_s or len(walls) < 5:
        w0, c0 = time.perf_counter(), time.process_time()
        ts = adapter.transitions(spans)
        cpus.append(time.process_time() - c0)
        walls.append(time.perf_counter() - w0)
        n_trans = len(ts)
    return statistics.median(walls), statistics.median(cpus), n_trans


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10,100,1000", help="spans per attempt")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--response-tokens", type=int, default=128)
    p.add_argument("--min-time", type=float, default=2.0, help="seconds per size")
    args = p.parse_args()
    adapter = Adapter()
    adapter.transitions(build_attempt(50, prompt_tokens=8, response_tokens=4))  # warm up imports/plugins
    print(
        f"adapter throughput (prompt {args.prompt_tokens} tok, response {args.response_tokens} tok per call; "
        f"target {TARGET:,} spans/s)"
    )
    print(
        f"{'spans/attempt':>13} {'transitions':>11} {'ms wall':>9} {'spans/s wall':>13} "
        f"{'ms CPU':>8} {'spans/s CPU':>12} {'x target':>9}"
    )
    for size in (int(s) for s in args.sizes.split(",")):
        spans = build_attempt(size, prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens)
        wall, cpu, n_trans = measure(spans, adapter, args.min_time)
        rate_w, rate_c = len(spans) / wall, len(spans) / max(cpu, 1e-9)
        print(
            f"{len(spans):>13} {n_trans:>11} {wall * 1e3:>9.3f} {rate_w:>13,.0f} "
            f"{cpu * 1e3:>8.3f} {rate_c:>12,.0f} {rate_w / TARGET:>8.2f}x"
        )


if __name__ == "__main__":
    main()
