"""An optional gate on training: roll back to the last checkpoint when a chosen reward-hacking
monitor fires or the held-out task reward drops, log why, and go on from there with fresh tasks.

``Trainer(gate=agl.Gate(...), loop=LoopConfig(checkpoint_every=N))``: after each training step, :meth:`Gate.apply`
checks the step's record; when it trips, the policy (weights, optimizer, scheduler) is reloaded from
the checkpoint ``trainer_state.json`` names, and the step's record carries ``gate_rollback`` (why,
from which checkpoint). The task order is not rewound: the next step draws tasks the run has not yet
drawn, so the policy does not meet again the batch that taught it the hack. With no checkpoint yet the
gate only logs (``gate_rollback`` says so).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agl.errors import UsageError
from agl.trainer.state import read_state

__all__ = ["Gate"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gate:
    """``monitors``: the monitor names (:data:`agl.trainer.monitors.MONITORS`) that trip the gate when they
    fire; ``val_drop``: trip when the held-out task reward is more than this below its best so far
    (``None``: off)."""

    monitors: tuple[str, ...] = ("heldout_trend",)
    val_drop: float | None = 0.1

    def __post_init__(self) -> None:
        from agl.trainer.monitors import MONITORS

        unknown = [m for m in self.monitors if m not in MONITORS]
        if isinstance(self.monitors, str) or unknown:
            raise UsageError(f"Gate.monitors must be a tuple of {', '.join(MONITORS)}; got {self.monitors!r}")
        if self.val_drop is not None and (not isinstance(self.val_drop, (int, float)) or self.val_drop < 0):
            raise UsageError(f"Gate.val_drop must be a number >= 0 or None, got {self.val_drop!r}")

    def check(self, record: Mapping[str, Any], history: Sequence[Mapping[str, Any]]) -> str | None:
        """Why this step trips the gate, or None."""
        for w in record.get("monitor_warnings") or ():
            if isinstance(w, Mapping) and w.get("monitor") in self.monitors:
                return f"monitor {w['monitor']} fired at step {w.get('step')}: {w.get('message')}"
        val = record.get("val_reward")
        if self.val_drop is None or val is None:
            return None
        best = max((h["val_reward"] for h in history if h.get("val_reward") is not None), default=None)
        if best is not None and best - val > self.val_drop:
            return f"held-out reward {val:.3f} is {best - val:.3f} below its best {best:.3f} (limit {self.val_drop})"
        return None

    def apply(self, trainer: Any, record: dict[str, Any]) -> None:
        """Check ``record``; when tripped, reload the last checkpoint into ``trainer.policy``."""
        why = self.check(record, trainer.history)
        if why is None:
            return
        state = read_state(trainer.run_dir)
        if state is None:
            log.warning("agl gate: %s — no checkpoint yet, training goes on", why)
            record["gate_rollback"] = {"reason": why, "checkpoint": None}
            return
        checkpoint = state["checkpoint"]
        step = trainer.policy.load_checkpoint(checkpoint)
        log.warning("agl gate: %s — rolled back to %s (update step %d)", why, checkpoint, step)
        record["gate_rollback"] = {"reason": why, "checkpoint": checkpoint, "update_step": step}
