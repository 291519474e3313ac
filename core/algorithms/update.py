"""The LightningRL policy update (DESIGN §8), built on TRL's GRPO machinery.

LightningRL reduces multi-turn agent training to single-turn RL: every transition is one sequence
(prompt ids + response ids) with one advantage, so TRL's GRPO loss applies unchanged. This module
therefore does not reimplement the loss. ``TransitionGRPOTrainer`` (:mod:`agl.algorithms.scoring`)
subclasses ``trl.GRPOTrainer`` and takes from it, unchanged:

- model preparation: LoRA wrapping through peft (``peft_config``), gradient checkpointing, dropout off,
  the fused LM head that computes per-token log-probs in chunks without materialising the logits;
- the accelerate ``Accelerator`` (device placement, bf16/fp16 mixed precision, the process group under
  ``torchrun``/``accelerate launch``: :mod:`agl.algorithms.distributed`), the optimizer and scheduler
  (``Trainer._prepare_for_training``);
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
  skipping them (as DAPO's dynamic sampling does) saves most of the compute on a CPU;
- sequences that share a token prefix (a group's prompt, a conversation's earlier turns) go through the
  model once per micro-batch as a tree (``share_prefixes``, :mod:`agl.algorithms.prefix_tree`): the same
  per-token log-probs, loss and gradients as unshared, on fewer tokens; a model whose attention does
  not take the tree's mask is packed unshared, said once in the log.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from trl.trainer.utils import pad, use_adapter

from agl.adapter.trajectories import (
    BREAK_CAUSES,
    Trajectory,
    merge_transitions,
    per_call_trajectories,
    token_advantages,
)
from agl.algorithms.balance import balance_weights
from agl.algorithms.distributed import (
    average_gradients,
    gradient_sync,
    local_metrics,
    reduce_metrics,
    shard,
)
from agl.algorithms.fsdp import Sharded, accelerate_without_fsdp, idle_loss, shard_policy
from agl.algorithms.fsdp import requested as fsdp_requested
from agl.algorithms.grpo_setup import (
    CHECKPOINT_ABOVE_BYTES,
    _activations_bytes,
    _build_trainer,
    _enable_checkpointing,
    _frozen_copy,
    _grpo_args,
    _load_model,
    _lora_config,
    auto_micro_batch_tokens,
)
from agl.algorithms.offpolicy import DecoupledWeights, decoupled_weights, ratio_deviation
from agl.algorithms.packing import MicroBatch, pack_micro_batches
from agl.algorithms.prefix_tree import PackedInputs, pair_cost
from agl.algorithms.scoring import chunked_token_logps, is_peft
from agl.algorithms.tree_check import sharing_refusal
from agl.config import RunConfig
from agl.lora import lora_names

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from agl.types import Transition

__all__ = ["MicroBatch", "PolicyUpdate", "chunked_token_logps", "is_peft", "pack_micro_batches"]

#: the former private name; ``agl.algorithms.sft`` still imports it
_is_peft = is_peft

log = logging.getLogger("agl.algorithms.update")


def _resolve_config(cfg: Any, overrides: dict[str, Any]) -> RunConfig:
    """The update's RunConfig: ``cfg`` (a RunConfig, a LightningRL or None) with the overrides that are
    set; refused here when it cannot train (``RunConfig.check_trainable``)."""
    base = cfg if isinstance(cfg, RunConfig) else None
    config = RunConfig.resolve(
        None if base is not None else cfg,
        base=base,
        update={k: v for k, v in overrides.items() if v is not None},
    )
    config.check_trainable()
    return config


def _micro_batch_and_checkpointing(config: RunConfig, model: Any, use_cuda: bool) -> tuple[int, bool]:
    """``(micro_batch_tokens, gradient_checkpointing)``: the config's, or sized to the model when unset
    (checkpointing on a GPU, or where a micro-batch's activations pass ``CHECKPOINT_ABOVE_BYTES``)."""
    tokens = (
        int(config.micro_batch_tokens)
        if config.micro_batch_tokens is not None
        else auto_micro_batch_tokens(
            model, use_cuda=use_cuda, checkpointing=config.gradient_checkpointing is not False
        )
    )
    checkpointing = config.gradient_checkpointing
    if checkpointing is None:
        checkpointing = use_cuda or _activations_bytes(model, tokens) > CHECKPOINT_ABOVE_BYTES
    return tokens, bool(checkpointing)


class PolicyUpdate:
    """Token-level PPO-clip updates of a causal LM from LightningRL transitions.

    ``model`` is a loaded ``PreTrainedModel`` or a local path; ``cfg`` is a :class:`agl.RunConfig` (or a
    ``LightningRL``, whose update fields are used with the RunConfig's sampling defaults). The ratio's
    logits are divided by ``cfg.temperature``: the temperature the gateway sampled at, so the ratio is
    one of the policy that acted. ``temperature``/``gradient_checkpointing``/``mixed_precision``
    override the config's. Call ``step(transitions, advantages)`` once per training step.
    ``adapters`` (the Trainer's ``{agent: LoRA}``, or agent names): train one LoRA per agent on the one frozen base model
    (:mod:`agl.algorithms.per_agent_lora`).
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
        adapters: Mapping[str, str] | Sequence[str] | None = None,
    ) -> None:
        overrides = {
            "temperature": temperature,
            "gradient_checkpointing": gradient_checkpointing,
            "mixed_precision": mixed_precision,
        }
        self.config = config = _resolve_config(cfg, overrides)
        self.cfg = config
        use_cuda = torch.cuda.is_available()
        model, tokenizer = _load_model(model, tokenizer)
        self.micro_batch_tokens, checkpointing = _micro_batch_and_checkpointing(config, model, use_cuda)
        self.kl_coef = float(config.kl_coef)
        args = _grpo_args(
            config,
            output_dir=output_dir,
            lr_scheduler_type=lr_scheduler_type,
            gradient_checkpointing=bool(checkpointing),
            use_cuda=use_cuda,
            seed=seed,
        )
        peft_config = _lora_config(config, model, lora_target_modules)
        #: ``{agent: adapter name}`` when each agent trains its own LoRA adapter (agl.algorithms.per_agent_lora)
        self.adapters: dict[str, str] = {}
        if adapters is not None:
            model, peft_config = self._agent_adapters(model, peft_config, adapters)
        # GRPOTrainer builds a non-LoRA reference by re-loading the model from its hub id; agl's models are
        # local objects, so the reference (only needed for full fine-tuning with KL) is a copy instead.
        ref_model = None
        if self.kl_coef != 0.0 and peft_config is None and not is_peft(model):
            ref_model = _frozen_copy(model)
            args.beta = 0.0  # TRL would load its own reference otherwise; set back once ours is attached
        with accelerate_without_fsdp():  # FSDP2 is applied by agl.algorithms.fsdp, after TRL's prepare
            self.trainer = _build_trainer(model, tokenizer, args, peft_config)
        if ref_model is not None:
            self._attach_reference(ref_model)
        self.tokenizer = tokenizer
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self._wrapped, _ = self.trainer._prepare_for_training(10**9, None, None)
        #: FSDP2's state when the launch asks for it (:mod:`agl.algorithms.fsdp`; its root is ``_wrapped``)
        self.fsdp: Sharded | None = shard_policy(self) if fsdp_requested() else None
        #: whether the decoder layers recompute their activations in the backward pass
        self.gradient_checkpointing = bool(checkpointing)
        if self.gradient_checkpointing:
            _enable_checkpointing(self.model)
        # One optimizer step per epoch over a step's transitions; the token-mean normaliser is the whole
        # step's response-token count, so TRL's own accumulation scaling must be neutral.
        self.trainer.current_gradient_accumulation_steps = 1
        self.global_step = 0
        self.tis_cap: float | None = None  # this step's truncated-importance-weight cap (step(tis_cap=))
        self._rng = random.Random(seed)
        #: the attention-to-token cost ratio prefix sharing plans with (None: off), once checked
        self._share_cost: tuple[float | None] | None = None
        self.share_cost()  # checks the model once, now: a fallback is said at the start of the run

    def _agent_adapters(
        self, model: Any, peft_config: Any, agents: Mapping[str, str] | Sequence[str]
    ) -> tuple[Any, None]:
        """``model`` with one named LoRA per agent (the run's LoRA config), for TRL to train as given;
        ``agents`` is the Trainer's ``{agent: LoRA}`` (agent names alone: named by :func:`agl.lora.lora_name`).
        Refuses a run without LoRA or a model that already has adapters."""
        from agl.algorithms.per_agent_lora import agent_peft_model
        from agl.errors import UsageError

        self.adapters = dict(agents) if isinstance(agents, Mapping) else lora_names(agents)
        if peft_config is None:
            why = "the model already has LoRA adapters" if is_peft(model) else "lora=False"
            raise UsageError(f"adapter_per_agent trains a LoRA adapter per agent; it cannot run with {why}")
        return agent_peft_model(model, peft_config, list(self.adapters.values())), None

    def _attach_reference(self, ref_model: Any) -> None:
        """Score the KL term against ``ref_model`` (a frozen copy of the initial policy), with the same
        fused head and accelerate placement as the policy."""
        from trl.trainer.utils import add_fused_lm_head

        tr = self.trainer
        add_fused_lm_head(ref_model, temperature=float(self.config.temperature))
        tr.ref_model = tr.accelerator.prepare_model(ref_model, evaluation_mode=True)
        tr.beta = self.kl_coef

    # ------------------------------------------------------------------------------------ accessors
    @property
    def model(self) -> PreTrainedModel:
        """The policy as a plain model object (a ``PeftModel`` under LoRA), unwrapped from accelerate."""
        if getattr(self, "fsdp", None) is not None:
            return self.fsdp.model
        return self.trainer.accelerator.unwrap_model(self._wrapped)

    @property
    def full_model(self) -> PreTrainedModel:
        """The policy with every tensor whole, what pushes and saves read: :attr:`model`, or under
        FSDP2 rank 0's replica (gathered after each step; None on the other ranks)."""
        return self.fsdp.replica if self.fsdp is not None else self.model

    @property
    def device(self) -> torch.device:
        return self.trainer.accelerator.device

    @property
    def precision(self) -> str:
        """The update's compute precision: ``"bf16"``/``"fp16"`` autocast over fp32 weights, or ``"no"``."""
        args = self.trainer.args
        return "bf16" if args.bf16 else "fp16" if args.fp16 else "no"

    @property
    def is_lora(self) -> bool:
        return is_peft(self.model)

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
        self.trainer.packed = None
        if mb.tree is not None:  # the forward runs on the tree for exactly these flat ids
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
            lens = ([len(t.prompt_ids) for t in rows], [len(t.completion_ids) for t in rows])
            scored = masks if "tool_mask" in out else None  # context and untrained calls: not scored
            self.trainer.packed = PackedInputs.build(mb.tree, ids, *lens, pad_id=self.pad_id, scored=scored)
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
        tis_cap: float | None = None,
    ) -> dict[str, float]:
        """One LightningRL update: ``epochs_per_step`` optimizer steps over the given transitions.

        With ``merge_turns`` (default: the config's, on) each agent conversation whose calls extend one
        another exactly is one sequence (``agl.adapter.trajectories``): each response token keeps its own
        call's advantage and behaviour log-prob and sees the same context as when it was sampled, so the
        loss is the per-call loss, computed in one forward pass instead of one per call.

        Returns metrics: loss, kl, clip_fraction, entropy, grad_norm, tokens_per_s, transitions, tokens,
        sequences, micro_batches, skipped (zero-advantage transitions left out), ``tokens_flat`` and
        ``tokens_packed`` (the step's tokens unshared, and through the model with each shared prefix
        once: :mod:`agl.algorithms.prefix_tree`), the merge statistics
        (merge_rate, tokens_saved, breaks_*) and, when the transitions carry the engine's log-probs,
        ``behaviour_ratio_dev``: max |ratio - 1| before the first optimizer step (~0 when the run is
        on-policy; see :func:`agl.algorithms.offpolicy.ratio_deviation`). With an adapter per agent, each adapter is updated on
        its own agent's transitions and its metrics are also reported as ``<metric>/<adapter>``
        (:func:`agl.algorithms.per_agent_lora.step_per_adapter`). With ``tis_cap``, transitions with behaviour
        log-probs train by decoupled PPO (:mod:`agl.algorithms.offpolicy`), adding ``tis_clip_fraction``
        and ``tis_weight_mean``; ``behaviour_ratio_dev`` is then the proximal policy's against the engine's
        (the PPO ratio itself starts at 1 by construction).
        """
        _check_advantages(transitions, advantages)
        self.tis_cap = tis_cap
        merge = self.config.merge_turns if merge_turns is None else merge_turns
        if self.adapters:
            from agl.algorithms.per_agent_lora import step_per_adapter

            metrics = step_per_adapter(self, transitions, advantages, merge)
            for _ in range(max(1, int(self.config.epochs_per_step))):  # one schedule for all adapters
                self.trainer.lr_scheduler.step()
        else:
            metrics = self._step_once(transitions, advantages, merge)
        self._advance()
        if self.fsdp is not None:  # rank 0's whole copy, for pushes (every rank gathers)
            self.fsdp.refresh()
        return metrics

    def _step_once(
        self, transitions: Sequence[Transition], advantages: Sequence[float], merge: bool
    ) -> dict[str, float]:
        """:meth:`step`'s work on the active adapter (or the whole policy), without advancing the step."""
        plan = self._plan(transitions, advantages, merge)
        n_resp, n_tok, n_mb_max = self._totals(plan)
        metrics = _count_metrics(plan, transitions, n_tok)
        if n_mb_max == 0:  # nothing to train (a step of zero advantages): no token weighted either
            return {
                **metrics,
                **(DecoupledWeights().metrics() if self.tis_cap is not None else {}),
                "loss": 0.0,
                "kl": 0.0,
                "clip_fraction": 0.0,
                "grad_norm": 0.0,
                "tokens_per_s": 0.0,
            }
        if self.tis_cap is not None:
            plan.tis = decoupled_weights(self, plan, self.tis_cap)
            metrics.update(plan.tis.metrics())
        tr = self.trainer
        epochs = max(1, int(self.config.epochs_per_step))
        tr._metrics["train"].clear()
        t0 = time.perf_counter()
        losses, grad_norms, ratio_dev = self._train_epochs(plan, epochs, n_resp, n_mb_max)
        elapsed = max(time.perf_counter() - t0, 1e-9)
        m = tr._metrics["train"]
        metrics.update(
            loss=float(sum(losses) / len(losses)),
            kl=_finite_mean(m.get("kl", [])),
            clip_fraction=_finite_mean(m.get("clip_ratio/region_mean", [])),
            entropy=_finite_mean(m.get("entropy", [])),
            grad_norm=float(sum(grad_norms) / len(grad_norms)),
            tokens_per_s=n_tok * epochs / elapsed,
            update_s=elapsed,
            learning_rate=float(tr.lr_scheduler.get_last_lr()[0]),
        )
        reduce_metrics(tr.accelerator, metrics)  # the whole step's figures, on every rank
        if plan.tis is not None:  # the ratio is taken against the proximal policy: its deviation is ~0
            ratio_dev = plan.tis.max_dev  # so report the engine's against the update's, as the plain path
        if ratio_dev is not None:
            metrics["behaviour_ratio_dev"] = ratio_dev
        m.clear()
        tr.packed = None
        return metrics

    def share_cost(self) -> float | None:
        """The attention-to-token cost ratio that prefix sharing plans with, or None when it is off:
        ``share_prefixes=False``, or a model whose attention does not take the tree layout (checked once
        on a two-sequence probe, :func:`agl.algorithms.tree_check.sharing_refusal`, and said once)."""
        if not self.config.share_prefixes:
            return None
        if self._share_cost is None:
            reason = sharing_refusal(self)
            if reason is not None:
                log.warning("shared-prefix packing is off: %s; sequences are packed unshared", reason)
            self._share_cost = (pair_cost(self.model.config) if reason is None else None,)
        return self._share_cost[0]

    def _trained_calls(self, transitions: Sequence[Transition], advantages: Sequence[float]) -> set[int]:
        """The calls this update trains. A call with zero advantage carries no gradient without a KL term:
        it is left out of the loss (masked within a merged sequence, dropped when alone), as DAPO's
        dynamic sampling does. With mask_truncated, a call cut at max_tokens is left out the same way
        (DAPO's overlong filtering)."""
        mask_truncated = self.config.mask_truncated
        return {
            i
            for i, t in enumerate(transitions)
            if t.response_ids
            and not (mask_truncated and t.truncated)
            and (self.kl_coef != 0.0 or float(advantages[i]) != 0.0)
        }

    def _plan(self, transitions: Sequence[Transition], advantages: Sequence[float], merge: bool) -> _StepPlan:
        """The step's sequences (merged conversations or one per call), their masks and per-token
        advantages, the ones this rank trains (those with a trained token) and their micro-batches."""
        seqs, merge_stats = (merge_transitions if merge else per_call_trajectories)(transitions)
        trained = self._trained_calls(transitions, advantages)
        train_masks = [_train_mask(s, trained) for s in seqs]
        factors = balance_weights(transitions, trained, self.config.loss_balance)  # agl.algorithms.balance
        weighted = [float(a) * w for a, w in zip(advantages, factors, strict=True)]
        token_adv = [token_advantages(s, weighted) for s in seqs]
        keep = [k for k, m in enumerate(train_masks) if any(m)]
        n_calls = sum(1 for k in keep for seg in seqs[k].segments if seg.transition in trained)
        acc = self.trainer.accelerator  # each rank trains its share (agl.algorithms.distributed)
        together = [s.prompt_ids for s in seqs] if acc.num_processes > 1 else None
        keep = shard(keep, [s.tokens for s in seqs], acc.process_index, acc.num_processes, together)
        mbs = pack_micro_batches(seqs, self.micro_batch_tokens, indices=keep, share_cost=self.share_cost())
        return _StepPlan(seqs, train_masks, token_adv, keep, mbs, n_calls, merge_stats.as_dict())

    def _totals(self, plan: _StepPlan) -> tuple[torch.Tensor, float, int]:
        """Across ranks: trained response tokens (the loss's token-mean normaliser, at least 1), all
        tokens, and the most micro-batches any rank has (every rank runs that many backward passes)."""
        acc = self.trainer.accelerator
        counts = torch.tensor(
            [float(plan.response_tokens), float(plan.tokens), float(len(plan.mbs))], device=self.device
        )
        totals = acc.reduce(counts, reduction="sum") if acc.num_processes > 1 else counts
        n_mb_max = int(acc.gather(counts[2:3]).max().item()) if acc.num_processes > 1 else len(plan.mbs)
        return totals[0].clamp(min=1.0), float(totals[1].item()), n_mb_max

    def _advance(self) -> None:
        self.global_step += 1
        self.trainer.state.global_step = self.global_step

    def _train_epochs(
        self, plan: _StepPlan, epochs: int, n_resp: torch.Tensor, n_mb_max: int
    ) -> tuple[list[float], list[float], float | None]:
        """``epochs`` optimizer steps over the plan's micro-batches, each epoch in a new random order.
        Returns each epoch's summed loss, each step's gradient norm and the first epoch's largest
        behaviour-ratio deviation (None when no micro-batch carries engine log-probs)."""
        losses: list[float] = []
        grad_norms: list[float] = []
        ratio_dev: float | None = None
        for epoch in range(epochs):
            order = list(range(len(plan.mbs)))
            self._rng.shuffle(order)
            # Every rank runs the same number of backward passes (DDP would hang otherwise); a rank with
            # fewer micro-batches repeats one with its loss multiplied by zero.
            order += [order[-1] if order else -1] * (n_mb_max - len(order))
            self._wrapped.train()
            epoch_loss = 0.0
            for j, k in enumerate(order):
                last, dummy = j == len(order) - 1, k < 0 or j >= len(plan.mbs)
                loss, dev = self._backward(plan, k, n_resp, last=last, dummy=dummy, check_ratio=epoch == 0)
                epoch_loss += loss
                if dev is not None:
                    ratio_dev = dev if ratio_dev is None else max(ratio_dev, dev)
            grad_norms.append(self._optimizer_step())
            losses.append(epoch_loss)
        return losses, grad_norms, ratio_dev

    def _backward(
        self, plan: _StepPlan, k: int, n_resp: torch.Tensor, *, last: bool, dummy: bool, check_ratio: bool
    ) -> tuple[float, float | None]:
        """Forward and backward over micro-batch ``k``; gradients sync only on the epoch's ``last`` pass.
        Returns its loss (0 for a ``dummy`` pass, whose loss is multiplied by zero) and, with
        ``check_ratio`` and engine log-probs, its behaviour-ratio deviation."""
        tr, acc, model = self.trainer, self.trainer.accelerator, self._wrapped
        if k < 0:  # a rank with no transitions at all still joins the collective backward
            if self.fsdp is not None:  # FSDP2 gathers in each forward: run the same ones, on one token
                acc.backward(idle_loss(self))
            else:
                acc.backward(sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0)
            return 0.0, None
        mb = plan.mbs[k]
        inputs = self._tensors(plan.seqs, mb, plan.token_adv, plan.train_masks)
        inputs["num_items_in_batch"] = n_resp
        if plan.tis is not None:
            plan.tis.apply(k, inputs)
        if tr.beta != 0.0:
            inputs["ref_per_token_logps"] = self._ref_logps(inputs)
        sync = gradient_sync(acc, model, last)
        with sync, tr.compute_loss_context_manager(), local_metrics(acc):
            loss = tr.compute_loss(model, inputs)
            if dummy:
                loss = loss * 0.0
            acc.backward(loss)
        if dummy:
            return 0.0, None
        dev = ratio_deviation(tr.last_logps, inputs) if check_ratio and mb.has_logprobs else None
        return float(loss.detach().item()), dev

    def _optimizer_step(self) -> float:
        """Clip the accumulated gradients, step the optimizer and scheduler; returns the gradient norm."""
        tr = self.trainer
        average_gradients(self._wrapped)  # under DDP (agl.algorithms.distributed)
        norm = tr.accelerator.clip_grad_norm_(self._wrapped.parameters(), tr.args.max_grad_norm)
        tr.optimizer.step()
        if not self.adapters:  # per adapter, step() advances the shared schedule once per epoch
            tr.lr_scheduler.step()
        tr.optimizer.zero_grad(set_to_none=True)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        return float(norm.item()) if torch.is_tensor(norm) else float(norm or 0.0)

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
        model = self.full_model
        if not is_peft(model):
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
            self.full_model.save_pretrained(path)
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
        if self.fsdp is not None:  # the gathered state, in the one-process format
            return self.fsdp.save_checkpoint(self)
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
        if self.fsdp is not None:  # any process count's checkpoint, into this launch's shards
            self.fsdp.load_checkpoint(self, path)
        elif self.adapters:
            from agl.algorithms.per_agent_lora import load_adapter_checkpoint

            load_adapter_checkpoint(self, path)
        elif is_peft(model):
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            weights = os.path.join(path, "adapter_model.safetensors")
            if not os.path.isfile(weights):
                raise FileNotFoundError(f"{path} holds no LoRA adapter (adapter_model.safetensors)")
            # safetensors takes "cpu", not a rank's "cpu:<n>"
            device = "cpu" if self.device.type == "cpu" else str(self.device)
            set_peft_model_state_dict(model, load_file(weights, device=device))
        else:
            tr._load_from_checkpoint(path, self._wrapped)
        if self.fsdp is None:
            tr._load_optimizer_and_scheduler(path)
        with open(state_file) as f:
            self.global_step = int(json.load(f)["global_step"])
        tr.state.global_step = self.global_step
        return self.global_step


@dataclass
class _StepPlan:
    """What one update trains: the step's sequences with their loss masks and per-token advantages, the
    sequences this rank keeps (indices), their micro-batches, the number of trained calls and the merge
    statistics."""

    seqs: list[Trajectory]
    train_masks: list[list[int]]
    token_adv: list[list[float]]
    keep: list[int]
    mbs: list[MicroBatch]
    n_calls: int
    merge_stats: dict[str, Any]
    tis: DecoupledWeights | None = None  # decoupled PPO's proximal log-probs and weights (tis_cap)

    @property
    def response_tokens(self) -> int:
        """Trained response tokens of this rank's sequences."""
        return sum(sum(self.train_masks[k]) for k in self.keep)

    @property
    def tokens(self) -> int:
        return sum(self.seqs[k].tokens for k in self.keep)

    @property
    def tokens_packed(self) -> int:
        """Tokens this rank runs through the model per epoch: shared prefixes once, padding excluded."""
        return sum(mb.tokens for mb in self.mbs)


def _check_advantages(transitions: Sequence[Transition], advantages: Sequence[float]) -> None:
    if len(transitions) != len(advantages):
        raise ValueError(f"{len(transitions)} transitions but {len(advantages)} advantages")
    for a in advantages:
        if not math.isfinite(float(a)):
            raise ValueError(f"advantages must be finite, got {a!r}")


def _count_metrics(plan: _StepPlan, transitions: Sequence[Transition], n_tok: float) -> dict[str, float]:
    """The step's size: trained calls, sequences, skipped calls, calls cut at max_tokens, tokens (all
    ranks), this rank's trained response tokens and micro-batches, and the merge statistics."""
    return {
        "trained_transitions": float(plan.n_calls),
        "sequences": float(len(plan.keep)),
        "skipped": float(len(transitions) - plan.n_calls),
        "truncated_calls": float(sum(1 for t in transitions if t.truncated)),  # cut at max_tokens
        "update_tokens": n_tok,
        "tokens_flat": float(plan.tokens),  # this rank's sequences as they would run unshared
        "tokens_packed": float(plan.tokens_packed),  # what ran: each shared prefix once
        "response_tokens": float(plan.response_tokens),
        "micro_batches": float(len(plan.mbs)),
        **{k: float(v) for k, v in plan.merge_stats.items() if k in _MERGE_METRICS},
    }


def _finite_mean(values: Sequence[float]) -> float:
    """The mean of the finite values (TRL logs NaN for a metric a micro-batch could not compute), or 0."""
    vals = [v for v in values if math.isfinite(v)]
    return float(sum(vals) / len(vals)) if vals else 0.0


#: the merge statistics a step reports (agl.adapter.trajectories.MergeStats.as_dict keys)
_MERGE_METRICS = ("merge_rate", "tokens_saved", *(f"breaks_{cause}" for cause in BREAK_CAUSES))


def _train_mask(seq: Trajectory, trained: set[int]) -> list[int]:
    """The sequence's loss mask with the tokens of calls left out of this update zeroed."""
    mask = list(seq.loss_mask)
    for seg in seq.segments:
        if seg.transition not in trained:
            mask[seg.start : seg.end] = [0] * (seg.end - seg.start)
    return mask
