"""Shared-prefix updates (agl.algorithms.prefix_tree): one recorded training step of calc_agent's and
sql_agent's recipes, updated with and without sharing, against TRL's GRPOTrainer on the same sequences.

    python bench/prefix_sharing.py record calc      # demos -> agl sft -> one RL step (SmolLM2, CPU)
    python bench/prefix_sharing.py record sql
    python bench/prefix_sharing.py run --data calc sql --iters 2 --threads 2

``record`` runs the example's recipe as its README gives it, on the embedded SmolLM2-135M-Instruct:
calc_agent's warm-start recipe (oracle demonstrations through the unchanged agent, ``agl sft``, then
``train --warm-start``: 8 problems x 4 samples at temperature 0.8) and sql_agent's base-model recipe
(``train``: 2 questions x 8 samples at temperature 0.7), for one step each, and keeps the
transitions and advantages the trainer handed to the policy update at that step, in
``bench/data/prefix_sharing/<name>_step.jsonl.gz``.

``run`` replays each recorded step, each side in its own child process (so the peak RSS is its own),
sides alternating per iteration:

- ``shared``: ``PolicyUpdate.step`` as a run makes it (``share_prefixes=True``, the default);
- ``unshared``: the same with ``share_prefixes=False`` (every sequence runs whole);
- ``trl``: TRL's ``GRPOTrainer.training_step`` over the same sequences (merged conversations with
  TRL's ``tool_mask`` on non-model tokens), in the micro-batches ``unshared`` uses, gradients accumulated,
  then clip + optimizer step: the inner loop of ``GRPOTrainer.train()`` without generation.

Every side trains the same LoRA (r=16, all linear layers) on the base SmolLM2 weights with the recipe's
``micro_batch_tokens`` and no activation checkpointing (the recipes' ``--gradient-checkpointing off``).
Reported per side: tokens through the model per step (shared prefixes once), seconds per update step
(after one warm-up step on the first group), peak RSS.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DATA = ROOT / "bench" / "data" / "prefix_sharing"

#: each example's recipe (its README): demonstrations, the SFT warm start, one RL step's settings
RECIPES = {
    "calc": {
        "module": "examples.calc_agent",
        "demos": ["--split", "train", "-n", "64"],
        "agents": "solver",
        "train": ["--tasks-per-step", "8", "--group-size", "4", "--temperature", "0.8"],
    },
    # the base-model recipe (README: "defaults = the identical-credit run"): no warm start
    "sql": {
        "module": "examples.sql_agent",
        "demos": None,
        "train": ["--tasks-per-step", "2", "--group-size", "8", "--temperature", "0.7"],
    },
}
#: the recipes' update settings (both READMEs): LoRA r=16, lr 2e-4, no checkpointing, 1,024-token micro-batches
MICRO_BATCH_TOKENS = 1024
UPDATE_FLAGS = ["--max-tokens", "64", "--learning-rate", "2e-4", "--gradient-checkpointing", "off"]


# ------------------------------------------------------------------------------------------- record
def record(name: str, work: Path, seed: int) -> Path:
    """Demonstrations, warm start and one RL step of ``name``'s recipe; returns the recorded step."""
    recipe, py = RECIPES[name], sys.executable
    work.mkdir(parents=True, exist_ok=True)
    demos, sft = work / f"{name}_demos.db", work / f"{name}_sft"
    if recipe["demos"] is None:
        pass
    elif not demos.exists():
        _sh(
            [py, "-m", recipe["module"], "dev", "--oracle", *recipe["demos"], "--store", f"sqlite:///{demos}"]
        )
    if recipe["demos"] is not None and not (sft / "sft_summary.json").exists():
        _sh([py, "-m", "agl.cli", "sft", "--store", f"sqlite:///{demos}", "--agents", recipe["agents"],
             "--min-reward", "1", "--out", str(sft), "--epochs", "1", "--batch-size", "4",
             "--learning-rate", "5e-4", "--threads", "2"])  # fmt: skip
    out = DATA / f"{name}_step.jsonl.gz"
    _sh([py, __file__, "_rlstep", name, "--work", str(work), "--seed", str(seed), "--out", str(out)])
    return out


def _sh(argv: list[str]) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True, cwd=ROOT)


def rl_step(name: str, work: Path, seed: int, out: Path) -> None:
    """One ``train --warm-start`` step of the recipe, keeping what the trainer hands the update."""
    import importlib

    from agl.algorithms.update import PolicyUpdate

    step = PolicyUpdate.step
    kept: list[dict] = []

    def keep(self, transitions, advantages, **kw):
        metrics = step(self, transitions, advantages, **kw)
        if not kept:
            kept.append(
                {
                    "example": name,
                    "seed": seed,
                    "advantages": [float(a) for a in advantages],
                    "transitions": [t.model_dump(mode="json") for t in transitions],
                    "recorded_update": {k: v for k, v in metrics.items() if isinstance(v, float)},
                }
            )
        return metrics

    PolicyUpdate.step = keep
    cli = importlib.import_module(RECIPES[name]["module"] + ".cli")
    run_dir = work / f"{name}_rl"
    warm = ["--warm-start", str(work / f"{name}_sft")] if RECIPES[name]["demos"] is not None else []
    cli.main(["--threads", "2", "train", *warm, "--run-dir", str(run_dir),
              "--steps", "1", "--val-tasks", "0", "--no-val-before", "--runners", "16", "--seed", str(seed),
              "--micro-batch-tokens", str(MICRO_BATCH_TOKENS), *RECIPES[name]["train"], *UPDATE_FLAGS])  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt") as f:
        f.write(json.dumps(kept[0]) + "\n")
    print(f"recorded {len(kept[0]['transitions'])} transitions -> {out}")


def load_step(name: str) -> tuple[list, list[float], dict]:
    from agl.types import Transition

    with gzip.open(DATA / f"{name}_step.jsonl.gz", "rt") as f:
        rec = json.loads(f.readline())
    return [Transition.model_validate(t) for t in rec["transitions"]], rec["advantages"], rec


# ---------------------------------------------------------------------------------------------- run
def _policy(share: bool):
    from agl import LightningRL
    from agl.algorithms.update import PolicyUpdate
    from agl.gateway.models import prepare_default_model
    from agl.trainer.trainer import load_tokenizer

    algo = LightningRL(
        learning_rate=2e-4,
        lora_r=16,
        lora_alpha=32,
        micro_batch_tokens=MICRO_BATCH_TOKENS,
        gradient_checkpointing=False,
        share_prefixes=share,
    )
    return PolicyUpdate(
        str(prepare_default_model()), load_tokenizer(), algo, output_dir="/tmp/agl-bench-prefix"
    )


def _warmup_slice(transitions: list, advantages: list[float]) -> tuple[list, list[float]]:
    """The first group's transitions (one task's rollouts): a warm-up step that touches every code path."""
    gid = transitions[0].group_id
    keep = [i for i, t in enumerate(transitions) if t.group_id == gid]
    return [transitions[i] for i in keep], [advantages[i] for i in keep]


def side_agl(name: str, share: bool, iters: int) -> dict:
    ts, adv, _ = load_step(name)
    up = _policy(share)
    up.step(*_warmup_slice(ts, adv))
    runs = [up.step(ts, adv) for _ in range(iters)]
    m = runs[-1]
    return {
        "update_s": [r["update_s"] for r in runs],
        "tokens_flat": m["tokens_flat"],
        "tokens_packed": m["tokens_packed"],
        "micro_batches": m["micro_batches"],
        "sequences": m["sequences"],
        "response_tokens": m["response_tokens"],
        "loss": [r["loss"] for r in runs],
    }


def side_trl(name: str, iters: int) -> dict:
    """TRL's GRPOTrainer.training_step over agl's unshared micro-batches of the same sequences."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from agl.gateway.models import prepare_default_model
    from agl.trainer.trainer import load_tokenizer

    ts, adv, _ = load_step(name)
    flat = _policy(False)  # agl's plan and batch tensors, so both sides see the same micro-batches
    plan = flat._plan(ts, adv, True)
    batches = [flat._tensors(plan.seqs, mb, plan.token_adv, plan.train_masks) for mb in plan.mbs]
    n_resp = torch.tensor(float(plan.response_tokens))
    del flat
    tok = load_tokenizer()
    cfg = GRPOConfig(
        output_dir="/tmp/agl-bench-prefix/trl", report_to=[], learning_rate=2e-4, loss_type="dapo", beta=0.0,
        num_generations=2, per_device_train_batch_size=2, steps_per_generation=1, gradient_checkpointing=False,
        use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, lr_scheduler_type="constant",
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=str(prepare_default_model()),
        reward_funcs=lambda **k: [0.0],
        args=cfg,
        train_dataset=Dataset.from_list([{"prompt": ""}]),
        processing_class=tok,
        peft_config=LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        ),
    )
    model, _ = trainer._prepare_for_training(10**9, None, None)
    trainer._prepare_inputs = lambda x: x  # the batch is already what generation would have produced
    trainer.current_gradient_accumulation_steps = 1  # the DAPO normaliser below is the whole step's

    def one(items: list[dict]) -> float:
        t0 = time.perf_counter()
        for inputs in items:
            trainer.training_step(model, {**inputs, "num_items_in_batch": n_resp}, None)
        trainer.accelerator.clip_grad_norm_(model.parameters(), 1.0)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    one(batches[-1:])  # warm-up: the smallest micro-batch
    secs = [one(batches) for _ in range(iters)]
    return {"update_s": secs, "tokens_flat": float(plan.tokens), "tokens_packed": float(plan.tokens_packed),
            "micro_batches": float(len(plan.mbs))}  # fmt: skip


def _child(name: str, side: str, iters: int, threads: int) -> dict:
    argv = [sys.executable, __file__, "_side", name, side, "--iters", str(iters), "--threads", str(threads)]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        print(out.stderr[-3000:], file=sys.stderr)
        out.check_returncode()
    return json.loads(out.stdout.strip().splitlines()[-1])


def describe(name: str) -> str:
    """The recorded step's shape: calls, sequences, tokens, the prompt's share of a sequence."""
    from agl.adapter.trajectories import merge_transitions

    ts, adv, rec = load_step(name)
    seqs, _ = merge_transitions(ts)
    first = sum(len(s.prompt_ids) for s in seqs) / max(1, sum(s.tokens for s in seqs))
    groups = len({t.group_id for t in ts})
    trained = sum(1 for a in adv if a != 0.0)
    return (
        f"{name}: {len(ts)} calls ({trained} with a non-zero advantage) in {groups} groups, {len(seqs)} merged "
        f"sequences, {sum(s.tokens for s in seqs)} tokens; first prompts are {first:.0%} of the tokens"
    )


def run(names: list[str], iters: int, threads: int, sides: list[str]) -> None:
    load = os.getloadavg()
    print(f"load average before: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {threads} torch threads\n")
    for name in names:
        print(describe(name))
        res = {side: _child(name, side, iters, threads) for side in sides}
        base = res.get("unshared")
        print(
            f"\n| {name} | tokens through the model | micro-batches | s / update (each) | vs unshared | peak RSS |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for side, r in res.items():
            med = statistics.median(r["update_s"])
            tokens = r["tokens_packed"] if side == "shared" else r["tokens_flat"]
            ratio = f"{statistics.median(base['update_s']) / med:.2f}x" if base else "-"
            each = ", ".join(f"{s:.1f}" for s in r["update_s"])
            print(f"| {side} | {tokens:,.0f} | {r['micro_batches']:.0f} | {med:.1f} ({each}) | {ratio} | "
                  f"{r['peak_rss_mb'] / 1024:.2f} GB |")  # fmt: skip
        if "shared" in res:
            r = res["shared"]
            print(f"\ntokens: {r['tokens_flat']:,.0f} flat -> {r['tokens_packed']:,.0f} shared "
                  f"({r['tokens_flat'] / r['tokens_packed']:.2f}x fewer)")  # fmt: skip
        print()
    load = os.getloadavg()
    print(f"load average after: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="demos, warm start and one RL step of a recipe; keep the step")
    r.add_argument("name", choices=sorted(RECIPES))
    r.add_argument("--work", type=Path, default=Path("/tmp/agl-prefix-record"))
    r.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("_rlstep")
    s.add_argument("name")
    s.add_argument("--work", type=Path)
    s.add_argument("--seed", type=int)
    s.add_argument("--out", type=Path)
    b = sub.add_parser("run", help="replay the recorded steps: shared, unshared, TRL")
    b.add_argument("--data", nargs="+", default=sorted(RECIPES))
    b.add_argument("--sides", nargs="+", default=["shared", "unshared", "trl"])
    b.add_argument("--iters", type=int, default=2)
    b.add_argument("--threads", type=int, default=2)
    c = sub.add_parser("_side")
    c.add_argument("name")
    c.add_argument("side")
    c.add_argument("--iters", type=int)
    c.add_argument("--threads", type=int)
    args = p.parse_args()
    if args.cmd == "record":
        record(args.name, args.work, args.seed)
    elif args.cmd == "_rlstep":
        rl_step(args.name, args.work, args.seed, args.out)
    elif args.cmd == "run":
        run(args.data, args.iters, args.threads, args.sides)
    else:
        import torch

        torch.set_num_threads(args.threads)
        out = (
            side_trl(args.name, args.iters)
            if args.side == "trl"
            else side_agl(args.name, args.side == "shared", args.iters)
        )
        out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(out))


if __name__ == "__main__":
    main()
