"""Multi-turn merging (agl.adapter.trajectories): tokens encoded and seconds per policy update, merged
sequences against per-call transitions, on the same batch in the same run.

    python bench/multiturn.py                          # tiny random Llama, quick
    python bench/multiturn.py --model smollm2          # the embedded SmolLM2-135M-Instruct (LoRA)

Attempts are shaped like sql_agent's (a writer, a checker tool, a rewriter; ~1k-token first prompt,
3 to 6 LLM calls), rendered with the real SmolLM2 chat template and tokenizer, in two forms:

- ``conversation``: the agent keeps one message history, so call k+1's prompt is call k's prompt +
  response + the tool's feedback (what a ReAct/tool-calling agent does): every call after the first
  extends the sequence;
- ``fresh``: sql_agent as written in examples/sql_agent, where every call builds a new prompt from the
  schema, question, query and problem: nothing extends (merge rate 0), so merged == per-call.

Per case: tokens the update encodes, seconds per update (median of ``--repeat`` alternating rounds),
and the merge statistics.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORDS = "id name city amount price order customer product region year month total status".split()


def _schema(rng: random.Random, target_tokens: int, tok) -> str:
    lines: list[str] = []
    while len(tok.encode("\n".join(lines))) < target_tokens:
        cols = ", ".join(f"{rng.choice(WORDS)}_{rng.randrange(99)} TEXT" for _ in range(6))
        lines.append(f"CREATE TABLE t{len(lines)} ({cols});")
    return "\n".join(lines)


def _sql(rng: random.Random) -> str:
    cols = ", ".join(rng.sample(WORDS, 3))
    return f"SELECT {cols} FROM t{rng.randrange(9)} WHERE {rng.choice(WORDS)} > {rng.randrange(999)};"


def attempt(tok, rng: random.Random, calls: int, prompt_tokens: int, *, form: str, rollout: str):
    """One attempt's transitions: the writer's first call, then rewriter calls after checker feedback."""
    from agl.types import Transition

    eos = tok.token_to_id("<|im_end|>")
    schema = _schema(rng, prompt_tokens, tok)
    question = f"How many {rng.choice(WORDS)} rows have {rng.choice(WORDS)} above {rng.randrange(99)}?"
    system = "You are a careful SQLite expert. Reply with one SQL query in a ```sql block."
    messages = [{"role": "system", "content": system}, {"role": "user", "content": f"{schema}\n\n{question}"}]
    out = []
    query = ""
    for k in range(calls):
        if form == "fresh" and k > 0:
            ask = f"{schema}\n\n{question}\n\nQuery:\n```sql\n{query}\n```\n\nProblem: the query failed."
            messages = [{"role": "system", "content": system}, {"role": "user", "content": ask}]
        _, prompt = tok.encode_chat(messages)
        query = _sql(rng)
        reply = f"```sql\n{query}\n```"
        out.append(
            Transition(
                rollout_id=rollout,
                attempt=1,
                group_id=rollout.rsplit("-", 1)[0],
                agent="writer" if k == 0 or form == "conversation" else "rewriter",
                index=k,
                prompt_ids=tuple(prompt),
                response_ids=tuple([*tok.encode(reply), eos]),
            )
        )
        feedback = f"The query failed: no such column: {rng.choice(WORDS)}_{rng.randrange(99)}. Fix it."
        messages = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": feedback}]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a local HF directory")
    p.add_argument("--calls", type=int, nargs="+", default=[3, 6], help="LLM calls per attempt")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="tokens of the first prompt")
    p.add_argument("--attempts", type=int, default=8, help="attempts per update (groups of 4)")
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=3, help="alternating rounds per case")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)

    import torch

    from agl.adapter.trajectories import merge_transitions
    from agl.algorithms.lightning_rl import LightningRL
    from agl.algorithms.update import PolicyUpdate
    from agl.chat.tokenizer import load_default_tokenizer
    from agl.config import RunConfig
    from agl.trainer.trainer import load_tokenizer
    from bench.trainer import _model

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_default_tokenizer()
    algo = LightningRL(
        learning_rate=1e-5, lora_r=16, lora_alpha=32, micro_batch_tokens=args.micro_batch_tokens
    )
    update = PolicyUpdate(
        _model(args.model, 0),
        load_tokenizer(),
        RunConfig.resolve(algo),
        output_dir="/tmp/agl-bench-multiturn",
    )
    print(
        f"model {args.model}, {args.attempts} attempts per update, first prompt ~{args.prompt_tokens} tokens, "
        f"micro_batch_tokens {args.micro_batch_tokens}, torch threads {torch.get_num_threads()}, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(
        "| form | calls | merge rate | tokens per-call | tokens merged | ratio | s per-call | s merged | speed-up |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for form in ("conversation", "fresh"):
        for calls in args.calls:
            rng = random.Random(calls)
            ts = [
                t
                for a in range(args.attempts)
                for t in attempt(tok, rng, calls, args.prompt_tokens, form=form, rollout=f"g{a // 4}-{a}")
            ]
            adv = [rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 1.5) for _ in ts]
            _, stats = merge_transitions(ts)
            secs: dict[bool, list[float]] = {True: [], False: []}
            toks: dict[bool, float] = {}
            for _ in range(args.repeat):
                for merge in (False, True):
                    t0 = time.perf_counter()
                    m = update.step(ts, adv, merge_turns=merge)
                    secs[merge].append(time.perf_counter() - t0)
                    toks[merge] = m["update_tokens"]
            s_pc, s_m = statistics.median(secs[False]), statistics.median(secs[True])
            print(
                f"| {form} | {calls} | {stats.merge_rate:.2f} | {toks[False]:.0f} | {toks[True]:.0f} | "
                f"{toks[False] / toks[True]:.2f}x | {s_pc:.2f} | {s_m:.2f} | {s_pc / s_m:.2f}x |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
