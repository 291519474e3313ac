"""What weighs the same in the loss (``UpdateSettings.loss_balance``): each token, each call, or each
rollout.

The update's loss is a token mean (DAPO's): a rollout that made 5 calls, or wrote 5 times the tokens,
weighs 5 times as much as one that made 1. :func:`balance_weights` gives each trained call a factor for
its tokens so that, under ``"transition"``, every trained call's tokens together weigh the same, and
under ``"rollout"`` every rollout's trained calls together weigh the same (slime's per-rollout mean),
whatever the merging into sequences (a factor is per call, so a merged sequence carries each of its
calls' own) and whatever the agents (a rollout is its ``(rollout_id, attempt)``, across agents). The
factors keep the sum of all trained tokens' weights equal to the trained token count, so the loss's
scale, and its normaliser, stay those of ``"token"``. The update multiplies each call's advantage by its
factor: for a positive factor that is the same as weighting the PPO-clip term, since
``min(r·wA, clip(r)·wA) = w·min(r·A, clip(r)·A)`` (a KL term, when on, is not reweighted).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from agl.types import Transition

__all__ = ["balance_weights"]


def balance_weights(transitions: Sequence[Transition], trained: Collection[int], mode: str) -> list[float]:
    """One factor per transition (1.0 for the calls not trained, and for every call under ``"token"``)."""
    out = [1.0] * len(transitions)
    calls = [i for i in sorted(trained) if transitions[i].response_ids]
    total = sum(len(transitions[i].response_ids) for i in calls)
    if mode == "token" or not calls:
        return out
    if mode == "transition":
        for i in calls:
            out[i] = total / (len(calls) * len(transitions[i].response_ids))
        return out
    tokens: dict[tuple[str, int], int] = {}
    for i in calls:
        key = (transitions[i].rollout_id, transitions[i].attempt)
        tokens[key] = tokens.get(key, 0) + len(transitions[i].response_ids)
    for i in calls:
        out[i] = total / (len(tokens) * tokens[(transitions[i].rollout_id, transitions[i].attempt)])
    return out
