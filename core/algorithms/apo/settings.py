"""What an APO run borrows from the run it is part of: the agent's model and backend, the store,
the runners, the run directory. ``agl.Trainer`` holds these for LightningRL; APO reads them from it
(:meth:`RunSettings.from_trainer`) so the same ``Trainer(...)`` call serves both algorithms.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agl.types import RolloutConfig, Task

__all__ = ["RunSettings", "as_tasks"]


@dataclass
class RunSettings:
    """The run's settings (the Trainer's, or the CLI's); APO's own knobs live on ``agl.APO``."""

    backend: Any = "transformers"
    model: Any = None
    model_name: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    vllm_url: str | None = None
    script: Any = None
    gateway_url: str | None = None
    store: Any = None
    runners: int = 4
    run_dir: Path = Path("runs/apo")
    sampling: dict[str, Any] = field(default_factory=dict)
    agents: Any = None
    seed: int = 0
    progress: bool = True
    rollout_config: RolloutConfig = field(default_factory=RolloutConfig)
    round_timeout_s: float | None = None

    @classmethod
    def from_trainer(cls, trainer: Any) -> RunSettings:
        """The trainer's run settings, read by name so the Trainer can keep its own structure."""
        cfg = getattr(trainer, "config", None)

        def get(name: str, default: Any = None, *aliases: str) -> Any:
            for key in (name, *aliases):
                for obj in (trainer, cfg):
                    if obj is not None and hasattr(obj, key):
                        return getattr(obj, key)
            return default

        return cls(
            backend=get("backend_arg", "transformers", "backend"),
            model=get("model_arg", None, "model"),
            model_name=get("model_name"),
            base_url=get("base_url"),
            api_key=get("api_key"),
            vllm_url=get("vllm_url"),
            script=get("script"),
            gateway_url=get("gateway_url"),
            store=get("store_arg", None, "store"),
            runners=int(get("runners", 4)),
            run_dir=Path(get("run_dir", "runs/apo")),
            sampling=dict(get("sampling", {}) or {}),
            agents=get("agents"),
            seed=int(get("seed", 0)),
            progress=bool(get("progress", True)),
            rollout_config=get("rollout_config", None) or RolloutConfig(),
            round_timeout_s=get("step_timeout_s"),
        )

    @classmethod
    def from_kwargs(cls, **settings: Any) -> RunSettings:
        """``APO.optimize(..., backend=..., run_dir=...)`` without a Trainer; unknown names are an error."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"unknown APO run settings {unknown}; known: {', '.join(sorted(known))}")
        return cls(**{k: (Path(v) if k == "run_dir" else v) for k, v in settings.items()})


def as_tasks(data: Iterable[Any] | None, mode: Literal["train", "val", "test"]) -> list[Task]:
    """Task inputs (or ``Task`` objects) as tasks of ``mode``, numbered ``{mode}-{i}`` when new."""
    tasks: list[Task] = []
    for i, item in enumerate(data or []):
        if isinstance(item, Task):
            tasks.append(item.model_copy(update={"mode": mode}))
        else:
            tasks.append(Task(id=f"{mode}-{i}", input=item, mode=mode))
    return tasks
