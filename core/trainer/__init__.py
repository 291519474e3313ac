"""The Trainer's package (trainer side, one process): LightningRL's loop and everything only it uses.

- :mod:`~agl.trainer.trainer`: :class:`Trainer`, the face (``agl.Trainer``): configuration, the run's
  environment, and the step interface (publish, enqueue, collect, update, checkpoint, state) the
  schedules work through;
- :mod:`~agl.trainer.async_loop`: the asynchronous schedule (``max_staleness > 0``);
- :mod:`~agl.trainer.pipeline`, :mod:`~agl.trainer.sampling`, :mod:`~agl.trainer.order`: groups of
  rollouts in flight, dynamic sampling, the task order;
- :mod:`~agl.trainer.checks`, :mod:`~agl.trainer.notes`, :mod:`~agl.trainer.report`: a step's checks,
  the notes printed when a step cannot update, the end-of-run report;
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
