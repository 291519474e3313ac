"""The LightningRL policy update (DESIGN §8), built on TRL's GRPO machinery.

LightningRL reduces multi-turn agent training to single-turn RL: every transition is one sequence
(prompt ids + response ids) with one advantage, so TRL's GRPO loss applies unchanged. This module
therefore does not reimplement the loss. ``_TransitionGRPOTrainer`` subclasses ``trl.GRPOTrainer`` and
takes from it, unchanged:

- model preparation: LoRA wrapping through peft (``peft_config``), gradient checkpointing, dropout off,
  the fused LM head that computes per-token log-probs in chunks without materialising the logits;
- the accelerate ``Accelerator`` (device placement, bf16/fp16 mixed precision, DDP/FSDP/DeepSpeed when
  launched with ``accelerate launch``), the optimizer and scheduler (``Trainer._prepare_for_training``);
- the loss: ``GRPOTrainer._compute_loss`` with ``loss_type="dapo"`` (token-level PPO-clip, token-mean
  over every response token of the step via ``num_items_in_batch``), ``epsilon``/``epsilon_high``
  clipping, the k3 KL estimator to a reference (``beta``), and its clip/KL/entropy metrics;
- the reference for KL under LoRA: the same model with adapters disabled (TRL's ``use_adapter``);
- checkpoints: ``Trainer._save_checkpoint`` / ``_load_optimizer_and_scheduler`` (adapter or full
  weights, optimizer, scheduler, RNG, trainer state).

Where it departs from ``GRPOTrainer.train()`` and why:

- no generation and no reward functions: transitions come from the store (recorded by the gateway) and
  advantages from ``agl.algorithms.lightning_rl``, so ``step()`` drives the optimisation itself instead
  of ``Trainer.train()`` (whose loop owns a dataset, generation and its own step counting);
- micro-batches are packed by a padded-token budget (``micro_batch_tokens``) rather than a fixed number of
  rows, because agent prompts vary from tens to thousands of tokens; gradients accumulate across them;
- the behaviour policy of the ratio is the engine's recorded log-probs (``old_per_token_logps``), falling
  back to the current policy's detached log-probs for transitions without them (an ``openai`` passthrough
  run); a micro-batch never mixes the two, since TRL takes the fallback per batch;
- transitions with zero advantage are skipped when there is no KL term: they carry no gradient, and
  skipping them (as DAPO's dynamic sampling does) saves most of the compute on a CPU.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import pad, use_adapter

from agl.config import RunConfig
from agl.trajectories import (
    BREAK_CAUSES,
    Trajectory,
    merge_transitions,
    per_call_trajectories,
    token_advantages,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from agl.types import Transition

__all__ = ["MicroBatch", "PolicyUpdate", "pack_micro_batches"]

log = logging.getLogger(__name__)


@dataclass
class MicroBatch:
    """Rows of one forward/backward pass: indices into the step's sequences."""

    rows: list[int]
    prompt_len: int
    response_len: int
    has_logprobs: bool

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * (self.prompt_len + self.response_len)


def _lengths(item: Transition | Trajectory) -> tuple[int, int, bool]:
    """(prompt tokens, tokens after the prompt, has behaviour log-probs) of a transition or trajectory."""
    if isinstance(item, Trajectory):
        return len(item.prompt_ids), len(item.completion_ids), item.logprobs is not None
    return len(item.prompt_ids), len(item.response_ids), item.response_logprobs is not None


def pack_micro_batches(
    items: Sequence[Transition | Trajectory], budget_tokens: int, *, indices: Sequence[int] | None = None
) -> list[MicroBatch]:
    """Group transitions (or merged trajectories) into micro-batches whose padded size (rows x (max
    prompt + max completion)) fits ``budget_tokens``. Longest first, so padding stays small; a sequence
    longer than the budget goes alone (it cannot be split without changing the loss). Rows with and
    without engine log-probs are never mixed: TRL chooses the behaviour log-probs per batch."""
    if budget_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {budget_tokens}")
    idx = list(range(len(items))) if indices is None else list(indices)
    lens = {i: _lengths(items[i]) for i in idx}
    out: list[MicroBatch] = []
    for has_lp in (True, False):
        rows = [i for i in idx if lens[i][2] == has_lp]
        rows.sort(key=lambda i: lens[i][0] + lens[i][1], reverse=True)
        cur: MicroBatch | None = None
        for i in rows:
            p, r, _ = lens[i]
            if cur is not None:
                mp, mr = max(cur.prompt_len, p), max(cur.response_len, r)
                if (len(cur.rows) + 1) * (mp + mr) <= budget_tokens:
                    cur.rows.append(i)
                    cur.prompt_len, cur.response_len = mp, mr
                    continue
            cur = MicroBatch(rows=[i], prompt_len=p, response_len=r, has_logprobs=has_lp)
            out.append(cur)
            if p + r > budget_tokens:
                log.warning(
                    "a sequence of %d tokens exceeds micro_batch_tokens=%d; it runs as its own micro-batch",
                    p + r,
                    budget_tokens,
                )
    return out


#: response positions scored per chunk: bounds the (chunk x vocab) logits that exist at once
SCORE_CHUNK_TOKENS = 512


def _score_chunk(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target and the (detached) entropy, for one chunk of positions."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logps = logits.gather(-1, targets[:, None])[:, 0] - logz
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        entropy = logz - (probs * logits).sum(-1)
    return logps, entropy


def chunked_token_logps(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: torch.nn.Module,
    temperature: float,
    *,
    chunk: int = SCORE_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs (and entropies) of ``targets`` given the final hidden states, at
    ``temperature``, without a batch x length x vocab tensor held for backward.

    Positions are scored ``chunk`` at a time; under autograd each chunk runs in
    ``torch.utils.checkpoint``, so only its hidden states are kept and its logits are recomputed during
    the backward pass (the same trade TRL's and Liger's fused heads make). Shapes: ``hidden`` (B, R, H),
    ``targets`` (B, R) -> two (B, R) tensors.
    """
    from torch.utils.checkpoint import checkpoint

    b, r, h = hidden.shape
    flat_h, flat_t = hidden.reshape(b * r, h), targets.reshape(b * r)
    weight, bias = head.weight, getattr(head, "bias", None)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, ents = [], []
    for start in range(0, b * r, chunk):
        args = (flat_h[start : start + chunk], flat_t[start : start + chunk], weight, bias, temperature)
        lp, ent = checkpoint(_score_chunk, *args, use_reentrant=False) if grad else _score_chunk(*args)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps).view(b, r), torch.cat(ents).view(b, r)


def _backbone_and_head(model: Any) -> tuple[Any, Any] | None:
    """The decoder stack and LM head of a (peft-wrapped) causal LM whose logits are a plain projection
    of the last hidden state; None for models that scale or soft-cap their logits."""
    base = model.get_base_model() if _is_peft(model) else model
    cfg = getattr(base, "config", None)
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    for attr in (
        "final_logit_softcapping",
        "logit_scale",
        "output_multiplier",
        "lm_head_multiplier",
        "logits_scaling",
    ):
        if getattr(text, attr, None) not in (None, 1, 1.0):
            return None
    get_decoder = getattr(base, "get_decoder", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = get_decoder() if callable(get_decoder) else None
    if decoder is None or head is None or not isinstance(head, torch.nn.Linear):
        return None
    return decoder, head


class _TransitionGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` fed with precomputed transitions: generation and rewards are never used."""

    #: the policy's per-token log-probs of the last scored batch (detached), for the on-policy check
    last_logps: torch.Tensor | None = None

    def _get_per_token_logps_and_entropies(  # type: ignore[override]
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's fused LM head scores only response positions where Triton runs (CUDA/XPU); elsewhere
        it scores every position, prompt included — several times the work for agent transitions,
        whose prompts are long and responses short. There, run the decoder, then score only the
        response positions, in checkpointed chunks (:func:`chunked_token_logps`)."""
        try:
            from trl.kernels.chunked_logprob import _use_triton
        except ImportError:  # pragma: no cover - a TRL that moved it: assume Triton wherever CUDA is

            def _use_triton(device: torch.device) -> bool:
                return device.type in ("cuda", "xpu")

        parts = None
        if not (
            _use_triton(input_ids.device) or compute_aux_loss or any(v is not None for v in kwargs.values())
        ):
            parts = _backbone_and_head(self.accelerator.unwrap_model(model))
        if parts is None:
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
                **kwargs,
            )
        else:
            decoder, head = parts
            with self.accelerator.autocast():
                hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)[0]
            logps, ent = chunked_token_logps(
                hidden[:, -logits_to_keep - 1 : -1, :], input_ids[:, -logits_to_keep:], head, self.temperature
            )
            entropies, aux = (ent if compute_entropy else None), None
        self.last_logps = logps.detach()
        return logps, entropies, aux

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:  # pragma: no cover - guard
        raise RuntimeError("agl's policy update gets transitions from the store; it never generates")


def _is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is part of agl[train]
        return False
    return isinstance(model, PeftModel)


class PolicyUpdate:
    """Token-level PPO-clip updates of a causal LM from LightningRL transitions.

    ``model`` is a loaded ``PreTrainedModel`` or a local path; ``cfg`` is a :class:`agl.RunConfig` (or a
    ``LightningRL``, whose update fields are used with the RunConfig's sampling defaults). The ratio's
    logits are divided by ``cfg.temperature``: the temperature the gateway sampled at, so the ratio is
    one of the policy that acted. ``temperature``/``gradient_checkpointing``/``mixed_precision``
    override the config's. Call ``step(transitions, advantages)`` once per training step.
    """

    def __init__(
        self,
        model: str | PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        cfg: Any = None,
        *,
        output_dir: str | os.PathLike[str] = "agl-run",
        temperature: float | None = None,
        gradient_checkpointing: bool | None = None,
        mixed_precision: str | None = None,
        seed: int = 0,
        lora_target_modules: str | list[str] = "all-linear",
        lr_scheduler_type: str = "constant",
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        overrides: dict[str, Any] = {}
        if temperature is not None:
            overrides["temperature"] = temperature
        if gradient_checkpointing is not None:
            overrides["gradient_checkpointing"] = gradient_checkpointing
        if mixed_precision is not None:
            overrides["mixed_precision"] = mixed_precision
        base = cfg if isinstance(cfg, RunConfig) else None
        self.config = RunConfig.resolve(None if base is not None else cfg, base=base, update=overrides)
        self.cfg = self.config
        config = self.config
        config.check_trainable()
        temperature = config.temperature
        gradient_checkpointing = config.gradient_checkpointing
        mixed_precision = config.mixed_precision
        use_cuda = torch.cuda.is_available()
        if isinstance(model, (str, os.PathLike)):
            model = AutoModelForCausalLM.from_pretrained(str(model))
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path)
        if mixed_precision is None:
            mixed_precision = "bf16" if use_cuda and torch.cuda.is_bf16_supported() else "no"
        self.micro_batch_tokens = (
            int(config.micro_batch_tokens)
            if config.micro_batch_tokens is not None
            else auto_micro_batch_tokens(
                model, use_cuda=use_cuda, checkpointing=gradient_checkpointing is not False
            )
        )
        if gradient_checkpointing is None:
            gradient_checkpointing = use_cuda or _activations_bytes(model, self.micro_batch_tokens) > (
                CHECKPOINT_ABOVE_BYTES
            )
        self.kl_coef = float(config.kl_coef)
        eps = float(config.clip_eps)
        eps_high = config.clip_eps_high
        # TRL 1.16 still spells transformers 5's `activation_checkpointing` the deprecated way (a warning
        # on every config and forward); not actionable for agl's users.
        warnings.filterwarnings(
            "ignore", message=r".*(is_)?gradient_checkpointing.* is deprecated", category=FutureWarning
        )
        args = GRPOConfig(
            output_dir=str(output_dir),
            report_to=[],
            learning_rate=float(config.learning_rate),
            lr_scheduler_type=lr_scheduler_type,
            warmup_steps=0,
            max_grad_norm=float(config.max_grad_norm),
            beta=self.kl_coef,
            epsilon=eps,
            epsilon_high=float(eps_high) if eps_high is not None else eps,
            loss_type="dapo",
            importance_sampling_level="token",
            temperature=float(temperature),
            mask_truncated_completions=False,
            gradient_checkpointing=bool(gradient_checkpointing),
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
        )
        peft_config = None
        if bool(config.lora) and not _is_peft(model):
            from peft import LoraConfig

            peft_config = LoraConfig(
                r=int(config.lora_r),
                lora_alpha=int(config.lora_alpha),
                lora_dropout=0.0,
                target_modules=lora_target_modules,
                task_type="CAUSAL_LM",
            )
        # GRPOTrainer builds a non-LoRA reference by re-loading the model from its hub id; agl's models are
        # local objects, so the reference (only needed for full fine-tuning with KL) is copied below instead.
        needs_copy_ref = self.kl_coef != 0.0 and peft_config is None and not _is_peft(model)
        ref_model = None
        if needs_copy_ref:
            import copy

            ref_model = copy.deepcopy(model).eval()
            for p in ref_model.parameters():
                p.requires_grad_(False)
            args.beta = 0.0
        from datasets import Dataset

        self.trainer = _TransitionGRPOTrainer(
            model=model,
            reward_funcs=_no_reward,
            args=args,
            train_dataset=Dataset.from_list([{"prompt": ""}]),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
        tr = self.trainer
        if ref_model is not None:
            from trl.trainer.utils import add_fused_lm_head

            add_fused_lm_head(ref_model, temperature=float(temperature))
            tr.ref_model = tr.accelerator.prepare_model(ref_model, evaluation_mode=True)
            tr.beta = self.kl_coef
        self.tokenizer = tokenizer
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self._wrapped, _ = tr._prepare_for_training(10**9, None, None)
        #: whether the decoder layers recompute their activations in the backward pass
        self.gradient_checkpointing = bool(gradient_checkpointing)
        if self.gradient_checkpointing:
            _enable_checkpointing(self.model)
        # One optimizer step per epoch over a step's transitions; the token-mean normaliser is the whole
        # step's response-token count, so TRL's own accumulation scaling must be neutral.
        tr.current_gradient_accumulation_steps = 1
        self.global_step = 0
        self._rng = random.Random(seed)

    # ------------------------------------------------------------------------------------ accessors
    @property
    def model(self) -> PreTrainedModel:
        """The policy as a plain model object (a ``PeftModel`` under LoRA), unwrapped from accelerate."""
        return self.trainer.accelerator.unwrap_model(self._wrapped)

    @property
    def device(self) -> torch.device:
        return self.trainer.accelerator.device

    @property
    def is_lora(self) -> bool:
        return _is_peft(self.model)

    # -------------------------------------------------------------------------------------- batches
    def _tensors(
        self,
        seqs: Sequence[Trajectory],
        mb: MicroBatch,
        token_adv: Sequence[Sequence[float]] | None = None,
        train_masks: Sequence[Sequence[int]] | None = None,
    ) -> dict:
        """TRL's GRPO inputs for one micro-batch. Every token after the prompt is attended to
        (``completion_mask``); only the model's own tokens are trained (``tool_mask``, TRL's mask for
        tokens the policy did not generate), each with its own call's advantage."""
        dev = self.device
        rows = [seqs[i] for i in mb.rows]

        def padded(values: list[torch.Tensor], value: float, side: str) -> torch.Tensor:
            return pad(values, padding_value=value, padding_side=side).to(dev)

        prompt = [torch.tensor(t.prompt_ids, dtype=torch.long) for t in rows]
        comp = [torch.tensor(t.completion_ids, dtype=torch.long) for t in rows]
        masks = [train_masks[i] if train_masks is not None else seqs[i].loss_mask for i in mb.rows]
        out: dict[str, Any] = {
            "prompt_ids": padded(prompt, self.pad_id, "left"),
            "prompt_mask": padded([torch.ones_like(p) for p in prompt], 0, "left"),
            "completion_ids": padded(comp, self.pad_id, "right"),
            "completion_mask": padded([torch.ones_like(c) for c in comp], 0, "right"),
        }
        if any(0 in m for m in masks):
            out["tool_mask"] = padded([torch.tensor(m, dtype=torch.long) for m in masks], 0, "right")
        if token_adv is not None:
            adv = [torch.tensor(token_adv[i], dtype=torch.float32) for i in mb.rows]
            out["advantages"] = padded(adv, 0.0, "right")
        else:
            out["advantages"] = torch.zeros(len(rows), dtype=torch.float32, device=dev)
        if mb.has_logprobs:
            lps = [torch.tensor(t.logprobs, dtype=torch.float32) for t in rows]
            out["old_per_token_logps"] = padded(lps, 0.0, "right")
        return out

    def _ref_logps(self, inputs: dict) -> torch.Tensor:
        tr = self.trainer
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        keep = inputs["completion_ids"].size(1)
        with torch.no_grad():
            if tr.ref_model is not None:
                lp, _, _ = tr._get_per_token_logps_and_entropies(tr.ref_model, input_ids, mask, keep)
            else:
                peft_model = self.model
                name = "ref" if "ref" in getattr(peft_model, "peft_config", {}) else None
                with use_adapter(peft_model, adapter_name=name):
                    lp, _, _ = tr._get_per_token_logps_and_entropies(self._wrapped, input_ids, mask, keep)
        return lp

    # ----------------------------------------------------------------------------------------- step
    def step(
        self,
        transitions: Sequence[Transition],
        advantages: Sequence[float],
        *,
        merge_turns: bool | None = None,
    ) -> dict[str, float]:
        """One LightningRL update: ``epochs_per_step`` optimizer steps over the given transitions.

        With ``merge_turns`` (default: the config's, on) each agent conversation whose calls extend one
        another exactly is one sequence (``agl.trajectories``): each response token keeps its own
        call's advantage and behaviour log-prob and sees the same context as when it was sampled, so the
        loss is the per-call loss, computed in one forward pass instead of one per call.

        Returns metrics: loss, kl, clip_fraction, entropy, grad_norm, tokens_per_s, transitions, tokens,
        sequences, micro_batches, skipped (zero-advantage transitions left out), the merge statistics
        (merge_rate, tokens_saved, breaks_*) and, when the transitions carry the engine's log-probs,
        ``behaviour_ratio_dev``: max |ratio - 1| before the first optimizer step (~0 when the run is
        on-policy; see :func:`_ratio_deviation`).
        """
        if len(transitions) != len(advantages):
            raise ValueError(f"{len(transitions)} transitions but {len(advantages)} advantages")
        for a in advantages:
            if not math.isfinite(float(a)):
                raise ValueError(f"advantages must be finite, got {a!r}")
        tr = self.trainer
        acc = tr.accelerator
        merge = self.config.merge_turns if merge_turns is None else merge_turns
        seqs, merge_stats = (merge_transitions if merge else per_call_trajectories)(transitions)
        # A call with zero advantage carries no gradient without a KL term: it is left out of the loss
        # (masked within a merged sequence, dropped when alone), as DAPO's dynamic sampling does.
        # With mask_truncated, a call cut at max_tokens is left out the same way (DAPO's overlong filtering).
        masked_truncated = {
            i for i, t in enumerate(transitions) if self.config.mask_truncated and t.truncated
        }
        trained = {
            i
            for i, t in enumerate(transitions)
            if t.response_ids
            and i not in masked_truncated
            and (self.kl_coef != 0.0 or float(advantages[i]) != 0.0)
        }
        train_masks = [_train_mask(s, trained) for s in seqs]
        token_adv = [token_advantages(s, advantages) for s in seqs]
        keep = [k for k, m in enumerate(train_masks) if any(m)]
        n_calls = sum(1 for k in keep for seg in seqs[k].segments if seg.transition in trained)
        skipped = len(transitions) - n_calls
        if acc.num_processes > 1:
            keep = keep[acc.process_index :: acc.num_processes]
        mbs = pack_micro_batches(seqs, self.micro_batch_tokens, indices=keep)
        n_resp_local = sum(sum(train_masks[k]) for k in keep)
        n_tok_local = sum(seqs[k].tokens for k in keep)
        counts = torch.tensor([float(n_resp_local), float(n_tok_local), float(len(mbs))], device=self.device)
        totals = acc.reduce(counts, reduction="sum") if acc.num_processes > 1 else counts
        n_mb_max = int(acc.gather(counts[2:3]).max().item()) if acc.num_processes > 1 else len(mbs)
        n_resp, n_tok = totals[0].clamp(min=1.0), float(totals[1].item())
        metrics: dict[str, float] = {
            "transitions": float(n_calls),
            "sequences": float(len(keep)),
            "skipped": float(skipped),
            "truncated_calls": float(sum(1 for t in transitions if t.truncated)),  # cut at max_tokens
            "tokens": n_tok,
            "response_tokens": float(n_resp_local),
            "micro_batches": float(len(mbs)),
            **{k: float(v) for k, v in merge_stats.as_dict().items() if k in _MERGE_METRICS},
        }
        if n_mb_max == 0:
            self.global_step += 1
            tr.state.global_step = self.global_step
            return {
                **metrics,
                "loss": 0.0,
                "kl": 0.0,
                "clip_fraction": 0.0,
                "grad_norm": 0.0,
                "tokens_per_s": 0.0,
            }

        model = self._wrapped
        epochs = max(1, int(self.config.epochs_per_step))
        tr._metrics["train"].clear()
        losses: list[float] = []
        grad_norms: list[float] = []
        ratio_dev: float | None = None
        t0 = time.perf_counter()
        for _epoch in range(epochs):
            order = list(range(len(mbs)))
            self._rng.shuffle(order)
            # Every rank runs the same number of backward passes (DDP would hang otherwise); a rank with
            # fewer micro-batches repeats one with its loss multiplied by zero.
            order += [order[-1] if order else -1] * (n_mb_max - len(order))
            model.train()
            epoch_loss = 0.0
            for j, k in enumerate(order):
                dummy = k < 0 or j >= len(mbs)
                mb = mbs[k] if k >= 0 else None
                if mb is None:  # a rank with no transitions at all still joins the collective backward
                    loss = sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
                    acc.backward(loss)
                    continue
                inputs = self._tensors(seqs, mb, token_adv, train_masks)
                inputs["num_items_in_batch"] = n_resp
                if tr.beta != 0.0:
                    inputs["ref_per_token_logps"] = self._ref_logps(inputs)
                sync = contextlib.nullcontext() if j == len(order) - 1 else acc.no_sync(model)
                with sync, tr.compute_loss_context_manager():
                    loss = tr.compute_loss(model, inputs)
                    if dummy:
                        loss = loss * 0.0
                    acc.backward(loss)
                if not dummy:
                    epoch_loss += float(loss.detach().item())
                    if _epoch == 0 and mb is not None and mb.has_logprobs:
                        dev = _ratio_deviation(tr.last_logps, inputs)
                        ratio_dev = dev if ratio_dev is None else max(ratio_dev, dev)
            norm = acc.clip_grad_norm_(model.parameters(), tr.args.max_grad_norm)
            grad_norms.append(float(norm.item()) if torch.is_tensor(norm) else float(norm or 0.0))
            tr.optimizer.step()
            tr.lr_scheduler.step()
            tr.optimizer.zero_grad(set_to_none=True)
            losses.append(epoch_loss)
        elapsed = max(time.perf_counter() - t0, 1e-9)
        self.global_step += 1
        tr.state.global_step = self.global_step
        m = tr._metrics["train"]

        def _mean(key: str) -> float:
            vals = [v for v in m.get(key, []) if math.isfinite(v)]
            return float(sum(vals) / len(vals)) if vals else 0.0

        metrics.update(
            loss=float(sum(losses) / len(losses)),
            kl=_mean("kl"),
            clip_fraction=_mean("clip_ratio/region_mean"),
            entropy=_mean("entropy"),
            grad_norm=float(sum(grad_norms) / len(grad_norms)),
            tokens_per_s=n_tok * epochs / elapsed,
            update_s=elapsed,
            learning_rate=float(tr.lr_scheduler.get_last_lr()[0]),
        )
        if ratio_dev is not None:
            metrics["behaviour_ratio_dev"] = ratio_dev
        m.clear()
        return metrics

    # ----------------------------------------------------------------------------------- inspection
    @torch.no_grad()
    def response_logprobs(self, transitions: Sequence[Transition]) -> list[list[float]]:
        """Per-token log-probs of each transition's response under the current policy (at the update's
        temperature): what the tests use to check that rewarded responses became more likely."""
        out: list[list[float]] = [[] for _ in transitions]
        seqs, _ = per_call_trajectories(transitions)
        mbs = pack_micro_batches(seqs, self.micro_batch_tokens)
        was_training = self._wrapped.training
        self._wrapped.eval()
        try:
            for mb in mbs:
                inputs = self._tensors(seqs, mb)
                ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
                mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
                lp, _, _ = self.trainer._get_per_token_logps_and_entropies(
                    self._wrapped, ids, mask, inputs["completion_ids"].size(1)
                )
                for row, i in enumerate(mb.rows):
                    out[i] = lp[row, : len(transitions[i].response_ids)].float().cpu().tolist()
        finally:
            self._wrapped.train(was_training)
        return out

    # ---------------------------------------------------------------------------------- weight sync
    @torch.no_grad()
    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights as a plain model's state dict (LoRA deltas merged), for an inference
        engine that holds its own copy of the base model. The training model is left untouched."""
        model = self.model
        if not _is_peft(model):
            return {k: v.detach().clone() for k, v in model.state_dict().items()}
        from peft.tuners.lora import LoraLayer

        base = model.get_base_model()
        sd = {k: v.detach().clone() for k, v in base.state_dict().items() if "lora_" not in k}
        # peft renames wrapped weights "<mod>.base_layer.weight"; a plain model calls them "<mod>.weight".
        sd = {k.replace(".base_layer.", "."): v for k, v in sd.items()}
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        key = f"{name}.weight"
                        sd[key] = sd[key] + module.get_delta_weight(adapter).to(sd[key].dtype)
        return sd

    def save_adapter(self, path: str | os.PathLike[str]) -> str:
        """Save the LoRA adapter (or the full model) in the format vLLM's runtime LoRA loading reads."""
        path = str(path)
        os.makedirs(path, exist_ok=True)
        if self.trainer.accelerator.is_main_process:
            self.model.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
        self.trainer.accelerator.wait_for_everyone()
        return path

    def save_weights(self, path: str | os.PathLike[str]) -> str:
        """Save the full weights (LoRA deltas merged) as ``model.safetensors`` in ``path``: the
        full-fine-tuning push to an engine in another process (``Backend.load_weights``)."""
        from safetensors.torch import save_file

        path = str(path)
        os.makedirs(path, exist_ok=True)
        if self.trainer.accelerator.is_main_process:
            state = {k: v.contiguous() for k, v in self.merged_state_dict().items()}
            save_file(state, os.path.join(path, "model.safetensors"))
        self.trainer.accelerator.wait_for_everyone()
        return path

    # ---------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> str:
        """Save adapter/weights, optimizer, scheduler, RNG and trainer state (TRL/transformers format)
        under ``output_dir/checkpoint-<step>``; returns that directory."""
        tr = self.trainer
        tr.state.global_step = self.global_step
        tr._save_checkpoint(self._wrapped, trial=None)
        return os.path.join(tr.args.output_dir, f"checkpoint-{self.global_step}")

    def load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        """Resume from a directory written by ``save_checkpoint``; returns the step it was saved at."""
        import json

        path = str(path)
        state_file = os.path.join(path, "trainer_state.json")
        if not os.path.isfile(state_file):
            raise FileNotFoundError(f"{path} is not an agl checkpoint (no trainer_state.json)")
        tr = self.trainer
        model = self.model
        if _is_peft(model):
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            weights = os.path.join(path, "adapter_model.safetensors")
            if not os.path.isfile(weights):
                raise FileNotFoundError(f"{path} holds no LoRA adapter (adapter_model.safetensors)")
            set_peft_model_state_dict(model, load_file(weights, device=str(self.device)))
        else:
            tr._load_from_checkpoint(path, self._wrapped)
        tr._load_optimizer_and_scheduler(path)
        with open(state_file) as f:
            self.global_step = int(json.load(f)["global_step"])
        tr.state.global_step = self.global_step
        return self.global_step


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
    base = model.get_base_model() if _is_peft(model) else model
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


def _ratio_deviation(logps: torch.Tensor | None, inputs: dict[str, Any]) -> float:
    """max |pi/mu - 1| over a micro-batch's response tokens, before any optimizer step of the update:
    0 up to float error when the recorded behaviour log-probs are the current policy's at the update's
    temperature. A large value means the run learns off-policy (e.g. the agent sampled at another
    temperature than the run's)."""
    if logps is None:
        return float("nan")
    mask = inputs["completion_mask"].bool()
    if "tool_mask" in inputs:
        mask = mask & inputs["tool_mask"].bool()
    ratio = torch.exp(logps.float() - inputs["old_per_token_logps"].float())
    return float((ratio - 1.0).abs().masked_select(mask).max().item()) if mask.any() else 0.0


#: the merge statistics a step reports (agl.trajectories.MergeStats.as_dict keys)
_MERGE_METRICS = ("merge_rate", "tokens_saved", *(f"breaks_{cause}" for cause in BREAK_CAUSES))


def _train_mask(seq: Trajectory, trained: set[int]) -> list[int]:
    """The sequence's loss mask with the tokens of calls left out of this update zeroed."""
    mask = list(seq.loss_mask)
    for seg in seq.segments:
        if seg.transition not in trained:
            mask[seg.start : seg.end] = [0] * (seg.end - seg.start)
    return mask


def _no_reward(**kwargs: Any) -> list[float]:  # pragma: no cover - GRPOTrainer requires a reward source
    raise RuntimeError("rewards come from the store, not from a reward function")
