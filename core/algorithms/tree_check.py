"""Whether a model can take tree-packed micro-batches exactly (:func:`sharing_refusal`): checked once
per policy, before the first shared-prefix update, by its config and by a two-sequence probe whose
tree-packed log-probs must equal the unshared ones. Apart from :mod:`agl.algorithms.prefix_tree` (the
planner and the packed inputs) because the probe packs and scores micro-batches, which import the
planner."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agl.algorithms.update import PolicyUpdate

__all__ = ["TREE_ATTENTION", "sharing_refusal"]


#: the attention implementations whose handling of a custom 4D mask agl knows (transformers passes a
#: 4D mask through as is; eager adds it to the scores, SDPA takes it as ``attn_mask``). Flash attention
#: keeps only causality and padding, flex attention wants a BlockMask.
TREE_ATTENTION = ("eager", "sdpa")
#: the probe's tolerance on log-probs, relative to the largest |log-prob| (float32 sums in another
#: order differ by ~1e-6 of it; a mask or position ids not honoured differ by far more): float32
#: weights, and anything lower
_PROBE_TOL = {True: 1e-4, False: 5e-2}


def sharing_refusal(policy: PolicyUpdate) -> str | None:
    """Why ``policy``'s model cannot run tree-packed micro-batches exactly, or None when it can.

    Refused: logits that are not a plain projection of the last hidden state; an attention
    implementation other than :data:`TREE_ATTENTION`; sliding-window layers (the custom mask would
    replace their window); and any model whose log-probs on a two-sequence tree differ from the unshared ones, or whose forward
    raises on it (ALiBi models such as Bloom build their bias from a 2D mask; others ignore
    position ids)."""
    from agl.algorithms.scoring import backbone_and_head

    parts = backbone_and_head(policy.model)
    if parts is None:
        return "the model's logits are not a plain projection of its last hidden state"
    cfg = parts[0].config
    attn = getattr(cfg, "_attn_implementation", None)
    if attn not in TREE_ATTENTION:
        return (
            f"attention implementation {attn!r} takes no custom 4D mask (agl uses it with {TREE_ATTENTION})"
        )
    types = getattr(cfg, "layer_types", None) or ()
    if any("sliding" in str(t) or "chunked" in str(t) for t in types) or (
        not types and getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)
    ):
        return "the model has sliding-window attention layers"
    return _probe(policy)


def _probe(policy: PolicyUpdate) -> str | None:
    """Score two sequences sharing a prompt, tree-packed and unshared, and compare their log-probs."""
    import torch

    from agl.adapter.trajectories import Trajectory
    from agl.algorithms.packing import MicroBatch, pack_micro_batches

    base = policy.model.get_input_embeddings().num_embeddings // 2  # ordinary tokens, not special ones
    prompt = tuple(base + k for k in range(5))
    tails = ((base + 9, base + 7, base + 8), (base + 6, base + 9, base + 7, base + 8))
    seqs = [
        Trajectory(
            rollout_id=f"probe{k}", attempt=1, prompt_ids=prompt, completion_ids=t, loss_mask=(1,) * len(t),
            segments=(),
        )
        for k, t in enumerate(tails)
    ]  # fmt: skip
    [tree_mb] = pack_micro_batches(seqs, 64, share_cost=0.0)
    flat_mb = MicroBatch(rows=tree_mb.rows, prompt_len=5, response_len=4, has_logprobs=False)
    tr, model = policy.trainer, policy._wrapped
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = []
            for mb in (flat_mb, tree_mb):
                inputs = policy._tensors(seqs, mb)
                ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
                mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
                lp, _, _ = tr._get_per_token_logps_and_entropies(model, ids, mask, ids.size(1) - 5)
                out.append(lp.float().masked_select(inputs["completion_mask"].bool()))
    except Exception as exc:  # noqa: BLE001 - any failure of the model on the layout means: not for it
        return f"the model's forward refused the tree layout ({type(exc).__name__}: {exc})"
    finally:
        tr.packed = None
        model.train(was_training)
    dev = float((out[0] - out[1]).abs().max().item())
    fp32 = policy.precision == "no" and next(model.parameters()).dtype == torch.float32
    if not dev <= _PROBE_TOL[fp32] * max(1.0, float(out[0].abs().max().item())):
        return (
            f"its log-probs on a shared prefix differ from the unshared ones by {dev:.2g} (its attention "
            "does not honour a custom mask or the position ids)"
        )
    return None
