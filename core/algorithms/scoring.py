"""How the policy scores response tokens: TRL's ``GRPOTrainer`` fed with transitions, and a chunked LM head.

:class:`TransitionGRPOTrainer` is the ``trl.GRPOTrainer`` that :class:`agl.algorithms.update.PolicyUpdate`
drives. It never generates or computes rewards (transitions and advantages come from the store), and where
TRL's fused head would score every position (no Triton: CPU), it runs the decoder and scores only the
response positions, ``SCORE_CHUNK_TOKENS`` at a time under activation checkpointing
(:func:`chunked_token_logps`), so no batch x length x vocab logits tensor is held for backward.

A tree-packed micro-batch (:mod:`agl.algorithms.prefix_tree`) is scored the same way after one forward
over its tree rows: :class:`~agl.algorithms.prefix_tree.PackedInputs` registered as the trainer's
``packed`` say which flat inputs they stand for, and each response token's hidden state is gathered
from its place in the tree. TRL's loss, the reference's log-probs and the proximal policy's of
decoupled PPO all go through this one method, so all of them run on the tree.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import GRPOTrainer

from agl.algorithms.prefix_tree import PackedInputs

__all__ = [
    "SCORE_CHUNK_TOKENS",
    "ScoringRoot",
    "TransitionGRPOTrainer",
    "backbone_and_head",
    "chunked_token_logps",
    "is_peft",
]


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


def backbone_and_head(model: Any) -> tuple[Any, Any] | None:
    """The decoder stack and LM head of a (peft-wrapped) causal LM whose logits are a plain projection
    of the last hidden state; None for models that scale or soft-cap their logits."""
    base = model.get_base_model() if is_peft(model) else model
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


class TransitionGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` fed with precomputed transitions: generation and rewards are never used."""

    #: the policy's per-token log-probs of the last scored batch (detached), for the on-policy check
    last_logps: torch.Tensor | None = None
    #: the tree layout of the micro-batch being scored (set by ``PolicyUpdate._tensors``); it applies
    #: only to a call for exactly its flat ids, so any other call (another batch, inspection) runs flat
    packed: PackedInputs | None = None

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """No card from TRL: its template, written beside every checkpoint, names no base model for a
        local folder ("a fine-tuned version of [None]") and describes a generic GRPO run. The true card
        is written by ``agl export model`` (:mod:`agl.reports.model_card`) from the run's own record."""

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

        plain = not (compute_aux_loss or any(v is not None for v in kwargs.values()))
        packed = self.packed if plain and self.packed is not None else None
        if packed is not None and not packed.matches(input_ids, logits_to_keep):
            packed = None
        parts, inner = None, self.accelerator.unwrap_model(model)
        root = inner if isinstance(inner, ScoringRoot) else None  # FSDP2 (agl.algorithms.fsdp)
        if plain and (packed is not None or not _use_triton(input_ids.device)):
            parts = backbone_and_head(root.module if root is not None else inner)
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

            def score() -> tuple[torch.Tensor, torch.Tensor]:
                decoder, head = parts
                if packed is not None:
                    return self._tree_logps(decoder, head, packed)
                with self.accelerator.autocast():
                    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)[0]
                hidden, targets = hidden[:, -logits_to_keep - 1 : -1, :], input_ids[:, -logits_to_keep:]
                return chunked_token_logps(hidden, targets, head, self.temperature)

            # under FSDP2 the scoring runs as the root unit's forward (ScoringRoot, applied by agl.algorithms.fsdp)
            logps, ent = root(fn=score) if root is not None else score()
            entropies, aux = (ent if compute_entropy else None), None
        self.last_logps = logps.detach()
        return logps, entropies, aux

    def _tree_logps(self, decoder: Any, head: Any, packed: PackedInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the tree rows; each trained response token scored from the hidden state
        that predicts it in the tree. Padding and context (tool results, untrained calls) are not
        scored: log-prob and entropy 0 there, outside every mask the loss and its metrics use.
        Returns flat (sequences, response positions) log-probs and entropies."""
        attn = getattr(decoder.config, "_attn_implementation", None)
        dtype = decoder.get_input_embeddings().weight.dtype
        with self.accelerator.autocast():
            hidden = decoder(
                input_ids=packed.ids,
                attention_mask=packed.attention_mask(attn, dtype),
                position_ids=packed.positions,
                use_cache=False,
            )[0]
        states = hidden.reshape(-1, hidden.size(-1)).index_select(0, packed.gather)
        flat = packed.flat_ids[:, -packed.keep :]
        targets = flat.reshape(-1).index_select(0, packed.valid)
        lp, ent = chunked_token_logps(states[None], targets[None], head, self.temperature)
        out = torch.zeros(flat.numel(), dtype=lp.dtype, device=lp.device)
        logps = out.index_copy(0, packed.valid, lp[0]).view_as(flat)
        entropies = torch.zeros_like(out).index_copy(0, packed.valid, ent[0]).view_as(flat)
        return logps, entropies

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:  # pragma: no cover - guard
        raise RuntimeError("agl's policy update gets transitions from the store; it never generates")


def is_peft(model: Any) -> bool:
    """Whether ``model`` is a peft-wrapped (LoRA) model; False when peft is not installed."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is part of agl[train]
        return False
    return isinstance(model, PeftModel)


class ScoringRoot(torch.nn.Module):
    """The root FSDP unit: the model, and a ``forward`` that runs ``fn`` (agl's scoring, which calls
    the decoder and the LM head apart) or, without ``fn``, the model's own forward."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, fn: Any = None, **kwargs: Any) -> Any:
        if fn is None:
            return self.module(*args, **kwargs)
        # FSDP2 hooks the outputs for the backward's gathers; a view's hook an in-place op would drop,
        # so the (small: sequences x response positions) outputs leave as tensors of their own
        return tuple(
            t.clone() if torch.is_tensor(t) and t._base is not None else t for t in fn(*args, **kwargs)
        )
