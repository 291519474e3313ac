"""The loop skeleton, written once: steps from the start (or resumed) step to ``LoopConfig.steps``.

Both schedules (:class:`~agl.trainer.sync.SyncSchedule`, :class:`~agl.trainer.async_loop.AsyncSchedule`)
run inside it; it owns what they share: the progress bar, the held-out schedule (before the first update
unless ``val_before=False``, every ``val_every`` steps, after the last), returning freed memory
(:mod:`agl.trainer.malloc`), the gate, the note on a step that could not update, the metrics record and
the checkpoint cadence (every ``checkpoint_every`` steps and after the last update). The last step only
measures the held-out reward, and is skipped when there are no held-out tasks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from agl.run.metrics import bar_postfix
from agl.trainer import malloc
from agl.trainer.notes import no_update_note
from agl.types import Task

if TYPE_CHECKING:
    from agl.trainer.trainer import Trainer

__all__ = ["Schedule", "held_out_due", "run_loop"]

log = logging.getLogger("agl.trainer")


class Schedule(Protocol):
    """How a run's steps order and overlap their moves (see :class:`agl.trainer.steps.Steps`)."""

    def start(self) -> int:
        """Restore a saved state when resuming; the step to start from (0 for a fresh run)."""
        ...

    def step(self, step: int, final: bool, val_tasks: list[Task], bar: Any) -> dict[str, Any]:
        """Run one step (``final``: only the held-out check); its metrics record."""
        ...

    def checkpoint(self, done: int) -> None:
        """Save the policy and the state to resume at step ``done``."""
        ...

    def finish(self) -> None:
        """After the last step: release what the schedule still holds in the store."""
        ...


def held_out_due(step: int, start: int, final: bool, val_before: bool, val_every: int) -> bool:
    """Whether ``step`` runs the held-out check (when there are held-out tasks): the last step always,
    the first unless ``val_before=False``, and every ``val_every`` steps."""
    if final:
        return True
    if step == start:
        return val_before
    return bool(val_every and step % val_every == 0)


def run_loop(trainer: Trainer, schedule: Schedule, val_tasks: list[Task]) -> None:
    """Run ``schedule``'s steps under the shared skeleton (see the module docstring)."""
    from tqdm.auto import tqdm

    cfg = trainer.loop
    start = schedule.start()
    bar = tqdm(
        total=cfg.steps,
        initial=start,
        desc="agl fit",
        unit="step",
        disable=not trainer.serving.progress,
        dynamic_ncols=True,
    )
    for step in range(start, cfg.steps + 1):
        final = step == cfg.steps
        do_val = bool(val_tasks) and held_out_due(step, start, final, cfg.val_before, cfg.val_every)
        if final and not do_val:
            break
        record = schedule.step(step, final, val_tasks if do_val else [], bar)
        malloc.trim()
        if trainer.gate is not None and not final:  # roll back when a chosen monitor fired
            trainer.gate.apply(trainer, record)
        note = no_update_note(record, trainer.history)
        if note:
            log.warning(note)
        trainer.metrics.write(record)
        if not final:
            bar.update(1)
            bar.set_postfix(bar_postfix(record, trainer.history))
            done = step + 1
            if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.steps:
                schedule.checkpoint(done)
    schedule.finish()
    bar.close()
