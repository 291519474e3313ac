"""The update on several processes (``torchrun`` / ``accelerate launch``): which sequences each rank
trains, the step's figures summed over ranks, and the bounded collective timeout.

What holds, and why the step equals the one-process step:

- every rank gets the whole step (the same transitions and advantages), so every rank plans the same
  sequences; :func:`shard` then gives each rank a disjoint share, balanced by tokens (largest first to
  the least loaded rank) with the sequences of one prompt together, and each rank packs its share
  under the same ``micro_batch_tokens`` budget (shared prefixes as a tree, as on one process);
- the loss's normaliser is the trained response-token count summed over all ranks
  (``PolicyUpdate._totals``); TRL divides it by the number of processes and the gradients are averaged
  over ranks, so the gradient is the one-process gradient of the token-mean loss over the whole step;
- under DDP the gradients are averaged by :func:`average_gradients`, once per optimizer step, not by
  DDP's backward hooks: agl's scoring runs the decoder and the LM head apart (only response positions
  are scored), past the DDP wrapper's forward, which is what arms those hooks. Every pass therefore runs
  in ``no_sync`` (:func:`gradient_sync`) and the trained gradients are all-reduced in one flat bucket.
  FSDP2 shards through hooks on the modules themselves, so its own reduce-scatter runs as usual;
- every rank runs as many backward passes as the rank with the most micro-batches (a rank with fewer,
  or none, repeats one with its loss multiplied by zero), so no collective waits for ever;
- the logged loss is the mean of the ranks' losses (:func:`reduce_metrics`): TRL scales each rank's
  loss by the number of ranks (its gradients are averaged), so the mean is the figure one process logs;
  the step's counts (sequences, tokens, micro-batches) are summed over ranks.

A collective that waits longer than :func:`timeout_s` (``AGL_DIST_TIMEOUT_S``, default 600 s) fails
the run with an error instead of hanging: a rank that died or hung is noticed within that time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

__all__ = [
    "AVERAGED",
    "SUMMED",
    "TIMEOUT_ENV",
    "average_gradients",
    "gradient_sync",
    "local_metrics",
    "reduce_metrics",
    "shard",
    "timeout_s",
]

#: the environment variable bounding how long a collective may wait (seconds)
TIMEOUT_ENV = "AGL_DIST_TIMEOUT_S"
_DEFAULT_TIMEOUT_S = 600.0
#: the per-rank step counts summed over ranks in the logged record
SUMMED = ("sequences", "tokens_flat", "tokens_packed", "response_tokens", "micro_batches")
#: TRL's per-micro-batch means, taken on each rank alone (:func:`local_metrics`)
AVERAGED = ("kl", "clip_fraction", "entropy")


def timeout_s() -> float:
    """Seconds a collective of the update may wait for the other ranks (``AGL_DIST_TIMEOUT_S``)."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else _DEFAULT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        from agl.errors import UsageError

        raise UsageError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


def shard(
    keep: Sequence[int],
    tokens: Sequence[int],
    rank: int,
    world: int,
    together: Sequence[Hashable] | None = None,
) -> list[int]:
    """Rank ``rank``'s share of the sequences ``keep`` (``tokens[i]``: sequence i's token count).
    Sequences with the same ``together[i]`` (a group's prompt) stay on one rank, so that their shared
    prefix is still run once (:mod:`agl.algorithms.prefix_tree`), unless there are fewer prompts than
    ranks (then each sequence goes alone, so no rank idles); the largest unit goes to the least
    loaded rank, ties to the lower rank. The shares are disjoint, cover ``keep``, are the same on every
    rank and carry about the same tokens. Returned in index order."""
    if world <= 1:
        return list(keep)
    if together is not None and len({together[i] for i in keep}) < world:
        together = None  # fewer prompts than ranks: every rank busy beats a prefix run once
    units: dict[Hashable, list[int]] = {}
    for i in keep:
        units.setdefault(together[i] if together is not None else i, []).append(i)
    load = [0] * world
    mine: list[int] = []
    sized = sorted(units.values(), key=lambda u: (-sum(tokens[i] for i in u), u[0]))
    for unit in sized:
        r = min(range(world), key=lambda r: (load[r], r))
        load[r] += sum(tokens[i] for i in unit)
        mine += unit if r == rank else []
    return sorted(mine)


def _is_ddp(model: Any) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def gradient_sync(accelerator: Any, model: Any, last: bool) -> Any:
    """The context of one backward pass: accelerate's ``no_sync`` except on the epoch's ``last`` pass,
    and always under DDP (its gradients are averaged by :func:`average_gradients` instead)."""
    from agl.algorithms.scoring import ScoringRoot

    if (last and not _is_ddp(model)) or isinstance(model, ScoringRoot):  # FSDP2: every pass reduces
        return contextlib.nullcontext()
    return accelerator.no_sync(model)


def average_gradients(model: Any) -> None:
    """Under DDP: average the trained parameters' gradients over ranks (one all-reduce of one flat
    tensor; a parameter without a gradient counts as zeros, so every rank sends the same layout)."""
    if not _is_ddp(model):
        return
    import torch
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


@contextlib.contextmanager
def local_metrics(accelerator: Any) -> Iterator[None]:
    """Within it, ``accelerator.gather``/``reduce`` leave tensors as they are. TRL's loss gathers its
    metrics across ranks after every micro-batch, assuming every rank's micro-batch has as many rows;
    agl's micro-batches are packed per rank by tokens, so they do not, and a gather of unequal tensors
    fails. The figures are reduced once per step instead (:func:`reduce_metrics`)."""
    if accelerator.num_processes <= 1:
        yield
        return
    accelerator.gather = lambda tensor: tensor
    accelerator.reduce = lambda tensor, reduction="sum", scale=1.0: tensor
    try:
        yield
    finally:  # the instance attributes hid the class's methods; removing them brings those back
        del accelerator.gather, accelerator.reduce


def reduce_metrics(accelerator: Any, metrics: dict[str, float]) -> None:
    """Over ranks, in place: sum the counts :data:`SUMMED`, average the loss, and average the means
    :data:`AVERAGED` weighted by each rank's micro-batches (a rank without any has no figure). The loss
    is a plain mean because TRL scales each rank's part of the step's token mean by the number of ranks
    (whose gradients are averaged): the mean is the figure one process logs."""
    if accelerator.num_processes <= 1:
        return
    import torch

    mbs = float(metrics.get("micro_batches", 0.0))
    summed = [k for k in SUMMED if k in metrics]
    averaged = [k for k in AVERAGED if k in metrics]
    local = [
        float(metrics.get("loss", 0.0)),
        *(metrics[k] for k in summed),
        *(metrics[k] * mbs for k in averaged),
    ]
    total = accelerator.reduce(
        torch.tensor(local, dtype=torch.float64).to(accelerator.device), reduction="sum"
    )
    loss, *rest = total.cpu().tolist()
    if "loss" in metrics:
        metrics["loss"] = loss / accelerator.num_processes
    for k, v in zip(summed, rest, strict=False):
        metrics[k] = float(v)
    all_mbs = max(float(metrics.get("micro_batches", 1.0)), 1.0)
    for k, v in zip(averaged, rest[len(summed) :], strict=True):
        metrics[k] = float(v) / all_mbs
