"""Gateway backends behind the one small interface of :mod:`agl.gateway.backends.base`.

Each backend module is imported only when used: ``transformers`` pulls in torch, ``vllm``/``openai``
only aiohttp.
"""

from __future__ import annotations

from agl.gateway.backends.base import (
    Backend,
    BackendError,
    Choice,
    ContextWindowError,
    GenerationRequest,
    GenerationResult,
    ToolCall,
    UnknownModelError,
    UpstreamError,
)

__all__ = [
    "Backend",
    "BackendError",
    "Choice",
    "ContextWindowError",
    "GenerationRequest",
    "GenerationResult",
    "ToolCall",
    "UnknownModelError",
    "UpstreamError",
]
