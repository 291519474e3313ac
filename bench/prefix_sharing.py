"""Shared-prefix updates (agl.algorithms.prefix_tree): one recorded training step of calc_agent's and
sql_agent's recipes, updated with and without sharing, against TRL's GRPOTrainer on the same sequences.

    python bench/prefix_sharing.py record calc      # demos -> agl sft -> one RL step (SmolLM2, CPU)
    python bench/prefix_sharing.py record sql
    python bench/prefix_sharing.py run --data calc sql sql-base --rounds 3 --threads 2

``record`` runs the example's recipe as its README gives it, on the embedded SmolLM2-135M-Instruct:
calc_agent's and sql_agent's warm-start recipes (64 oracle demonstrations through the unchanged
agent, ``agl sft``, then ``train --warm-start``: 8 problems x 4 samples at temperature 0.8, and 6
questions x 4 samples at temperature 1.0) and sql_agent's base-model recipe (``sql-base``: ``train``,
2 questions x 8 samples at temperature 0.7), for one step each, and keeps the
transitions and advantages the trainer handed to the policy update at that step, in
``bench/data/prefix_sharing/<name>_step.jsonl.gz``.

``run`` replays each recorded step, each side in its own child process (so the peak RSS is its own),
the sides one after another in each of ``--rounds`` rounds (so a change of machine load falls on all
alike), with the recorded advantages and with every call trained:

- ``shared``: ``PolicyUpdate.step`` as a run makes it (``share_prefixes=True``, the default);
- ``unshared``: the same with ``share_prefixes=False`` (every sequence runs whole);
- ``trl``: TRL's ``GRPOTrainer.training_step`` over the same sequences (merged conversations with
  TRL's ``tool_mask`` on non-model tokens), in the micro-batches ``unshared`` uses, gradients accumulated,
  then clip + optimizer step: the inner loop of ``GRPOTrainer.train()`` without generation.

Every side trains the same LoRA (r=16, all linear layers) on the base SmolLM2 weights with the recipe's
``micro_batch_tokens`` and no activation checkpointing (the recipes' ``--gradient-checkpointing off``).
Reported per side: tokens through the model per step (shared prefixes once), wall and CPU seconds per
update step (medians over the rounds, each after a warm-up step on the first group; on a shared
machine the CPU seconds are the steadier measure of work), peak RSS.
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
    "sql": {
        "module": "examples.sql_agent",
        "demos": ["--split", "train", "-n", "64"],
        "agents": "writer,rewriter",
        "train": ["--tasks-per-step", "6", "--group-size", "4", "--temperature", "1.0"],
    },
    # sql_agent's base-model recipe (README: "defaults = the identical-credit run"): no warm start
    "sql-base": {
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


def load_step(name: str, every_call: bool = False, groups: int = 0) -> tuple[list, list[float], dict]:
    """The recorded step: its transitions, advantages and record. ``every_call``: advantages +1/-1 by
    rollout in turn instead of the recorded ones, so every call trains (a step in which every group
    has reward variance; the recorded step trains only the groups that had some). ``groups``: only the
    first that many groups (tasks) of the step, for a shorter run on a busy machine (0: all)."""
    from agl.types import Transition

    with gzip.open(DATA / f"{name}_step.jsonl.gz", "rt") as f:
        rec = json.loads(f.readline())
    ts = [Transition.model_validate(t) for t in rec["transitions"]]
    adv = rec["advantages"]
    if groups:
        first = list(dict.fromkeys(t.group_id for t in ts))[:groups]
        keep = [i for i, t in enumerate(ts) if t.group_id in first]
        ts, adv = [ts[i] for i in keep], [adv[i] for i in keep]
    if every_call:
        rollouts = sorted({t.rollout_id for t in ts})
        adv = [1.0 if rollouts.index(t.rollout_id) % 2 == 0 else -1.0 for t in ts]
    return ts, adv, rec


# ---------------------------------------------------------------------------------------------- run
def _policy(share: bool):
    from agl import LightningRL
    from agl.algorithms.update import PolicyUpdate
    from agl.chat.models import prepare_default_model
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


def side_agl(name: str, share: bool, iters: int, every_call: bool, groups: int = 0) -> dict:
    ts, adv, _ = load_step(name, every_call, groups)
    up = _policy(share)
    up.step(*_warmup_slice(ts, adv))
    runs, cpu = [], []
    for _ in range(iters):
        c0 = time.process_time()
        runs.append(up.step(ts, adv))
        cpu.append(time.process_time() - c0)
    m = runs[-1]
    return {
        "update_s": [r["update_s"] for r in runs],
        "cpu_s": cpu,
        "tokens_flat": m["tokens_flat"],
        "tokens_packed": m["tokens_packed"],
        "micro_batches": m["micro_batches"],
        "sequences": m["sequences"],
        "response_tokens": m["response_tokens"],
        "loss": [r["loss"] for r in runs],
    }


def side_trl(name: str, iters: int, every_call: bool, groups: int = 0) -> dict:
    """TRL's GRPOTrainer.training_step over agl's unshared micro-batches of the same sequences."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from agl.chat.models import prepare_default_model
    from agl.trainer.trainer import load_tokenizer

    ts, adv, _ = load_step(name, every_call, groups)
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

    def one(items: list[dict]) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        for inputs in items:
            trainer.training_step(model, {**inputs, "num_items_in_batch": n_resp}, None)
        trainer.accelerator.clip_grad_norm_(model.parameters(), 1.0)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, time.process_time() - c0

    one(batches[-1:])  # warm-up: the smallest micro-batch
    secs = [one(batches) for _ in range(iters)]
    return {"update_s": [w for w, _ in secs], "cpu_s": [c for _, c in secs], "tokens_flat": float(plan.tokens),
            "tokens_packed": float(plan.tokens_packed), "micro_batches": float(len(plan.mbs))}  # fmt: skip


def _child(
    name: str, side: str, iters: int, threads: int, every_call: bool, malloc: str = "glibc", groups: int = 0
) -> dict:
    argv = [sys.executable, __file__, "_side", name, side, "--iters", str(iters), "--threads", str(threads)]
    argv += (["--every-call"] if every_call else []) + ["--malloc", malloc, "--groups", str(groups)]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        print(out.stderr[-3000:], file=sys.stderr)
        out.check_returncode()
    return json.loads(out.stdout.strip().splitlines()[-1])


def describe(name: str, every_call: bool, groups: int = 0) -> str:
    """The recorded step's shape: calls, sequences, tokens, the prompt's share of a sequence."""
    from agl.adapter.trajectories import merge_transitions

    ts, adv, rec = load_step(name, every_call, groups)
    seqs, _ = merge_transitions(ts)
    first = sum(len(s.prompt_ids) for s in seqs) / max(1, sum(s.tokens for s in seqs))
    groups = len({t.group_id for t in ts})
    trained = sum(1 for a in adv if a != 0.0)
    return (
        f"{name}: {len(ts)} calls ({trained} with a non-zero advantage) in {groups} groups, {len(seqs)} merged "
        f"sequences, {sum(s.tokens for s in seqs)} tokens; first prompts are {first:.0%} of the tokens"
    )


def run(
    names: list[str],
    rounds: int,
    threads: int,
    sides: list[str],
    every_call: list[bool],
    malloc: str,
    groups: int = 0,
) -> None:
    """Each case: ``rounds`` rounds, each running every side once in a fresh child, one after another,
    so that a change of machine load falls on all sides alike; medians over the rounds."""
    from tqdm import tqdm

    for name, every in ((n, e) for n in names for e in every_call):
        label = f"{name}{f' (first {groups} groups)' if groups else ''}, "
        label += "every call trained" if every else "recorded advantages"
        print(describe(name, every, groups), flush=True)
        res: dict[str, dict] = {}
        loads = [os.getloadavg()[0]]
        bar = tqdm(total=rounds * len(sides), desc=label, unit="side", file=sys.stderr)
        for k in range(rounds):
            for side in sides[::-1] if k % 2 else sides:  # odd rounds run the sides in reverse order
                bar.set_postfix_str(f"round {k + 1}: {side}")
                r = _child(name, side, 1, threads, every, malloc, groups)
                loads.append(os.getloadavg()[0])
                bar.write(json.dumps({"case": label, "round": k + 1, "side": side, "load": loads[-1], **r}))
                bar.update()
                if side in res:
                    for key in ("update_s", "cpu_s"):
                        res[side][key] += r[key]
                    res[side]["peak_rss_mb"] = max(res[side]["peak_rss_mb"], r["peak_rss_mb"])
                else:
                    res[side] = r
        bar.close()
        _table(label, res)
        print(
            f"load average (1 min) over the case: {min(loads):.1f}-{max(loads):.1f}; {threads} torch threads; "
            f"malloc: {malloc}\n"
        )


def _table(label: str, res: dict[str, dict]) -> None:
    base = res.get("unshared")
    print(f"\n| {label} | tokens through the model | micro-batches | s / update | CPU s / update | "
          "wall vs unshared | CPU vs unshared | peak RSS |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for side, r in res.items():
        wall, cpu = statistics.median(r["update_s"]), statistics.median(r["cpu_s"])
        tokens = r["tokens_packed"] if side == "shared" else r["tokens_flat"]
        vs = (
            (f"{statistics.median(base['update_s']) / wall:.2f}x", f"{statistics.median(base['cpu_s']) / cpu:.2f}x")
            if base else ("-", "-")
        )  # fmt: skip
        walls = ", ".join(f"{x:.1f}" for x in r["update_s"])
        print(f"| {side} | {tokens:,.0f} | {r['micro_batches']:.0f} | {wall:.1f} ({walls}) | {cpu:.1f} | {vs[0]} | "
              f"{vs[1]} | {r['peak_rss_mb'] / 1024:.2f} GB |")  # fmt: skip
    if "shared" in res and "unshared" in res:
        print(
            f"\nfirst-step losses: shared {res['shared']['loss'][0]:.7f}, unshared {res['unshared']['loss'][0]:.7f}"
        )
    if "shared" in res:
        r = res["shared"]
        print(f"tokens: {r['tokens_flat']:,.0f} unshared -> {r['tokens_packed']:,.0f} shared "
              f"({r['tokens_flat'] / r['tokens_packed']:.2f}x fewer)", flush=True)  # fmt: skip


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
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument(
        "--malloc",
        choices=["glibc", "tune"],
        default="glibc",
        help="tune: agl.trainer.malloc.tune() in each child, as Trainer.fit does (default: glibc's own)",
    )
    b.add_argument("--groups", type=int, default=0, help="only the step's first N groups (0: all)")
    b.add_argument(
        "--advantages", nargs="+", choices=["recorded", "every-call"], default=["recorded", "every-call"]
    )
    c = sub.add_parser("_side")
    c.add_argument("name")
    c.add_argument("side")
    c.add_argument("--iters", type=int)
    c.add_argument("--threads", type=int)
    c.add_argument("--every-call", action="store_true")
    c.add_argument("--malloc", default="glibc")
    c.add_argument("--groups", type=int, default=0)
    args = p.parse_args()
    if args.cmd == "record":
        record(args.name, args.work, args.seed)
    elif args.cmd == "_rlstep":
        rl_step(args.name, args.work, args.seed, args.out)
    elif args.cmd == "run":
        run(
            args.data,
            args.rounds,
            args.threads,
            args.sides,
            [a == "every-call" for a in args.advantages],
            args.malloc,
            args.groups,
        )
    else:
        import torch

        if args.malloc == "tune":
            from agl.trainer.malloc import tune

            tune()
        torch.set_num_threads(args.threads)
        if args.side == "trl":
            out = side_trl(args.name, args.iters, args.every_call, args.groups)
        else:
            out = side_agl(args.name, args.side == "shared", args.iters, args.every_call, args.groups)
        out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(out))


if __name__ == "__main__":
    main()
