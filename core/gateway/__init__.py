"""The OpenAI-compatible gateway: every LLM call of an agent, served with exact token ids (DESIGN §7).

``create_app(backend, store)`` builds the ASGI app; ``agl gateway serve`` runs it;
``agl.gateway.testing.serve_gateway`` runs it in a thread for tests. Backends: ``transformers``
(embedded default), ``scripted`` (tests), ``vllm`` (proxy) and ``openai`` (pass-through). Names are
imported lazily so ``import agl.gateway`` pulls in neither Starlette nor torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "create_app": "agl.gateway.app",
    "Gateway": "agl.gateway.app",
    "Backend": "agl.gateway.backends.base",
    "BackendError": "agl.gateway.backends.base",
    "GenerationRequest": "agl.gateway.backends.base",
    "GenerationResult": "agl.gateway.backends.base",
    "ScriptedBackend": "agl.gateway.backends.scripted",
    "Reply": "agl.gateway.backends.scripted",
    "reply": "agl.gateway.backends.scripted",
    "tool_call": "agl.gateway.backends.scripted",
    "TransformersBackend": "agl.gateway.backends.transformers",
    "VLLMBackend": "agl.gateway.backends.vllm",
    "OpenAIBackend": "agl.gateway.backends.openai",
    "serve_gateway": "agl.gateway.testing",
    "SamplingLimits": "agl.gateway.sampling",
    "ModelNames": "agl.gateway.model_names",
    "rollout_base_url": "agl.gateway.serve",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agl.gateway' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
