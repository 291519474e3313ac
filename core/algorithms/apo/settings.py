"""What an APO run borrows from the run it is part of: how the agent's model is served (a
:class:`agl.run.settings.Serving`: backend, model, store, runners, run directory), and the sampling, agents,
seed and rollout limits. ``agl.Trainer`` holds these for LightningRL; APO reads them from it
(:meth:`RunSettings.from_trainer`, typed values, nothing looked up by name) so the same
``Trainer(...)`` call serves both algorithms.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl.run.settings import Serving
from agl.types import RolloutConfig, as_tasks

__all__ = ["RunSettings", "as_tasks"]

#: APO's own default run directory when it runs without a Trainer
DEFAULT_RUN_DIR = Path("runs/apo")


@dataclass
class RunSettings:
    """The run's settings (the Trainer's, or :meth:`APO.optimize`'s keywords); APO's own knobs live on
    ``agl.APO``. ``serving`` says how the agent's model is served and where rollouts go."""

    serving: Serving = field(default_factory=lambda: Serving(run_dir=DEFAULT_RUN_DIR))
    sampling: dict[str, Any] = field(default_factory=dict)
    agents: Any = None
    seed: int = 0
    rollout_config: RolloutConfig = field(default_factory=RolloutConfig)
    round_timeout_s: float | None = None

    @property
    def run_dir(self) -> Path:
        return self.serving.run_dir

    @property
    def progress(self) -> bool:
        return self.serving.progress

    @classmethod
    def from_trainer(cls, trainer: Any) -> RunSettings:
        """The settings of ``trainer`` (an ``agl.Trainer``): its serving, sampling, agents and loop."""
        return cls(
            serving=trainer.serving,
            sampling=dict(trainer.config.sampling),
            agents=trainer.agents,
            seed=trainer.loop.seed,
            rollout_config=trainer.rollout_config,
            round_timeout_s=trainer.loop.step_timeout_s,
        )

    @classmethod
    def from_kwargs(cls, **settings: Any) -> RunSettings:
        """``APO.optimize(..., backend=..., run_dir=...)`` without a Trainer: ``Serving``'s fields and
        this class's own; unknown names are an error."""
        serving_names = {f.name for f in dataclasses.fields(Serving)}
        own = {f.name for f in dataclasses.fields(cls)} - {"serving"}
        unknown = sorted(set(settings) - serving_names - own)
        if unknown:
            known = ", ".join(sorted(serving_names | own))
            raise TypeError(f"unknown APO run settings {unknown}; known: {known}")
        serving = {k: v for k, v in settings.items() if k in serving_names}
        serving.setdefault("run_dir", DEFAULT_RUN_DIR)
        return cls(serving=Serving(**serving), **{k: v for k, v in settings.items() if k in own})
