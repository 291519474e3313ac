"""Decoupled PPO for transitions sampled by older weights (``LoopConfig.off_policy = "tis"``).

Asynchronous training keeps groups served by weights more than ``max_staleness`` versions old when
``off_policy="tis"``. Their recorded behaviour log-probs (``Transition.response_logprobs``, the engine's
own) then come from a policy the update no longer resembles, so PPO's ratio ``pi_theta / pi_behaviour``
would be clipped on most tokens and carry no gradient. Decoupled PPO (Hilton et al., 2022; AReaL) splits
it in two:

- the PPO ratio is taken against the *proximal* policy: the current policy at the start of the update
  (its detached log-probs, scored once before the first epoch), clipped as usual;
- each token's loss is weighted by the truncated importance weight ``min(pi_prox / pi_behaviour, cap)``
  (detached), which corrects for the tokens having been sampled by the behaviour policy while bounding
  the variance a single very unlikely token could add.

Since the weight is positive and detached, weighting the loss equals weighting the token's advantage
(``-w * min(r * A, clip(r) * A) = -min(r * wA, clip(r) * wA)``), so TRL's loss is used unchanged with the
weighted advantages and the proximal log-probs as its ``old_per_token_logps``. On fresh transitions
(served by the current weights) ``pi_prox = pi_behaviour`` up to float error: weight 1, the usual loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from agl.algorithms.update import PolicyUpdate

__all__ = ["DecoupledWeights", "decoupled_weights", "ratio_deviation", "truncated_weights"]


def truncated_weights(
    proximal: torch.Tensor, behaviour: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``min(exp(proximal - behaviour), cap)`` and whether each token's weight was truncated."""
    ratio = torch.exp(proximal.float() - behaviour.float())
    return ratio.clamp(max=cap), ratio > cap


def ratio_deviation(logps: torch.Tensor | None, inputs: dict[str, Any]) -> float:
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


@dataclass
class DecoupledWeights:
    """The proximal log-probs and truncated weights of one update's micro-batches (by index; a
    micro-batch without behaviour log-probs has none), and the share of trained tokens truncated."""

    proximal: dict[int, torch.Tensor] = field(default_factory=dict)
    weights: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: int = 0
    clipped: int = 0
    weight_sum: float = 0.0
    #: max |pi_prox / pi_behaviour - 1| over the trained tokens: the behaviour-ratio deviation the plain
    #: path reports (``behaviour_ratio_dev``), here against the proximal policy (None: no trained token)
    max_dev: float | None = None

    def apply(self, k: int, inputs: dict[str, Any]) -> None:
        """Turn micro-batch ``k``'s TRL inputs into decoupled-PPO inputs (see the module docstring)."""
        if k in self.weights:
            inputs["old_per_token_logps"] = self.proximal[k]
            inputs["advantages"] = inputs["advantages"] * self.weights[k]

    def metrics(self) -> dict[str, float]:
        """``tis_clip_fraction`` (trained tokens whose weight hit the cap) and ``tis_weight_mean``."""
        n = max(self.tokens, 1)
        return {
            "tis_clip_fraction": self.clipped / n,
            "tis_weight_mean": self.weight_sum / n if self.tokens else 1.0,
        }


@torch.no_grad()
def decoupled_weights(policy: PolicyUpdate, plan: Any, cap: float) -> DecoupledWeights:
    """Score every micro-batch of ``plan`` that carries behaviour log-probs under the current policy
    (the proximal policy, before any optimizer step of this update) and compute its truncated weights.
    Tokens outside the loss mask get weight 1 and are not counted."""
    out = DecoupledWeights()
    tr, model = policy.trainer, policy._wrapped
    was_training = model.training
    model.eval()
    forwards = 0
    try:
        for k, mb in enumerate(plan.mbs):
            if not mb.has_logprobs:
                continue
            forwards += 1
            inputs = policy._tensors(plan.seqs, mb, plan.token_adv, plan.train_masks)
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            keep = inputs["completion_ids"].size(1)
            prox, _, _ = tr._get_per_token_logps_and_entropies(model, ids, mask, keep)
            w, clipped = truncated_weights(prox, inputs["old_per_token_logps"], cap)
            trained = inputs["completion_mask"].bool()
            if "tool_mask" in inputs:
                trained = trained & inputs["tool_mask"].bool()
            out.proximal[k] = prox.detach()
            out.weights[k] = torch.where(trained, w, torch.ones_like(w))
            out.tokens += int(trained.sum().item())
            out.clipped += int((clipped & trained).sum().item())
            out.weight_sum += float(w.masked_select(trained).sum().item())
            if trained.any():
                dev = ratio_deviation(prox, inputs)
                out.max_dev = dev if out.max_dev is None else max(out.max_dev, dev)
        from agl.algorithms.fsdp import match_forwards

        match_forwards(policy, forwards)  # FSDP2: as many (all-gathering) forwards on every rank
    finally:
        model.train(was_training)
    return out
