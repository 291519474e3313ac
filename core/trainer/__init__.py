"""The Trainer's package (trainer side, one process): LightningRL's loop and everything only it uses.

Its modules, all of them:

- :mod:`~agl.trainer.trainer`: :class:`Trainer`, the face (``agl.Trainer``): configuration, the run's
  environment, the policy (``build_policy``), ``fit`` and ``dev``;
- :mod:`~agl.trainer.steps`: :class:`~agl.trainer.steps.Steps`, **the step interface** — publish, push,
  enqueue, collect, assemble, update, the step's record, checkpoint, state — the only door the
  schedules act on the run through;
- :mod:`~agl.trainer.loop`: the loop skeleton, once (bar, held-out schedule, gate, metrics, checkpoint
  cadence); :mod:`~agl.trainer.sync` (:class:`~agl.trainer.sync.SyncSchedule`) and
  :mod:`~agl.trainer.async_loop` (:class:`~agl.trainer.async_loop.AsyncSchedule`, ``max_staleness > 0``)
  are the two schedules it runs;
- :mod:`~agl.trainer.pipeline`, :mod:`~agl.trainer.sampling`, :mod:`~agl.trainer.branching`,
  :mod:`~agl.trainer.order`: groups of rollouts in flight, dynamic sampling, K continuations at an
  agent's call, the task order; :mod:`~agl.trainer.heldout`: how held-out checks decode (greedy, or K
  samples with pass@K) and what their record says;
- :mod:`~agl.trainer.state` (``trainer_state.json``, where a run resumes from),
  :mod:`~agl.trainer.distributed` (the Trainer on several processes);
- :mod:`~agl.trainer.checks`, :mod:`~agl.trainer.notes`, :mod:`~agl.trainer.report`: a step's checks,
  the notes printed when a step cannot update, what ``dev`` prints;
- :mod:`~agl.trainer.rewarding` (task, judge or mixed rewards), :mod:`~agl.trainer.monitors`
  (reward-hacking monitors), :mod:`~agl.trainer.gate` (rolls training back on a monitor);
- :mod:`~agl.trainer.malloc` (glibc settings for ``fit``).

What every algorithm shares (serving, the store, metrics) is :mod:`agl.run`; nothing there imports this
package. ``Trainer`` is imported lazily, so ``import agl.trainer.gate`` does not load the whole loop.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from agl.trainer.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'agl.trainer' has no attribute {name!r}")
