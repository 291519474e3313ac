"""Supervised warm start (``agl.SFT``, ``agl sft``): train the policy on demonstrations from a store.

A small model that never makes a tool call gives every GRPO group zero reward variance, so RL has
nothing to reinforce. The practitioners' fix (DeepSeek-R1's cold start, ART's and rLLM's SFT) is a
supervised warm start on demonstrations, then RL. Here demonstrations are ordinary rollouts — the
unchanged agent run against a teacher (an example's oracle, ``dev --oracle``, or any OpenAI-compatible
endpoint through the gateway, ``dev --base-url``) — so their data path is the same as RL's.

What is trained on, and why:

- each selected transition's **recorded token ids**: the prompt exactly as the gateway rendered it for
  the model (chat template, tools schema, earlier tool calls in the model's own format) and the response
  ids it produced or was scripted to produce, end-of-turn token included. The loss covers the response
  tokens only (TRL's ``completion_mask``). Re-rendering messages with another template would teach a
  format the gateway never shows the model;
- selection by agent (the adapter's ``agents``), by final reward (``min_reward``) and, with
  ``best_of_group``, only the best rollout of each group (the first on ties) — rejection sampling
  from a teacher that is sometimes wrong;
- with ``merge_turns`` (the default, as in LightningRL's update) each agent conversation whose calls
  extend one another exactly is **one sequence** (:func:`agl.adapter.trajectories.merge_transitions`): the
  shared history is encoded once, tool results and later user turns are context (mask 0), every
  response is trained on with the context it was produced in. A multi-call agent's demonstrations
  then cost 1.7–2.4× fewer tokens (the examples' merge rates), with the same per-token loss.

Conventions shared with LightningRL: LoRA on all linear layers (``lora_r``/``lora_alpha``, no
dropout), TRL checkpoints under ``run_dir/checkpoints/checkpoint-<step>`` (adapter, optimizer,
scheduler, trainer state), metrics in ``run_dir/metrics.jsonl`` (and TensorBoard under ``run_dir/tb``).
In addition the LoRA deltas are merged into a plain model saved with its tokenizer in
``run_dir/model``: that is what the gateway's transformers backend loads (``agl gateway serve --model
run_dir/model``) and what RL continues from (``Trainer(model=warm_start_model(run_dir))``, the
examples' ``train --warm-start run_dir``), with a fresh LoRA on top.

An adapter per agent (``adapter_per_agent=True`` with ``agents=["writer", "rewriter"]``, ``agl sft
--adapter-per-agent``): each agent's demonstrations train a LoRA adapter of its own on the unchanged
base model (one TRL run per agent, each its own optimizer), saved as a peft adapter folder
``run_dir/adapters/<adapter>/``; nothing is merged (one base model serves every adapter). RL continues
from them with ``Trainer(agents=..., loop=LoopConfig(adapter_per_agent=True, warm_adapters=run_dir))`` (the examples'
``train --adapter-per-agent --warm-start run_dir``), and ``agl gateway serve --adapter
writer=run_dir/adapters/writer`` serves them.

torch, transformers, TRL and peft are imported only when training starts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from agl.algorithms.per_agent_lora import warm_adapters_dir
from agl.errors import UsageError
from agl.types import Transition

__all__ = ["SFT", "select_transitions", "warm_adapters_dir", "warm_start_model"]

log = logging.getLogger("agl.sft")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class SFT:
    """Supervised fine-tuning on selected transitions (the warm start before LightningRL).

    Selection: ``min_reward`` (keep rollouts whose final reward is at least this; None keeps all) and
    ``best_of_group`` (keep only each group's best rollout). Agents are chosen when the transitions are
    read (``fit(store, agents=...)`` or ``Adapter(agents=...)``). Optimisation: ``epochs`` over the
    data, ``batch_size`` sequences per optimizer step, ``learning_rate`` (constant after
    ``warmup_ratio``), LoRA as in :class:`~agl.algorithms.lightning_rl.LightningRL`, or full
    fine-tuning with ``lora=False``.
    """

    min_reward: float | None = field(
        default=None, metadata=_help("keep rollouts whose final reward is >= this (None: all)")
    )
    best_of_group: bool = field(default=False, metadata=_help("keep only the best rollout of each group"))
    drop_penalised: bool = field(
        default=True,
        metadata=_help(
            "leave out calls with a negative intermediate reward (AIR: the call wrote a failing tool call): "
            "a demonstration of a repair teaches the fix, not the mistake"
        ),
    )
    epochs: int = field(default=2, metadata=_help("passes over the demonstrations"))
    batch_size: int = field(default=4, metadata=_help("sequences per optimizer step"))
    learning_rate: float = field(default=2e-4, metadata=_help("the learning rate (constant after warm-up)"))
    warmup_ratio: float = field(
        default=0.0, metadata=_help("fraction of the optimizer steps the learning rate warms up over")
    )
    lora: bool = field(default=True, metadata=_help("train a LoRA adapter (False: full fine-tuning)"))
    lora_r: int = field(default=16, metadata=_help("LoRA rank"))
    lora_alpha: int = field(default=32, metadata=_help("LoRA alpha"))
    max_grad_norm: float = field(default=1.0, metadata=_help("gradient clipping norm"))
    precision: Literal["auto", "fp32", "bf16"] = field(
        default="auto",
        metadata=_help(
            "auto: bf16 on a GPU that has it, fp32 on a CPU; bf16: bf16 autocast on a CPU too (x1.5 on "
            "a CPU with AMX or AVX512-BF16, far slower without); fp32: never bf16"
        ),
    )
    max_length: int | None = field(
        default=None, metadata=_help("truncate longer sequences (prompt start first)")
    )
    eval_examples: int = field(
        default=16, metadata=_help("demonstrations whose loss is measured before and after")
    )
    merge_turns: bool = field(
        default=True,
        metadata=_help("one sequence per agent conversation (False: one per LLM call)"),
    )
    adapter_per_agent: bool = field(
        default=False,
        metadata=_help("train one LoRA adapter per agent named in agents (run_dir/adapters/<name>)"),
    )

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "lora_r", "lora_alpha", "eval_examples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"SFT.{name} must be an integer >= 1, got {value!r}")
        for name, lo_open in (("learning_rate", True), ("max_grad_norm", True), ("warmup_ratio", False)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UsageError(f"SFT.{name} must be a finite number, got {value!r}")
            if value < 0 or (lo_open and value == 0):
                raise UsageError(f"SFT.{name} must be {'> 0' if lo_open else '>= 0'}, got {value!r}")
        if self.adapter_per_agent and not self.lora:
            raise UsageError("SFT.adapter_per_agent trains a LoRA adapter per agent: it needs lora=True")
        if self.warmup_ratio >= 1:
            raise UsageError(f"SFT.warmup_ratio must be < 1, got {self.warmup_ratio!r}")
        if self.min_reward is not None and (
            isinstance(self.min_reward, bool)
            or not isinstance(self.min_reward, (int, float))
            or not math.isfinite(self.min_reward)
        ):
            raise UsageError(f"SFT.min_reward must be a finite number or None, got {self.min_reward!r}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise UsageError(f"SFT.precision must be 'auto', 'fp32' or 'bf16', got {self.precision!r}")
        if self.max_length is not None and (
            isinstance(self.max_length, bool) or not isinstance(self.max_length, int) or self.max_length < 2
        ):
            raise UsageError(f"SFT.max_length must be an integer >= 2 or None, got {self.max_length!r}")
        for name in ("best_of_group", "drop_penalised", "lora", "merge_turns", "adapter_per_agent"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"SFT.{name} must be True or False, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # ------------------------------------------------------------------------------ data
    def select(self, transitions: Sequence[Transition]) -> list[Transition]:
        """The transitions to train on (see :func:`select_transitions`)."""
        return select_transitions(
            transitions,
            min_reward=self.min_reward,
            best_of_group=self.best_of_group,
            drop_penalised=self.drop_penalised,
        )

    def read(
        self,
        store: Any,
        *,
        agents: Any = None,
        mode: str | None = None,
        rollout_ids: Sequence[str] | None = None,
        tokenizer: Any = None,
        progress: bool = False,
    ) -> list[Transition]:
        """Every finished rollout's transitions of ``agents`` in ``store`` (or of ``rollout_ids``)."""
        from agl.adapter import Adapter, finishing_attempt

        if isinstance(store, str):
            import agl.store

            store = agl.store.open(store)
        if rollout_ids is None:
            rollouts = store.query_rollouts(status=["succeeded", "failed"], mode=mode)
            rollout_ids = [r.id for r in rollouts if finishing_attempt(r) is not None]
        adapter = Adapter(agents=agents, tokenizer=tokenizer)
        return adapter.from_store(store, rollout_ids, progress=progress)

    # ------------------------------------------------------------------------------ training
    def fit(
        self,
        data: Any,
        model: Any = None,
        *,
        tokenizer: Any = None,
        run_dir: str | os.PathLike[str] = "runs/sft",
        agents: Any = None,
        mode: str | None = None,
        seed: int = 0,
        merge: bool = True,
        progress: bool = True,
    ) -> dict[str, Any]:
        """Train ``model`` (a local path, a loaded model, or None for the embedded SmolLM2-135M) on
        ``data`` — a store (or its URL), or transitions — and save it under ``run_dir``.

        Returns a summary: ``examples``, ``rollouts``, ``response_tokens``, ``loss_before`` and
        ``loss_after`` (mean response-token NLL on up to ``eval_examples`` of the training demonstrations,
        spread over them), ``steps``,
        ``seconds``, ``checkpoint`` and ``model_dir`` (the merged model, when ``merge``).
        """
        if isinstance(data, (str, os.PathLike)) or hasattr(data, "query_rollouts"):
            transitions = self.read(data, agents=agents, mode=mode, progress=progress)
        else:
            transitions = list(data)
            if agents is not None and not self.adapter_per_agent:  # per agent: each adapter takes its own
                from agl.adapter import agent_matcher

                match = agent_matcher(agents)
                transitions = [t for t in transitions if match(t.agent)]
        chosen = self.select(transitions)
        rows = [t for t in chosen if t.response_ids]
        if self.adapter_per_agent:
            return _train_per_agent(self, rows, model, tokenizer, Path(run_dir), seed, agents, progress)
        if not rows:
            raise UsageError(
                f"no demonstrations to train on: {len(transitions)} transitions read, none left after "
                f"selection (min_reward={self.min_reward}, best_of_group={self.best_of_group}, "
                f"drop_penalised={self.drop_penalised}"
                + (f", agents={agents!r}" if agents is not None else "")
                + ")"
            )
        return _train(self, rows, model, tokenizer, Path(run_dir), seed, merge, progress)


def select_transitions(
    transitions: Sequence[Transition],
    *,
    min_reward: float | None = None,
    best_of_group: bool = False,
    drop_penalised: bool = False,
) -> list[Transition]:
    """Transitions of the rollouts whose final reward is at least ``min_reward``; with
    ``best_of_group``, only those of the best rollout in each group (the first of equals, in input
    order; rollouts without a group are their own group); with ``drop_penalised``, without the calls
    whose intermediate reward is negative (AIR's penalty on a call that wrote a failing tool call: in
    a rollout rescued by a repair agent the broken call is not a demonstration). Order is kept."""
    by_rollout: dict[tuple[str, int], list[Transition]] = {}
    for t in transitions:
        by_rollout.setdefault((t.rollout_id, t.attempt), []).append(t)
    keep = [k for k, ts in by_rollout.items() if min_reward is None or ts[0].final_reward >= min_reward]
    if best_of_group:
        best: dict[str, tuple[str, int]] = {}
        for k in keep:
            ts = by_rollout[k]
            gid = ts[0].group_id or f"rollout:{k[0]}"
            cur = best.get(gid)
            if cur is None or ts[0].final_reward > by_rollout[cur][0].final_reward:
                best[gid] = k
        keep = list(best.values())
    kept = set(keep)
    return [
        t
        for t in transitions
        if (t.rollout_id, t.attempt) in kept and not (drop_penalised and t.intermediate_reward < 0)
    ]


def warm_start_model(path: str | os.PathLike[str]) -> Path:
    """The merged model of an ``agl sft`` run directory (``run_dir/model``), or ``path`` itself when it
    is a model directory; a clear error otherwise."""
    p = Path(path)
    for candidate in (p / "model", p):
        if (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"{p} is not an agl sft output nor a model directory (no model/config.json or config.json); "
        "run `agl sft ... --out DIR` first"
    )


# ------------------------------------------------------------------------------------ training


def _sequences(rows: Sequence[Transition], merge_turns: bool) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prompt, completion, completion_mask)`` per training sequence: one per agent conversation with
    ``merge_turns`` (responses masked 1, the context between them 0), else one per call."""
    if not merge_turns:
        return [(list(t.prompt_ids), list(t.response_ids), [1] * len(t.response_ids)) for t in rows]
    from agl.adapter.trajectories import merge_transitions

    trajectories, _ = merge_transitions(rows)
    return [(list(tr.prompt_ids), list(tr.completion_ids), list(tr.loss_mask)) for tr in trajectories]


def _dataset(
    seqs: Sequence[tuple[list[int], list[int], list[int]]], max_length: int | None
) -> tuple[Any, int]:
    """``input_ids`` = prompt + completion ids as recorded, ``completion_mask`` marks the model's own
    response tokens. Over-long rows keep their completion and lose the start of the prompt (what the
    model sees last); a completion longer than ``max_length`` keeps its start."""
    from datasets import Dataset

    records = []
    n_resp = 0
    for prompt, comp, mask in seqs:
        if max_length is not None and len(prompt) + len(comp) > max_length:
            if len(comp) >= max_length:
                comp, mask = comp[: max_length - 1], mask[: max_length - 1]
            prompt = prompt[len(prompt) - (max_length - len(comp)) :]
        n_resp += sum(mask)
        records.append({"input_ids": prompt + comp, "completion_mask": [0] * len(prompt) + mask})
    return Dataset.from_list(records), n_resp


def _load(model: Any, tokenizer: Any, progress: bool) -> tuple[Any, Any, str | None]:
    from transformers import AutoModelForCausalLM

    from agl.chat.tokenizer import load_tokenizer

    source: str | None = None
    if model is None:
        from agl.chat.models import prepare_default_model

        model = str(prepare_default_model(progress=progress))
    if isinstance(model, (str, os.PathLike)):
        source = str(model)
        model = AutoModelForCausalLM.from_pretrained(source, dtype="float32")
    tok = tokenizer if tokenizer is not None else load_tokenizer(source if source is not None else model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok, source


def _log_callback(cfg: SFT, metrics: Any) -> Any:
    """A transformers callback writing each logged step's loss to the run's ``MetricsLog``."""
    from transformers import TrainerCallback

    class _Log(TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            logs = dict(logs or {})
            if "loss" not in logs:
                return
            metrics.write(
                {
                    "step": int(state.global_step),
                    "sft_loss": float(logs["loss"]),
                    "learning_rate": float(logs.get("learning_rate", cfg.learning_rate)),
                    "grad_norm": float(logs["grad_norm"]) if logs.get("grad_norm") is not None else None,
                    "epoch": float(logs.get("epoch", 0.0)),
                }
            )

    return _Log()


def _use_bf16(precision: str, use_cuda: bool) -> bool:
    """Whether the step runs under bf16 autocast (fp32 master weights either way). ``auto`` keeps a
    CPU on fp32: without AMX or AVX512-BF16 bf16 matmuls are far slower there, and with them the gain
    (x1.46-1.51 on a LoRA step, bench/sft_precision.py) is the user's to take. A GPU without bf16
    asked for it is refused rather than silently run in fp32."""
    import torch

    if precision == "fp32":
        return False
    if use_cuda:
        if not torch.cuda.is_bf16_supported():
            if precision == "bf16":
                raise UsageError(
                    "SFT.precision='bf16': this GPU does not support bf16 (use 'auto' or 'fp32')"
                )
            return False
        return True
    if precision == "bf16":
        from agl.engine.dtype import cpu_has_native_bf16

        if not cpu_has_native_bf16():
            log.warning(
                "SFT.precision='bf16' on a CPU without AMX or AVX512-BF16: expect it slower than fp32"
            )
        return True
    return False


def _trl_args(cfg: SFT, run_dir: Path, seed: int, progress: bool) -> tuple[Any, Any]:
    """TRL's ``SFTConfig`` for ``cfg`` (completion-only loss, no saving or eval during training) and
    the LoRA config (None for full fine-tuning)."""
    import torch
    from trl import SFTConfig

    from agl.algorithms.grpo_setup import silence_checkpointing_rename

    use_cuda = torch.cuda.is_available()
    bf16 = _use_bf16(cfg.precision, use_cuda)
    silence_checkpointing_rename()
    args = SFTConfig(
        output_dir=str(run_dir / "checkpoints"),
        report_to=[],
        num_train_epochs=cfg.epochs,
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.batch_size,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type="constant_with_warmup" if cfg.warmup_ratio else "constant",
        warmup_steps=cfg.warmup_ratio,
        max_grad_norm=cfg.max_grad_norm,
        completion_only_loss=True,
        max_length=None,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        seed=seed,
        use_cpu=not use_cuda,
        bf16=bf16,
        disable_tqdm=not progress,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        # Recomputing activations trades compute for memory: worth it on a GPU, a loss on a CPU.
        gradient_checkpointing=use_cuda,
    )
    peft_config = None
    if cfg.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
    return args, peft_config


def _train(
    cfg: SFT,
    rows: Sequence[Transition],
    model: Any,
    tokenizer: Any,
    run_dir: Path,
    seed: int,
    merge: bool,
    progress: bool,
    adapter_dir: Path | None = None,
) -> dict[str, Any]:
    """One TRL run on ``rows``; the merged model under ``run_dir/model`` when ``merge``, the LoRA
    adapter as a peft folder in ``adapter_dir`` when given."""
    import torch
    from trl import SFTTrainer

    from agl.run.metrics import MetricsLog

    args, peft_config = _trl_args(cfg, run_dir, seed, progress)  # refuses bf16 where it is missing
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = MetricsLog(run_dir)
    metrics.reset()
    torch.manual_seed(seed)
    model, tok, source = _load(model, tokenizer, progress)
    dataset, n_resp = _dataset(_sequences(rows, cfg.merge_turns), cfg.max_length)

    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        peft_config=peft_config,
        callbacks=[_log_callback(cfg, metrics)],
    )
    # the loss before/after on (a spread sample of) the demonstrations themselves: did it learn them?
    step = max(1, len(dataset) // cfg.eval_examples)
    probe = dataset.select(range(0, len(dataset), step)[: cfg.eval_examples])
    t0 = time.perf_counter()
    before = float(trainer.evaluate(probe)["eval_loss"])
    trainer.train()
    after = float(trainer.evaluate(probe)["eval_loss"])
    seconds = time.perf_counter() - t0
    trainer._save_checkpoint(trainer.model, trial=None)
    checkpoint = run_dir / "checkpoints" / f"checkpoint-{trainer.state.global_step}"
    rollouts = len({(t.rollout_id, t.attempt) for t in rows})
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "examples": len(rows),
        "sequences": len(dataset),
        "merge_turns": cfg.merge_turns,
        "rollouts": rollouts,
        "agents": sorted({t.agent or "" for t in rows}),
        "exact": sum(1 for t in rows if t.exact),
        "response_tokens": n_resp,
        "loss_before": before,
        "loss_after": after,
        "steps": int(trainer.state.global_step),
        "seconds": seconds,
        "checkpoint": str(checkpoint),
        "base_model": source,
        "config": cfg.to_dict(),
    }
    metrics.write(
        {"step": int(trainer.state.global_step), "sft_loss_before": before, "sft_loss_after": after}
    )
    metrics.close()
    if adapter_dir is not None:
        trainer.model.save_pretrained(str(adapter_dir))
        summary["adapter_dir"] = str(adapter_dir)
    if merge:
        summary["model_dir"] = str(_save_merged(trainer.model, tok, source, run_dir / "model"))
    (run_dir / "sft_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _train_per_agent(
    cfg: SFT,
    rows: Sequence[Transition],
    model: Any,
    tokenizer: Any,
    run_dir: Path,
    seed: int,
    agents: Any,
    progress: bool,
) -> dict[str, Any]:
    """An adapter per agent (see the module docstring): each agent's rows train its adapter from the
    same base model; returns ``{"adapters": {name: that run's summary}, "adapters_dir", ...}``."""
    import copy

    from agl.lora import lora_names

    names = lora_names(agents)
    seen = sorted({t.agent or "" for t in rows})
    missing = [a for a in names if not any(t.agent == a for t in rows)]
    if missing:
        raise UsageError(
            f"no demonstrations of agent(s) {', '.join(map(repr, missing))} to train an adapter on; "
            f"the selected demonstrations are of {', '.join(map(repr, seen)) or 'no agent'}"
        )
    per: dict[str, Any] = {}
    for agent, name in names.items():
        base = model if model is None or isinstance(model, (str, os.PathLike)) else copy.deepcopy(model)
        mine = [t for t in rows if t.agent == agent]
        sub, adapter_dir = run_dir / "agents" / name, run_dir / "adapters" / name
        per[name] = _train(cfg, mine, base, tokenizer, sub, seed, False, progress, adapter_dir=adapter_dir)
    first = next(iter(per.values()))
    summary = {
        "run_dir": str(run_dir),
        "adapters_dir": str(run_dir / "adapters"),
        "agents": names,
        "examples": sum(p["examples"] for p in per.values()),
        "base_model": first["base_model"],
        "adapters": per,
        "config": cfg.to_dict(),
    }
    (run_dir / "sft_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _save_merged(model: Any, tok: Any, source: str | None, target: Path) -> Path:
    """The LoRA deltas merged into a plain model, saved with the tokenizer (and chat template) to
    ``target`` atomically: the gateway and the Trainer load it like any local model."""
    from agl.algorithms.update import is_peft

    plain = model.merge_and_unload() if is_peft(model) else model
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    template = getattr(tok, "chat_template", None)
    if isinstance(template, str) and not (tmp / "chat_template.jinja").exists():
        (tmp / "chat_template.jinja").write_text(template)
    if source is not None:
        src = Path(source) / "generation_config.json"
        if src.is_file():
            shutil.copy(src, tmp / "generation_config.json")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target
