"""Gateway backends behind the one small interface of :mod:`agl.gateway.backends.base`.

Each backend module is imported only when used: ``transformers`` pulls in torch, ``vllm``/``openai``
only aiohttp. :func:`from_spec` is the one place a backend's name becomes a backend (the trainer, APO and
``agl gateway serve`` all make theirs through it).
"""

from __future__ import annotations

from typing import Any

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
    "from_spec",
]

#: the backend names :func:`from_spec` knows
NAMES = ("transformers", "vllm", "scripted", "openai", "tinker")


def from_spec(name: str, *, settings: Any = None, **options: Any) -> Backend:
    """The backend called ``name``, built from ``options`` (each backend's own constructor arguments)
    and ``settings`` (an :class:`agl.engine.EngineSettings`, carried whole to the embedded engine; any
    non-default one asked of another backend is refused by name):

    - ``transformers``: ``model`` (a path, a loaded model or None for the default), or ``policy`` (a
      ``PolicyUpdate`` whose frozen weights the engine shares), plus the constructor's keywords;
    - ``scripted``: ``script`` (required), plus ``ScriptedBackend``'s keywords;
    - ``vllm``: ``url`` (required), ``model``, ``api_key``, ``adapters``, ``tokenizer`` and ``render`` (who
      renders chats: agl by default where the tokenizer is found), ``server`` (a managed server, restarted
      when it dies);
    - ``openai``: ``url`` (required), ``api_key``, ``models``, ``timeout_s``;
    - ``tinker``: ``service`` (an :class:`agl.tinker.service.TinkerService`, required), ``tokenizer``,
      ``model_name``, ``adapters`` (an adapter per agent).
    """
    makers = {
        "transformers": _transformers,
        "scripted": _scripted,
        "vllm": _vllm,
        "openai": _openai,
        "tinker": _tinker,
    }
    if name not in makers:
        raise ValueError(f"unknown backend {name!r}: one of {', '.join(NAMES)}")
    if name == "transformers":
        return _transformers(settings=settings, **options)
    if settings is not None:
        settings.check_backend(name)
    return makers[name](**options)


def _transformers(*, model: Any = None, policy: Any = None, **options: Any) -> Backend:
    from agl.gateway.backends.transformers import TransformersBackend

    if policy is not None:
        return TransformersBackend.for_policy(policy, **options)
    return TransformersBackend(model, **options)


def _scripted(*, script: Any = None, **options: Any) -> Backend:
    from agl.gateway.backends.scripted import ScriptedBackend

    if script is None:
        raise ValueError("backend='scripted' needs script= (replies, see agl.gateway.ScriptedBackend)")
    return ScriptedBackend(script, **options)


def _vllm(*, url: str | None = None, **options: Any) -> Backend:
    from agl.gateway.backends.vllm import VLLMBackend

    if not url:
        raise ValueError("backend='vllm' needs the vLLM OpenAI server's URL (vllm_url, --upstream)")
    return VLLMBackend(url, **options)


def _openai(*, url: str | None = None, **options: Any) -> Backend:
    from agl.gateway.backends.openai import OpenAIBackend

    if not url:
        raise ValueError("the openai backend needs base_url (an OpenAI-compatible endpoint)")
    return OpenAIBackend(url, **options)


def _tinker(*, service: Any = None, **options: Any) -> Backend:
    from agl.gateway.backends.tinker import TinkerBackend

    if service is None:
        raise ValueError("backend='tinker' needs service= (an agl.tinker.service.TinkerService)")
    return TinkerBackend(service, **options)
