"""agl: make existing LLM agents trainable with reinforcement learning, without rewriting them.

The public API is imported lazily so ``import agl`` stays light (no torch, no agent framework):

    import agl
    agl.instrument()                      # every installed framework now emits spans
    with agl.rollout_context(rollout_id, attempt):
        run_my_agent()
        agl.emit_reward(1.0)
"""

from __future__ import annotations

import importlib
import sys
from importlib.machinery import ModuleSpec
from typing import Any

__version__ = "0.1.0"

#: public name -> module that defines it
_LAZY: dict[str, str] = {
    # plugins and tracing
    "instrument": "agl.instrumentation",
    "uninstrument": "agl.instrumentation",
    "Instrumentor": "agl.instrumentation",
    "rollout_context": "agl.tracing.provider",
    # agent and tool spans for plain code
    "agent": "agl.instrumentation.agent",
    "tool": "agl.instrumentation.agent",
    "current_rollout": "agl.tracing.provider",
    "setup_tracing": "agl.tracing.provider",
    # emit API
    "emit_reward": "agl.tracing.emit",
    "emit_message": "agl.tracing.emit",
    "emit_object": "agl.tracing.emit",
    "emit_exception": "agl.tracing.emit",
    "InfraError": "agl.errors",
    # adapter / rewards / algorithm
    "Adapter": "agl.adapter",
    "AIR": "agl.adapter.air_rules",
    "LightningRL": "agl.algorithms.lightning_rl",
    "APO": "agl.algorithms.apo",
    "SFT": "agl.algorithms.sft",
    "RunConfig": "agl.config",
    "LoopConfig": "agl.config",
    "Serving": "agl.run.settings",
    # prompt templates (resources an agent reads; APO rewrites them)
    "prompt": "agl.tracing.prompts",
    "prompt_version": "agl.tracing.prompts",
    # runner / trainer
    "Runner": "agl.runner.runner",
    "rollout": "agl.runner.runner",
    "Trainer": "agl.trainer.trainer",
    # rewards from an LLM judge, reward-hacking monitors
    "Judge": "agl.judge",
    "Gate": "agl.trainer.gate",
    # data model
    "Task": "agl.types",
    "Rollout": "agl.types",
    "NewRollout": "agl.types",
    "Attempt": "agl.types",
    "Span": "agl.types",
    "Resources": "agl.types",
    "LLM": "agl.types",
    "PromptTemplate": "agl.types",
    "Transition": "agl.types",
}

__all__ = sorted([*_LAZY, "__version__"])

#: module paths that moved in the layout of 2026-11-28 -> where they live now. ``import agl.rewards``
#: keeps working (the same module object, with a DeprecationWarning) so documented imports do not break.
_MOVED: dict[str, str] = {
    "agl.agent_spans": "agl.instrumentation.agent",
    "agl.async_loop": "agl.trainer.async_loop",
    "agl.doctor": "agl.reports.doctor",
    "agl.emit": "agl.tracing.emit",
    "agl.endpoint_gate": "agl.runner.endpoint_gate",
    "agl.exactness": "agl.reports.exactness",
    "agl.export": "agl.reports.export",
    "agl.gate": "agl.trainer.gate",
    "agl.inspect": "agl.reports.inspect",
    "agl.malloc": "agl.trainer.malloc",
    "agl.monitors": "agl.trainer.monitors",
    "agl.plot": "agl.run.plot",
    "agl.prompts": "agl.tracing.prompts",
    "agl.rewards": "agl.adapter.air_rules",
    "agl.spanconv": "agl.tracing.spanconv",
    "agl.trajectories": "agl.adapter.trajectories",
    "agl.algorithms.adapters": "agl.algorithms.per_agent_lora",
    "agl.judge.assembly": "agl.trainer.rewarding",
}


class _MovedFinder:
    """Resolves a moved module's old path to the module at its new path (one object, two names). A
    meta-path finder and loader by duck typing: ``importlib.abc`` would make ``import agl`` heavier."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _MOVED:
            return None
        return ModuleSpec(fullname, self)

    def create_module(self, spec: Any) -> Any:
        import warnings

        new = _MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=3)
        return importlib.import_module(new)

    def exec_module(self, module: Any) -> None:
        """Nothing to run: the module at the new path is already executed."""


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
