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
from typing import Any

__version__ = "0.2.0"

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
