"""The TRL ``GRPOTrainer`` that :class:`agl.algorithms.update.PolicyUpdate` drives, and what it is built from.

- :func:`_load_model`: the model (from a path) and its tokenizer;
- :func:`_grpo_args`: TRL's ``GRPOConfig`` for LightningRL's loss (DAPO token-level PPO-clip, KL ``beta``),
  optimiser and precision (bf16 on a GPU that has it when the run leaves it unset);
- :func:`_lora_config` / :func:`_frozen_copy`: the LoRA config, and a full fine-tune's KL reference;
- :func:`_build_trainer`: the trainer itself, with a placeholder dataset and no reward function (agl's
  loop brings transitions and advantages);
- the memory side: :func:`auto_micro_batch_tokens` (the token budget per micro-batch when unset),
  :func:`_enable_checkpointing` and :func:`_activations_bytes` (whether checkpointing pays on a CPU).

Kept apart from the update's step so that each file does one job; ``agl.algorithms.update`` re-exports
what its callers use.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import TYPE_CHECKING, Any

import torch
from trl import GRPOConfig

from agl.algorithms.distributed import timeout_s
from agl.algorithms.scoring import TransitionGRPOTrainer, is_peft
from agl.config import RunConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CHECKPOINT_ABOVE_BYTES",
    "CPU_MICRO_BATCH_TOKENS",
    "GPU_MICRO_BATCH_TOKENS_MAX",
    "auto_micro_batch_tokens",
]


def _load_model(
    model: str | os.PathLike[str] | PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (loaded when given as a path) and its tokenizer (the model's own when none is given)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(model, (str, os.PathLike)):
        model = AutoModelForCausalLM.from_pretrained(str(model))
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path)
    return model, tokenizer


def silence_checkpointing_rename() -> None:
    """Hide transformers 5's ``gradient_checkpointing`` -> ``activation_checkpointing`` rename warning.

    TRL 1.16's configs still spell the field the old way, so the warning fires on every config and
    forward of both the RL update and ``agl sft``; no agl user can act on it."""
    warnings.filterwarnings(
        "ignore", message=r".*(is_)?gradient_checkpointing.* is deprecated", category=FutureWarning
    )


def _grpo_args(
    config: RunConfig,
    *,
    output_dir: str | os.PathLike[str],
    lr_scheduler_type: str,
    gradient_checkpointing: bool,
    use_cuda: bool,
    seed: int,
) -> GRPOConfig:
    """TRL's config for the update: the run's loss knobs (DAPO loss, token-level clipping, KL ``beta``),
    optimiser and precision. Mixed precision left unset is bf16 on a GPU that has it, else none."""
    mixed_precision = config.mixed_precision
    if mixed_precision is None:
        mixed_precision = "bf16" if use_cuda and torch.cuda.is_bf16_supported() else "no"
    eps, eps_high = float(config.clip_eps), config.clip_eps_high
    silence_checkpointing_rename()
    return GRPOConfig(
        output_dir=str(output_dir),
        report_to=[],
        learning_rate=float(config.learning_rate),
        lr_scheduler_type=lr_scheduler_type,
        warmup_steps=0,
        max_grad_norm=float(config.max_grad_norm),
        beta=float(config.kl_coef),
        epsilon=eps,
        epsilon_high=float(eps_high) if eps_high is not None else eps,
        loss_type="dapo",
        importance_sampling_level="token",
        temperature=float(config.temperature),
        mask_truncated_completions=False,
        gradient_checkpointing=gradient_checkpointing,
        bf16=mixed_precision == "bf16",
        fp16=mixed_precision == "fp16",
        use_cpu=not use_cuda,
        seed=seed,
        # Unused by agl (no generation), but GRPOConfig validates them.
        num_generations=2,
        per_device_train_batch_size=2,
        steps_per_generation=1,
        save_strategy="no",
        save_total_limit=3,  # save_checkpoint() keeps the newest three
        logging_strategy="no",
        disable_tqdm=True,
        ddp_timeout=math.ceil(timeout_s()),  # a dead rank fails the run (agl.algorithms.distributed)
    )


def _lora_config(config: RunConfig, model: Any, target_modules: str | list[str]) -> Any:
    """peft's LoraConfig when the run trains LoRA adapters on a model that has none yet, else None."""
    if not bool(config.lora) or is_peft(model):
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=int(config.lora_r),
        lora_alpha=int(config.lora_alpha),
        lora_dropout=0.0,
        target_modules=target_modules,
        task_type="CAUSAL_LM",
    )


def _frozen_copy(model: Any) -> Any:
    """A copy of ``model`` in eval mode with no trainable parameter: the KL reference of a full fine-tune."""
    import copy

    ref_model = copy.deepcopy(model).eval()
    for p in ref_model.parameters():
        p.requires_grad_(False)
    return ref_model


def _build_trainer(
    model: Any, tokenizer: PreTrainedTokenizerBase, args: GRPOConfig, peft_config: Any
) -> TransitionGRPOTrainer:
    """The GRPO trainer over ``model`` (LoRA-wrapped by TRL when ``peft_config`` is given). Its dataset
    is a placeholder: transitions reach it through :meth:`PolicyUpdate.step`, never through ``train()``."""
    from datasets import Dataset

    return TransitionGRPOTrainer(
        model=model,
        reward_funcs=_no_reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": ""}]),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


#: on a CPU, gradient checkpointing is turned on when a full micro-batch's saved activations would
#: exceed this: below it the recomputation (~30% more compute) buys little memory
CHECKPOINT_ABOVE_BYTES = 256 * 2**20
#: the micro-batch token budget on CPU, and the bounds of the one picked on a GPU
CPU_MICRO_BATCH_TOKENS = 4096
GPU_MICRO_BATCH_TOKENS_MAX = 65536


def auto_micro_batch_tokens(model: Any, *, use_cuda: bool, checkpointing: bool = True) -> int:
    """The micro-batch token budget when the run config leaves it unset (None).

    CPU: 4096 (activations stay small; the CPU is compute-bound, so bigger batches buy nothing). GPU:
    the largest power of two up to 65536 whose estimated memory fits in half the free GPU memory. Per
    token that is the logits, their log-softmax and gradient in float32 (3 x vocab x 4 bytes) plus the
    checkpointed layer inputs in bf16 (without checkpointing: every layer's ~16 bf16 hidden-sized
    activations). A small model on a GPU is launch-bound, so fewer, bigger micro-batches run faster
    (docs/architecture.md §9)."""
    if not use_cuda:
        return CPU_MICRO_BATCH_TOKENS
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    per_token = 12 * vocab + (2 if checkpointing else 32) * layers * hidden + 40 * hidden
    free, _total = torch.cuda.mem_get_info()
    budget = CPU_MICRO_BATCH_TOKENS
    while budget * 2 <= GPU_MICRO_BATCH_TOKENS_MAX and budget * 2 * per_token <= free // 2:
        budget *= 2
    return budget


def _enable_checkpointing(model: Any) -> None:
    """Turn on activation checkpointing in ``model``'s decoder layers. ``transformers.Trainer`` does this
    in ``train()``, which agl never calls (``step`` drives the optimisation), so ``GRPOConfig``'s
    ``gradient_checkpointing=True`` alone leaves every layer keeping its activations: a 16 x 113-token
    SmolLM2 micro-batch then held ~4.7 GB instead of ~0.6 GB. Non-reentrant, so the frozen inputs of a
    LoRA model need no ``requires_grad``."""
    base = model.get_base_model() if is_peft(model) else model
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # pragma: no cover - older transformers
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _activations_bytes(model: Any, tokens: int) -> int:
    """A rough size of the activations a decoder keeps for backward over ``tokens`` tokens: about ten
    hidden-sized float32 tensors per token per layer (attention and MLP inputs, norms, MLP
    intermediates). SmolLM2-135M at 2048 tokens: ~1.4 GB, versus ~150 MB with checkpointing."""
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    return tokens * layers * hidden * 4 * 10


def _no_reward(**kwargs: Any) -> list[float]:  # pragma: no cover - GRPOTrainer requires a reward source
    raise RuntimeError("rewards come from the store, not from a reward function")
