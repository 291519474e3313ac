"""What the name normalisation (agl.names) costs on the export path: ``span_from_otel`` per span, with
the normalisation and without it (the same function, ``normalise_attributes`` replaced by identity), in
alternating rounds of one run.

    python bench/names.py [--spans 20000] [--rounds 5]

The spans carry GenAI attributes like an instrumented call's (an agent or tool name, messages, ids);
a quarter of the agent names end with a newline (CrewAI's folded YAML roles), so the trimming path is
measured too. Prints the load average: only the ratio within one run means anything on a shared box.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agl import semconv as sc
from agl.tracing import spanconv


def make_spans(n: int) -> list[object]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("bench")
    messages = json.dumps([{"role": "user", "content": "How many users are there?"}])
    for i in range(n):
        attrs = {
            sc.AGL_ROLLOUT_ID: "ro-bench",
            sc.AGL_ATTEMPT: 1,
            sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT,
            sc.GEN_AI_INPUT_MESSAGES: messages,
            sc.AGL_LLM_PROMPT_TOKEN_IDS: list(range(64)),
        }
        if i % 2:
            attrs[sc.GEN_AI_AGENT_NAME] = "Content Planner\n" if i % 4 == 1 else "Content Planner"
        else:
            attrs[sc.GEN_AI_TOOL_NAME] = "search"
        tracer.start_span(sc.SPAN_CHAT, attributes=attrs).end()
    return list(exporter.get_finished_spans())


def rate(spans: list[object]) -> float:
    start = time.process_time()
    for span in spans:
        spanconv.span_from_otel(span)  # type: ignore[arg-type]
    return len(spans) / (time.process_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    spans = make_spans(args.spans)
    normalise = spanconv.normalise_attributes
    best = {"with": 0.0, "without": 0.0}
    for _ in range(args.rounds):
        for label in ("with", "without"):
            spanconv.normalise_attributes = normalise if label == "with" else (lambda attrs: attrs)  # type: ignore[assignment]
            best[label] = max(best[label], rate(spans))
    spanconv.normalise_attributes = normalise  # type: ignore[assignment]
    print(f"load average: {os.getloadavg()[0]:.1f} (2 cores)")
    print(
        f"span_from_otel with normalisation:    {best['with']:,.0f} spans/s (CPU time, best of {args.rounds})"
    )
    print(f"span_from_otel without normalisation: {best['without']:,.0f} spans/s")
    print(f"ratio with / without: {best['with'] / best['without']:.3f}")


if __name__ == "__main__":
    main()
