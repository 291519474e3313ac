"""Training cost of an adapter per agent: update time and memory, 1 shared adapter vs 4 agent adapters.

    python bench/adapters_update.py [--threads 2] [--reps 3]

SmolLM2-135M-Instruct (``agl models prepare``), LoRA r=16 on every linear layer, AdamW, fp32 on CPU.
Each case runs in a fresh subprocess (so its peak RSS is its own), builds a
``agl.algorithms.update.PolicyUpdate`` and runs ``step`` on the same 32 transitions (the same prompt
and response tokens, advantages +1/-1 alternating inside each group):

- ``shared``: one policy adapter, every transition of one agent (today's shared policy);
- ``4 agents``: ``adapters=[a0..a3]``, the 32 transitions split 8 per agent (GRPO groups per agent).

Per case: the median seconds of ``--reps`` steps after one warm-up step, the trainable (LoRA) parameter
count, and the process's peak RSS after the steps. Targets (issue 35): update time for the same tokens
over 4 adapters <= 1.15x of 1; memory per extra adapter <= its weights + its optimizer state + 10%
(fp32 weights 4 B, AdamW's two moments 8 B, the gradient 4 B: 16 B per trainable parameter).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

PROMPT = "You are the writer. Answer the question in one short sentence: what is the capital of France?"
REPLIES = ["Paris is the capital of France.", "I think it is Lyon, but I am not sure at all."]


def _case(name: str, threads: int, reps: int) -> dict[str, Any]:
    import torch

    from agl.algorithms.lightning_rl import LightningRL
    from agl.algorithms.update import PolicyUpdate
    from agl.chat.models import prepare_default_model
    from agl.chat.tokenizer import load_tokenizer
    from agl.config import RunConfig
    from agl.types import Transition

    torch.set_num_threads(threads)
    path = str(prepare_default_model())
    tok = load_tokenizer(path)
    agents = [f"a{i}" for i in range(4)] if name == "4 agents" else None
    algo = LightningRL(learning_rate=1e-4, lora_r=16, lora_alpha=32, mixed_precision="no")
    config = RunConfig.resolve(algo, sampling={"temperature": 1.0})
    policy = PolicyUpdate(path, tok, config, output_dir="/tmp/agl-bench-adapters-update", adapters=agents)
    prompt = tuple(tok(PROMPT, add_special_tokens=False)["input_ids"])
    ts, adv = [], []
    for i in range(32):
        agent = agents[i % 4] if agents else "a0"
        reply = tuple(tok(REPLIES[i % 2], add_special_tokens=False)["input_ids"]) + (tok.eos_token_id,)
        ts.append(Transition(rollout_id=f"r{i}", attempt=1, index=0, agent=agent, group_id=f"g{i // 8}",
                             prompt_ids=prompt, response_ids=reply))  # fmt: skip
        adv.append(1.0 if i % 2 == 0 else -1.0)
    trainable = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    policy.step(ts, adv)  # warm-up: optimizer states allocated
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        policy.step(ts, adv)
        times.append(time.perf_counter() - t0)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # what the run holds for training between steps: trainable weights, their gradients (None after
    # zero_grad(set_to_none)) and the optimizer's state tensors (one AdamW over every adapter)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    state = [v for st in policy.trainer.optimizer.state.values() for v in st.values()]
    return {
        "case": name,
        "step_s": statistics.median(times),
        "steps_s": times,
        "trainable": trainable,
        "peak_rss_mb": peak_kb / 1024,
        "weights_mb": _mb(params),
        "grads_mb": _mb([p.grad for p in params]),
        "optimizer_mb": _mb(state),
    }


def _mb(tensors: list[Any]) -> float:
    import torch

    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t)) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # the child process's one case
    args = ap.parse_args()
    if args.case:
        print(json.dumps(_case(args.case, args.threads, args.reps)))
        return
    rows = []
    for name in ("shared", "4 agents", "shared", "4 agents"):  # interleaved, twice: load drifts alike
        out = subprocess.run(
            [sys.executable, __file__, "--case", name, "--threads", str(args.threads), "--reps", str(args.reps)],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        rows.append(json.loads(out.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{r['case']:>9}: step {r['step_s']:.2f} s (reps {', '.join(f'{t:.2f}' for t in r['steps_s'])}), "
              f"trainable {r['trainable']:,}, peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)  # fmt: skip
    shared = [r for r in rows if r["case"] == "shared"]
    four = [r for r in rows if r["case"] == "4 agents"]
    time_ratio = statistics.median(f["step_s"] for f in four) / statistics.median(s["step_s"] for s in shared)
    per_extra = (_held(four[0]) - _held(shared[0])) / 3
    one, opt = shared[0]["weights_mb"], shared[0]["optimizer_mb"]  # one adapter's weights and AdamW state
    print(f"update time, 4 adapters / 1: {time_ratio:.2f}x (target <= 1.15x)")
    print(
        f"held for training per extra adapter: {per_extra:.1f} MB (one adapter: weights {one:.1f} MB, "
        f"optimizer state {opt:.1f} MB; target <= {(one + opt) * 1.10:.1f} MB)"
    )
    rss = [statistics.median(r["peak_rss_mb"] for r in rs) for rs in (shared, four)]
    print(f"peak RSS: shared {rss[0]:.0f} MB, 4 adapters {rss[1]:.0f} MB")


def _held(r: dict[str, Any]) -> float:
    return r["weights_mb"] + r["grads_mb"] + r["optimizer_mb"]


if __name__ == "__main__":
    main()
