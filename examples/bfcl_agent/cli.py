"""``python -m examples.bfcl_agent dev|train|data|eval``: run the agent, train it, print the split, or
score a BFCL category in BFCL's terms. See README.md for what each prints and the figures measured."""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from examples._cli import (
    example_parser,
    fit,
    lightning_rl,
    oracle_backend,
)

__all__ = ["dev", "evaluate", "main", "parser", "train"]


def parser() -> argparse.ArgumentParser:
    p, sub = example_parser(
        "bfcl_agent",
        __doc__,
        train_help="train the caller with LightningRL (after an `agl sft` warm start)",
        data_help="print the split's sizes and a few cases",
        item="cases",
        train_defaults={
            "steps": 8, "val_tasks": 40, "val_every": 4, "learning_rate": 2e-4, "micro_batch_tokens": 2048,
            "max_tokens": 96,
        },
    )  # fmt: skip
    e = sub.add_parser("eval", help="BFCL accuracy of one category: a table and one JSON line")
    e.add_argument("--category", required=True, help="a BFCL category (simple_python, multi_turn_base, ...)")
    e.add_argument("--split", choices=["test", "train", "all"], default="test", help="held-out by default")
    e.add_argument("--limit", type=int, default=None, help="the first N cases only")
    e.add_argument("--model", default=None, help="a local model folder (e.g. an `agl sft` run's model/)")
    e.add_argument("--adapter", default=None, help="a peft LoRA adapter folder, on --model or SmolLM2")
    e.add_argument(
        "--backend",
        choices=["transformers", "scripted"],
        default="transformers",
        help="scripted: scripted.py",
    )
    e.add_argument("--base-url", default=None, help="any OpenAI-compatible endpoint instead")
    e.add_argument("--model-name", default=None, help="the model's name at --base-url")
    e.add_argument("--max-tokens", type=int, default=128)
    e.add_argument("--runners", type=int, default=4)
    e.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def _check_dir(flag: str, path: str | None) -> None:
    if path is not None and not Path(path).is_dir():
        raise SystemExit(f"{flag} {path}: no such folder")


def _load_adapter(base: str | None, adapter: str) -> tuple[Any, Any]:
    """The base model (``base`` or the embedded SmolLM2) with the LoRA adapter in ``adapter`` merged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agl.chat.models import default_model_dir

    path = base or str(default_model_dir())
    model = AutoModelForCausalLM.from_pretrained(path)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload(), AutoTokenizer.from_pretrained(path)


def _errors(store: Any) -> dict[str, tuple[str | None, int]]:
    """``{case id: (BFCL error_type, calls made)}`` from the ``agl.object`` spans the rollouts emitted."""
    from agl import semconv as sc

    out: dict[str, tuple[str | None, int]] = {}
    for span in store.query_spans():
        if span.name == sc.SPAN_OBJECT:
            body = json.loads(span.attributes.get(sc.AGL_OBJECT_JSON, "{}"))
            if isinstance(body, dict) and "bfcl_id" in body:
                out[body["bfcl_id"]] = (body.get("bfcl_error"), int(body.get("calls", 0)))
    return out


def summarise(category: str, tasks: list[dict[str, Any]], errors: dict[str, Any]) -> dict[str, Any]:
    """The eval's JSON line: ``category``, ``n``, ``accuracy``, failure kinds (reward.KINDS) and the
    checker's raw ``error_types``. A case without a recorded verdict (its rollout failed) is wrong."""
    from examples.bfcl_agent.reward import kind_of

    verdicts = [errors.get(t["id"], ("rollout_failed", 0)) for t in tasks]
    kinds: Counter[str] = Counter(kind_of(e, n) or "" for e, n in verdicts if e)
    correct = sum(1 for e, _ in verdicts if e is None)
    return {
        "category": category,
        "n": len(tasks),
        "accuracy": round(correct / len(tasks), 4) if tasks else 0.0,
        "failures": dict(sorted(kinds.items())),
        "error_types": dict(sorted(Counter(e for e, _ in verdicts if e).items())),
    }


def _table(s: dict[str, Any]) -> str:
    lines = [f"BFCL {s['category']}: {s['n']} cases, accuracy {s['accuracy']:.3f}", "failure kind | cases"]
    lines += [f"{k} | {v}" for k, v in s["failures"].items()]
    return "\n".join(lines)


def evaluate(args: argparse.Namespace, **trainer_kw: Any) -> dict[str, Any]:
    """Greedy BFCL accuracy of ``args.category``: every case once, scored by BFCL's checker."""
    import agl.store
    from agl import RunConfig, Serving, Trainer
    from examples.bfcl_agent import bfcl, data
    from examples.bfcl_agent.agent import AGENT, make_rollout

    try:
        data.check_category(args.category)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    _check_dir("--model", args.model)
    _check_dir("--adapter", args.adapter)
    reason = bfcl.unavailable()
    if reason:
        raise SystemExit(reason)
    split = args.split if args.category in data.SPLIT_CATEGORIES else "all"
    tasks = [{**t, "temperature": 0.0} for t in data.load_tasks(split, [args.category], limit=args.limit)]
    model, tokenizer = _load_adapter(args.model, args.adapter) if args.adapter else (args.model, None)
    store = trainer_kw.pop("store", None) or agl.store.open("memory://")
    if args.backend == "scripted":
        from examples.bfcl_agent.scripted import ScriptedBFCL

        trainer_kw.setdefault("script", ScriptedBFCL())
    serving = Serving(
        model=model if args.base_url is None else None,
        tokenizer=tokenizer,
        backend="openai" if args.base_url else args.backend,
        base_url=args.base_url,
        model_name=args.model_name,
        store=store,
        runners=min(len(tasks), args.runners),
        **{"progress": args.progress, **trainer_kw},
    )
    config = RunConfig(max_tokens=args.max_tokens, temperature=0.0)
    trainer = Trainer(serving=serving, config=config, agents=[AGENT])
    trainer.dev(make_rollout(), tasks, show=False)
    summary = summarise(args.category, tasks, _errors(store))
    print(_table(summary))
    print(json.dumps(summary))
    return summary


def dev(
    args: argparse.Namespace, *, model: Any = None, tokenizer: Any = None, script: Any = None, **kw: Any
) -> Any:
    from agl import RunConfig, Serving, Trainer
    from examples.bfcl_agent import data
    from examples.bfcl_agent.agent import AGENT, make_rollout

    tasks = data.load_tasks(args.split, limit=args.tasks)
    oracle_backend(args)
    if args.backend == "scripted" and script is None:
        from examples.bfcl_agent.scripted import ScriptedBFCL

        script = ScriptedBFCL(oracle=args.oracle)
    if args.store is not None:
        kw.setdefault("store", args.store)
    is_path = args.model is not None and os.path.isdir(args.model)
    serving = Serving(
        model=model if model is not None else (args.model if is_path else None),
        tokenizer=tokenizer,
        backend=args.backend,
        script=script,
        runners=min(len(tasks), 4),
        progress=False,
        **kw,
    )
    config = RunConfig(max_tokens=args.max_tokens, temperature=args.temperature)
    trainer = Trainer(serving=serving, config=config, agents=[AGENT])
    return trainer.dev(
        make_rollout(),
        tasks,
        base_url=args.base_url,
        model=None if is_path else args.model,
        api_key=args.api_key or (os.environ.get("OPENAI_API_KEY") if args.base_url else None),
    )


def train(args: argparse.Namespace, *, model: Any = None, tokenizer: Any = None, **trainer_kw: Any) -> Any:
    from examples.bfcl_agent import data
    from examples.bfcl_agent.agent import AGENT, make_rollout

    val = data.load_tasks("test", limit=args.val_tasks) if args.val_tasks else None
    return fit(
        args,
        trainer_kw,
        algorithm=lightning_rl(args),
        agents=[AGENT],
        rollout=make_rollout(),
        train_tasks=data.load_tasks("train"),
        val_tasks=val,
        model=model,
        tokenizer=tokenizer,
    )


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parser().parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.command == "data":
        from examples.bfcl_agent import data

        for split in ("train", "test"):
            tasks = data.load_tasks(split)
            print(
                f"{split}: {len(tasks)} cases, "
                + ", ".join(f"{c} {n}" for c, n in Counter(t["category"] for t in tasks).items())
            )
        for task in data.load_tasks("test", limit=3):
            print(json.dumps({k: task[k] for k in ("id", "category", "question")}))
    elif args.command == "eval":
        evaluate(args)
    elif args.command == "dev":
        dev(args)
    else:
        train(args)
    return 0
