"""The agent side's process (``agl runner``): claims rollouts from a store and runs the user's agent.

- :mod:`~agl.runner.runner`: :class:`Runner`, :func:`rollout`, loading an agent by ``module:name``;
- :mod:`~agl.runner.endpoint_gate`: pauses the runners while the policy's weights are pushed.

Names are imported lazily: ``import agl.runner`` costs nothing until one is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["RolloutFunction", "Runner", "RunnerStats", "load_agent", "rollout", "rollout_resources"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("agl.runner.runner"), name)
    raise AttributeError(f"module 'agl.runner' has no attribute {name!r}")
