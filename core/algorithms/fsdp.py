"""FSDP2 for the update: sharded parameters, gradients and optimizer state (``torch.distributed.fsdp.
fully_shard``), chosen through accelerate's own configuration.

How it is asked for: ``accelerate launch --use_fsdp --fsdp_version 2 ...`` (or the same in the config
file that ``accelerate config`` writes) puts ``ACCELERATE_USE_FSDP=true`` and ``FSDP_VERSION=2`` in
every process's environment; under plain ``torchrun`` the same two variables do it
(``ACCELERATE_USE_FSDP=true FSDP_VERSION=2 torchrun --nproc-per-node N train.py``). FSDP1 is refused
(agl shards with FSDP2 only). agl applies ``fully_shard`` itself, on every device
(:func:`accelerate_without_fsdp` keeps accelerate to plain data parallelism while TRL builds its
``Accelerator``): accelerate's own FSDP would make the whole model the root unit, which agl's scoring
bypasses, and accelerate 1.15 turns FSDP on only on an accelerator, falling back to DDP on a CPU
without a word; there agl says in the log that it honours the request itself (gloo).

What holds:

- **units**: each decoder layer (the model's ``_no_split_modules`` classes, or
  ``FSDP_TRANSFORMER_CLS_TO_WRAP``) is one FSDP unit; the rest (embeddings, final norm, LM head — tied
  or not) is the root unit, a :class:`ScoringRoot` around the model. agl scores response tokens by
  running the decoder and the LM head apart (:mod:`agl.algorithms.scoring`); the root's ``forward``
  runs that scoring, so the root's parameters are gathered for it and its gradients reduce-scattered
  after it, exactly as for a plain forward;
- **the step equals the one-process step**: every backward pass reduce-scatters (averages) its
  gradients into the shards, and every rank runs as many forward passes as the rank with the most
  (:func:`idle_forward` for the missing ones), so the collectives pair up;
- **rank 0 keeps a plain copy** (:attr:`Sharded.replica`) of the model, refreshed after each step and
  each checkpoint load by gathering the trained tensors (``DTensor.full_tensor``, every rank takes
  part): the embedded engine serves it, LoRA/full pushes and checkpoints are written from it. Under
  LoRA only the adapters are gathered; under full-parameter training, every weight;
- **checkpoints are the one-process files** (adapter or model weights, ``optimizer.pt`` keyed as one
  process keys it, scheduler, trainer state): the optimizer state is gathered to rank 0 to save, and
  each rank takes its shard of it on load, so a checkpoint resumes at any process count.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from agl.algorithms.scoring import ScoringRoot, is_peft

if TYPE_CHECKING:
    from agl.algorithms.update import PolicyUpdate

__all__ = [
    "Sharded",
    "accelerate_without_fsdp",
    "idle_forward",
    "idle_loss",
    "match_forwards",
    "requested",
    "shard_policy",
]

log = logging.getLogger("agl.algorithms.fsdp")

#: accelerate's switch (``accelerate launch --use_fsdp``) and its FSDP version (``--fsdp_version``)
USE_ENV, VERSION_ENV = "ACCELERATE_USE_FSDP", "FSDP_VERSION"
#: accelerate's comma-separated layer classes to wrap (``--fsdp_transformer_layer_cls_to_wrap``)
LAYERS_ENV = "FSDP_TRANSFORMER_CLS_TO_WRAP"


def requested() -> bool:
    """Whether this launch asks for FSDP (accelerate's ``ACCELERATE_USE_FSDP``) on more than one
    process. Raises :class:`~agl.errors.UsageError` for an FSDP version other than 2."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1 or os.environ.get(USE_ENV, "false").lower() not in ("true", "1"):
        return False
    version = os.environ.get(VERSION_ENV, "1").strip()
    if version != "2":
        from agl.errors import UsageError

        raise UsageError(
            f"agl shards the update with FSDP2; got {VERSION_ENV}={version!r}: launch with "
            "--fsdp_version 2 (accelerate config: fsdp_version: 2)"
        )
    return True


@contextlib.contextmanager
def accelerate_without_fsdp() -> Iterator[None]:
    """Within it, accelerate does not see the FSDP request (while TRL builds its ``Accelerator``): it
    prepares plain data parallelism on every device, which :func:`shard_policy` then replaces with
    FSDP2 units of its own. Left to accelerate, FSDP would wrap the model itself as the root unit,
    whose parameters agl's scoring (the decoder and the head called apart) would use ungathered; and
    on a CPU accelerate would not shard at all."""
    saved = os.environ.pop(USE_ENV, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[USE_ENV] = saved


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _layer_classes(base: Any) -> set[str]:
    named = os.environ.get(LAYERS_ENV, "").strip()
    if named:
        return {c.strip() for c in named.split(",") if c.strip()}
    return set(getattr(base, "_no_split_modules", None) or [])


def _unwrap_ddp(wrapped: Any) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    return wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped


class Sharded:
    """The policy's FSDP2 state: the root unit (what the update runs), the model inside it, and on
    rank 0 the plain replica that pushes and checkpoints read."""

    def __init__(self, root: ScoringRoot, replica: Any, trains_all: bool) -> None:
        self.root = root
        self.model = root.module
        self.replica = replica
        self.trains_all = trains_all

    # ------------------------------------------------------------------------------ gathering
    def _trained(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if self.trains_all or p.requires_grad]

    @torch.no_grad()
    def refresh(self) -> None:
        """Gather the trained tensors into rank 0's replica (a collective: every rank calls it)."""
        mine = dict(self.replica.named_parameters()) if self.replica is not None else {}
        for name, p in self._trained():
            full = p.full_tensor() if _is_dtensor(p) else p.detach()
            if name in mine:
                mine[name].copy_(full.to(mine[name].device))
            del full

    @torch.no_grad()
    def scatter(self) -> None:
        """The reverse of :meth:`refresh`: rank 0's replica's trained tensors into every rank's shards
        (after a checkpoint was loaded into the replica)."""
        from torch.distributed.tensor import distribute_tensor

        mine = dict(self.replica.named_parameters()) if self.replica is not None else {}
        for name, p in self._trained():
            if not _is_dtensor(p):
                continue
            local = p.to_local()
            src = (
                mine[name].detach().to(local.device) if name in mine else torch.empty(p.shape, dtype=p.dtype)
            )
            part = distribute_tensor(src.to(local.device), p.device_mesh, p.placements, src_data_rank=0)
            local.copy_(part.to_local())

    def full_optimizer_state(self, optimizer: Any) -> dict[str, Any] | None:
        """The optimizer's state dict as one process has it (every tensor whole), on rank 0; None on
        the other ranks. A collective: every rank gathers each tensor in the same order."""
        sd = optimizer.state_dict()
        keep = self.replica is not None
        state: dict[int, dict[str, Any]] = {}
        for idx in sorted(sd["state"]):
            entry = {}
            for key, value in sd["state"][idx].items():
                full = value.full_tensor() if _is_dtensor(value) else value
                entry[key] = full.detach().cpu() if keep and torch.is_tensor(full) else full
            if keep:
                state[idx] = entry
        return {"state": state, "param_groups": sd["param_groups"]} if keep else None

    def load_optimizer_state(self, optimizer: Any, sd: dict[str, Any]) -> None:
        """Load a one-process optimizer state dict (whole tensors, read by every rank): each rank
        keeps its shard of each parameter's state."""
        from torch.distributed.tensor import distribute_tensor

        params = [p for group in optimizer.param_groups for p in group["params"]]
        for idx, entry in sd["state"].items():
            p = params[int(idx)]
            for key, value in list(entry.items()):
                if _is_dtensor(p) and torch.is_tensor(value) and tuple(value.shape) == tuple(p.shape):
                    local = value.to(device=p.to_local().device, dtype=p.dtype)
                    entry[key] = distribute_tensor(local, p.device_mesh, p.placements, src_data_rank=None)
        optimizer.load_state_dict(sd)

    # ---------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, policy: PolicyUpdate) -> str:
        """Write ``checkpoint-<step>`` in the one-process format from the gathered state."""
        tr = policy.trainer
        self.refresh()
        optim = self.full_optimizer_state(tr.optimizer)
        tr.state.global_step = policy.global_step
        saved_model, saved_optim = tr.model, tr.optimizer
        if self.replica is not None:  # rank 0 writes: the replica's weights, the gathered optimizer
            tr.model, tr.optimizer = self.replica, _Frozen(optim)
        try:
            tr._save_checkpoint(self.replica if self.replica is not None else self.root, trial=None)
        finally:
            tr.model, tr.optimizer = saved_model, saved_optim
        tr.accelerator.wait_for_everyone()
        return os.path.join(tr.args.output_dir, f"checkpoint-{policy.global_step}")

    def load_checkpoint(self, policy: PolicyUpdate, path: str) -> None:
        """Load a one-process-format checkpoint (written at any process count) into every rank's
        shards, its optimizer state and scheduler."""
        if self.replica is not None:
            _load_weights(self.replica, path, policy.trainer)
        self.scatter()
        tr = policy.trainer
        optim = os.path.join(path, "optimizer.pt")
        if os.path.isfile(optim):
            self.load_optimizer_state(tr.optimizer, torch.load(optim, map_location="cpu", weights_only=True))
        sched = os.path.join(path, "scheduler.pt")
        if os.path.isfile(sched):
            tr.lr_scheduler.load_state_dict(torch.load(sched, map_location="cpu", weights_only=True))
        tr.accelerator.wait_for_everyone()


class _Frozen:
    """Stands for the optimizer while rank 0 saves: its state dict is the gathered one."""

    def __init__(self, sd: Any) -> None:
        self._sd = sd

    def state_dict(self) -> Any:
        return self._sd


def _load_weights(model: Any, path: str, trainer: Any) -> None:
    """A checkpoint's adapter or full weights into the plain ``model`` (rank 0's replica)."""

    if is_peft(model):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        weights = os.path.join(path, "adapter_model.safetensors")
        if not os.path.isfile(weights):
            raise FileNotFoundError(f"{path} holds no LoRA adapter (adapter_model.safetensors)")
        set_peft_model_state_dict(model, load_file(weights, device="cpu"))
        return
    from transformers.modeling_utils import load_sharded_checkpoint

    if os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        load_sharded_checkpoint(model, path, strict=False)
        return
    from safetensors.torch import load_file

    weights = os.path.join(path, "model.safetensors")
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"{path} holds no model weights (model.safetensors)")
    model.load_state_dict(load_file(weights, device="cpu"), strict=False)


def shard_policy(policy: PolicyUpdate) -> Sharded:
    """Apply FSDP2 to the policy built by TRL/accelerate (undoing accelerate's DDP fallback on CPU):
    ``fully_shard`` on each decoder layer, then on a :class:`ScoringRoot` around the model, which
    becomes the policy's ``_wrapped``; the optimizer is pointed at the sharded parameters (it has no
    state yet)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if policy.adapters:
        from agl.errors import UsageError

        raise UsageError("adapter_per_agent does not run under FSDP2 yet: launch it with DDP")
    tr, acc = policy.trainer, policy.trainer.accelerator
    model = _unwrap_ddp(policy._wrapped)
    if acc.device.type == "cpu":  # said plainly: accelerate alone would have run DDP here
        log.warning(
            "FSDP2 asked for (%s=true) on CPU, where accelerate falls back to DDP: agl applies "
            "fully_shard itself (decoder layers, then the root)",
            USE_ENV,
        )
    old = {name: p for name, p in model.named_parameters()}
    trains_all = all(p.requires_grad for p in old.values())
    replica = copy.deepcopy(model) if acc.is_main_process else None
    base = model.get_base_model() if is_peft(model) else model
    classes = _layer_classes(base)
    mesh = init_device_mesh(acc.device.type, (acc.num_processes,))
    layers = [m for m in base.modules() if type(m).__name__ in classes]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    root = ScoringRoot(model)
    fully_shard(root, mesh=mesh)
    new = dict(model.named_parameters())
    by_id = {id(p): name for name, p in old.items()}
    for group in tr.optimizer.param_groups:
        group["params"] = [new[by_id[id(p)]] for p in group["params"]]
    tr.model_wrapped = policy._wrapped = root
    acc._models = [root if _unwrap_ddp(m) is model else m for m in acc._models]
    log.info(
        "agl update: FSDP2 over %d processes, %d %s units + the root",
        acc.num_processes,
        len(layers),
        "/".join(sorted(classes)) or "layer",
    )
    return Sharded(root, replica, trains_all)


def idle_forward(root: Any, pad_id: int, device: Any) -> torch.Tensor:
    """A one-token forward through the whole sharded model, its output summed (times zero by the
    caller): the passes a rank runs when it has fewer micro-batches than another."""
    ids = torch.full((1, 1), int(pad_id), dtype=torch.long, device=device)
    out = root(input_ids=ids, use_cache=False)
    return out.logits.float().sum()


def idle_loss(policy: PolicyUpdate) -> torch.Tensor:
    """The zero loss of a pass on a rank without micro-batches, through the same forwards as a real
    pass: the KL reference's (the policy with its adapters off) when there is one, then the policy's."""
    tr, root = policy.trainer, policy._wrapped
    if tr.beta != 0.0 and tr.ref_model is None:
        with torch.no_grad():
            idle_forward(root, policy.pad_id, policy.device)
    return idle_forward(root, policy.pad_id, policy.device) * 0.0


def match_forwards(policy: PolicyUpdate, done: int) -> None:
    """Run no-grad idle forwards until this rank has run as many as the rank that ran the most
    (under FSDP2 every forward all-gathers, so the counts must agree). A no-op otherwise."""
    sharded = getattr(policy, "fsdp", None)
    if sharded is None:
        return
    acc = policy.trainer.accelerator
    most = int(acc.gather(torch.tensor([done], device=acc.device)).max().item())
    with torch.no_grad():
        for _ in range(most - done):
            idle_forward(sharded.root, policy.pad_id, acc.device)
