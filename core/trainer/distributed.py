"""The Trainer on several processes: an unchanged ``Trainer(...).fit(...)`` script under ``torchrun
--nproc-per-node N`` or ``accelerate launch --num-processes N`` (one host or many, with the usual
rendezvous variables).

Who does what:

- **rank 0 leads**: it runs the whole ``fit`` as one process does — the store, the gateway and its
  engine (or the vLLM upstream), enqueueing, collecting, the adapter, weight pushes, metrics,
  checkpoints' run state, the progress bar. Its policy is a :class:`LeaderPolicy`: each call the ranks
  must make together (an update, a checkpoint save or load, an adapter or weights save) is first sent
  to the other ranks, with its arguments (a step's transitions and advantages), then made here;
- **every other rank follows** (:func:`follow_fit`): it builds the same policy, then makes the calls rank
  0 sends, in the same order, until rank 0 ends the run; it opens no store, gateway, metrics file or
  bar, and ``fit`` returns rank 0's summary on every rank.

The update itself shards each step's sequences across the ranks and averages their gradients so the
step equals the one-process step (:mod:`agl.algorithms.distributed`). The calls travel on a gloo group
of their own whose timeout is long (a step's rollouts may take hours while the followers wait); the
update's collectives run on the default group, bounded by ``AGL_DIST_TIMEOUT_S``. A rank that dies is
noticed by the launcher (``torchrun`` stops the others) or, at the latest, by the next collective's
timeout; the run then resumes from its last checkpoint with ``resume=True``.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agl.trainer.trainer import Trainer

__all__ = [
    "COLLECTIVE",
    "Channel",
    "LeaderPolicy",
    "check_data_parallel",
    "end",
    "follow",
    "follow_fit",
    "is_follower",
    "lead",
]

log = logging.getLogger("agl.trainer")

#: the policy calls every rank makes together (each joins the update's collectives or barriers)
COLLECTIVE = frozenset(
    {"step", "save_checkpoint", "load_checkpoint", "save_adapter", "save_weights", "response_logprobs"}
)
#: how long a follower waits for rank 0's next call: a step's rollouts may take this long
_CHANNEL_TIMEOUT = datetime.timedelta(days=7)


def world_size() -> int:
    """The number of processes the launcher started (``WORLD_SIZE``; 1 outside a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def rank() -> int:
    """This process's rank (``RANK``; 0 outside a launcher)."""
    return int(os.environ.get("RANK", "0") or 0)


def is_follower() -> bool:
    """Whether this process is a rank other than 0 of a multi-process launch."""
    return world_size() > 1 and rank() != 0


def init() -> None:
    """Join the launch's process group (once): gloo on CPU, nccl with one GPU per local rank, the
    collectives bounded by ``AGL_DIST_TIMEOUT_S``. Accelerate then works in this group."""
    import torch
    import torch.distributed as dist

    from agl.algorithms.distributed import timeout_s

    if world_size() <= 1 or dist.is_initialized():
        return
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s())
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    log.info("agl trainer: rank %d of %d joined the process group", rank(), world_size())


class Channel:
    """Rank 0's calls to the other ranks: pickled objects broadcast on a gloo group of their own."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = dist.new_group(backend="gloo", timeout=_CHANNEL_TIMEOUT)

    def send(self, message: Any) -> None:
        self._dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self) -> Any:
        box: list[Any] = [None]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class LeaderPolicy:
    """Rank 0's policy: a :class:`~agl.algorithms.update.PolicyUpdate` whose :data:`COLLECTIVE` calls are
    first sent to the other ranks. Everything else reads and writes the policy itself."""

    def __init__(self, policy: Any, channel: Channel) -> None:
        object.__setattr__(self, "_policy", policy)
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "ended", False)
        # one collective call at a time, sent and made under the lock: the asynchronous schedule updates
        # in a thread while a push may save the adapter in another; the ranks must see one order
        object.__setattr__(self, "_lock", threading.RLock())

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # the engine and saves read whole tensors: under FSDP2, rank 0's replica
            return self._policy.full_model
        value = getattr(self._policy, name)
        if name in COLLECTIVE and callable(value):
            return functools.partial(self._call, name)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._policy, name, value)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self.ended:
                raise RuntimeError(f"the distributed run has ended: cannot call {name}()")
            self._channel.send(("call", name, args, kwargs))
            try:
                return getattr(self._policy, name)(*args, **kwargs)
            except BaseException:
                # the followers may still be inside this call's collectives: a message now would
                # wait for them for ever; rank 0's exit is what stops them (the launcher)
                object.__setattr__(self, "ended", True)
                raise

    def end(self, summary: dict[str, Any] | None) -> None:
        """Release the followers: ``summary`` is what their ``fit`` returns (None: rank 0 failed)."""
        with self._lock:
            if not self.ended:
                object.__setattr__(self, "ended", True)
                self._channel.send(("end", summary))


def check_data_parallel(policy: Any) -> None:
    """Refuse the launches agl does not run: DeepSpeed and Megatron through ``accelerate config``.
    DDP and FSDP2 run (:mod:`agl.algorithms.fsdp`; FSDP1 is refused when the policy is built)."""
    kind = str(getattr(policy.trainer.accelerator.distributed_type, "value", "NO")).upper()
    if kind in ("DEEPSPEED", "MEGATRON_LM"):
        from agl.errors import UsageError

        raise UsageError(
            f"agl's Trainer runs several processes with DDP or FSDP2; {kind} is not supported: "
            "launch without --use_deepspeed/--use_megatron_lm (or with --use_fsdp --fsdp_version 2)"
        )


def lead(policy: Any) -> Any:
    """On rank 0 of a multi-process launch, ``policy`` as a :class:`LeaderPolicy`; else ``policy``."""
    if world_size() <= 1:
        return policy
    check_data_parallel(policy)
    return policy if rank() != 0 else LeaderPolicy(policy, Channel())


def end(policy: Any, summary: dict[str, Any] | None) -> None:
    """End the followers' loop (a no-op outside a multi-process launch or once ended)."""
    if isinstance(policy, LeaderPolicy):
        policy.end(summary)


def same_source(source: Any) -> Any:
    """The model source every rank builds: rank 0's when it is a path (the default model is prepared
    there), else this rank's own (a model object the script built is the same on every rank)."""
    if world_size() <= 1:
        return source
    import torch.distributed as dist

    box = [str(source) if isinstance(source, (str, os.PathLike)) else None]
    dist.broadcast_object_list(box, src=0)
    return box[0] if box[0] is not None else source


def follow(policy: Any, channel: Channel) -> dict[str, Any]:
    """Make rank 0's calls on this rank's ``policy`` until it ends the run; returns its summary.
    Raises when rank 0 ended the run on an error (so the launcher reports the failure)."""
    calls = 0
    while True:
        message = channel.receive()
        if message[0] == "end":
            if message[1] is None:
                raise RuntimeError("agl trainer: rank 0 failed (see its log); this rank stops too")
            log.info("agl trainer: rank %d made %d calls for rank 0", rank(), calls)
            return dict(message[1])
        _, name, args, kwargs = message
        getattr(policy, name)(*args, **kwargs)
        calls += 1


def follow_fit(trainer: Trainer) -> dict[str, Any]:
    """``Trainer.fit`` on a rank other than 0: build the same policy as rank 0 (the same collectives in
    the same order: :func:`init`, :func:`same_source`, the policy, the channel), then follow its calls."""
    init()
    source = same_source(trainer.serving.model)
    policy = trainer.build_policy(source)  # rank 0's construction; lead() is a no-op here
    return follow(policy, Channel())
