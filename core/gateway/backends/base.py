"""The one small interface every gateway backend implements.

The gateway owns HTTP, validation, spans and drift detection; a backend only turns a normalised
request into token ids, logprobs and text. Keeping the interface this small is what lets the same
server front an in-process model, a script, a vLLM fleet or a hosted API.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from agl.chat.format import ToolCall
from agl.errors import BackendError, ContextWindowError, UnknownModelError, UpstreamError
from agl.lora import lora_name

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
    "whole_stream",
]


@dataclass
class GenerationRequest:
    """A chat or completion request after validation, independent of the HTTP API it came through.

    ``messages`` are OpenAI chat messages (content already flattened to text where it was a list of
    parts); ``prompt`` is set instead for ``/v1/completions``. ``raw`` keeps the original body for the
    pass-through backends, ``api`` says which route it came from. Cancelling the ``generate`` task
    (the client went away) must stop the generation.
    """

    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    #: where ``seed`` came from: "agent" (the request's own) or "run" (the gateway derived it from the
    #: rollout's seed, agl.gateway.seeds); None when the call has no seed; and the call's index in its
    #: rollout attempt (0-based, in the order the attempt made its calls)
    seed_source: str | None = None
    #: "rollout" when the rollout forced ``temperature`` (a greedy held-out rollout, agl.gateway.seeds)
    temperature_source: str | None = None
    call_index: int | None = None
    rollout: tuple[str, int] | None = None
    #: the calling agent (W3C baggage ``agl.agent``), and the named adapter that serves the call (None:
    #: the base model), chosen by :meth:`Backend.route`
    agent: str | None = None
    adapter: str | None = None
    api: str = "chat"
    raw: dict[str, Any] = field(default_factory=dict)
    #: the model name the client asked for, when the gateway serves it under another name (``model`` is
    #: then the name the serving backend knows; see agl.gateway.model_names)
    requested_model: str | None = None
    #: the backend that serves the request (set by the gateway; None: its policy backend)
    served_by: Any = field(default=None, repr=False, compare=False)
    #: a branch rollout's call before its branch call: the parent's recorded response, served instead
    #: of generating; ``branch_point``: the branch call itself, sampled afresh (agl.gateway.replay)
    replay: Any = field(default=None, repr=False, compare=False)
    branch_point: bool = False


@dataclass
class Choice:
    """One sampled reply. ``text`` is the raw decoded output; ``content``/``tool_calls`` its parse."""

    text: str
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    response_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str = "stop"
    #: tool-call blocks the parser repaired (a call followed by more text: ``agl.chat.format.parse_reply``)
    tool_call_repairs: int = 0

    def message(self) -> dict[str, Any]:
        """The OpenAI chat ``assistant`` message for this choice."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [tc.to_openai() for tc in self.tool_calls]
        return msg


@dataclass
class GenerationResult:
    """What a backend returns: exact ids when ``exact`` (engine ids), else text only."""

    model: str
    choices: list[Choice]
    prompt_ids: list[int] | None = None
    prompt_tokens: int | None = None
    weight_version: int | None = None
    #: the weight versions that drew the response tokens, run-length ``[(version, n_tokens), ...]`` in
    #: order (more than one run when weights were swapped during the call); None when not tracked
    weight_versions: list[tuple[int, int]] | None = None
    #: the named adapter that served the call (``BASE_ADAPTER``: the base model); None on a backend
    #: without named adapters
    adapter: str | None = None
    exact: bool = True
    prompt_text: str | None = None
    raw: dict[str, Any] | None = None
    #: completion tokens as an upstream reported them (pass-through backends without ids)
    reported_completion_tokens: int | None = None
    #: tokens the backend appended to the prompt to honour ``tool_choice`` (the tool-call opening): the
    #: end of ``prompt_ids``, so they are context, outside the loss; the reply's text starts with them
    forced_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        if self.reported_completion_tokens is not None:
            return self.reported_completion_tokens
        return sum(len(c.response_ids) if c.response_ids is not None else 0 for c in self.choices)


async def whole_stream(result: GenerationResult) -> AsyncIterator[dict[str, Any]]:
    """A finished result as the streaming event protocol (``start``, one whole ``delta`` per choice,
    ``end``): what a streaming backend sends for a reply it generates whole (several choices, or a
    completion rendered by the backend), so the gateway's stream writers take it like any stream."""
    yield {"type": "start", "prompt_ids": result.prompt_ids}
    for i, c in enumerate(result.choices):
        delta: dict[str, Any] = {"role": "assistant", "content": c.content}
        if c.tool_calls:
            delta["tool_calls"] = [{"index": k, **tc.to_openai()} for k, tc in enumerate(c.tool_calls)]
        yield {
            "type": "delta",
            "index": i,
            "delta": delta,
            "token_ids": c.response_ids,
            "logprobs": None,
            "finish_reason": c.finish_reason,
        }
    yield {"type": "end", "result": result}


class Backend(abc.ABC):
    """Generation behind the gateway.

    Implementations set ``name`` (recorded as ``agl.llm.backend``) and ``exact`` (False when the
    engine gives no token ids). ``weight_version`` increases with every weight/adapter swap; a swap
    happens between requests, never in the middle of one.
    """

    name: str = "backend"
    exact: bool = True
    #: True when generation is slow enough that a client disconnect should cancel it
    cancellable: bool = True

    def __init__(self) -> None:
        self.weight_version = 0

    @abc.abstractmethod
    def models(self) -> list[str]:
        """Model names this backend serves (the first is the default)."""

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Produce ``request.n`` choices. Raise ContextWindowError, UnknownModelError or BackendError."""

    async def stream(self, request: GenerationRequest) -> AsyncIterator[dict[str, Any]]:  # pragma: no cover
        """Optional true streaming; the gateway streams a finished generation when not implemented."""
        raise NotImplementedError
        yield {}

    #: True when ``stream`` is implemented
    streams: bool = False

    def max_prompt_chars(self) -> int | None:
        """The most characters of message content a request that fits the context window can carry
        (None: unknown, no check). The gateway refuses longer requests before anything is rendered or
        tokenised, and derives its request-body limit from it, so one huge prompt cannot stall it."""
        return None

    def agent_loras(self) -> list[str]:
        """The named LoRA adapters (one per agent) this backend serves beside its base model."""
        return []

    def route(self, request: GenerationRequest) -> None:
        """Pick the adapter that serves ``request`` (sets ``request.adapter``): the one a model name
        ``"<base>:<adapter>"`` names, else the calling agent's (baggage ``agl.agent``) when this backend
        serves one, else none (the base model)."""
        adapters = self.agent_loras()
        if not adapters:
            return
        _, sep, suffix = request.model.rpartition(":")
        if sep and suffix in adapters:
            request.adapter = suffix
        elif request.agent and lora_name(request.agent) in adapters:
            request.adapter = lora_name(request.agent)

    def check_model(self, model: str) -> None:
        available = self.models()
        if model not in available:
            raise UnknownModelError(model, available)

    async def push(self, policy: Any, *, version: int | None = None, staging_dir: Any = None) -> int:
        """Serve the trainer's current ``policy`` as weight ``version`` from the next request on.

        The weight-sync contract between a trainer and the engine that serves its rollouts. ``policy``
        is a :class:`~agl.algorithms.update.PolicyUpdate` (``.model``, ``.is_lora``,
        ``save_adapter(dir)``, ``save_weights(dir)``); ``staging_dir`` is a directory the engine can
        read where files may be written. This default suits engines that load files: a LoRA policy is
        saved as a peft adapter and loaded with :meth:`load_adapter` (vLLM's runtime LoRA loading), a
        fully fine-tuned one is saved as safetensors and loaded with :meth:`load_weights`. In-process
        engines override it to share tensors instead (:class:`TransformersBackend`).
        """
        import os

        if not self.can_push:
            raise BackendError(f"the {self.name} backend cannot take new weights")
        if staging_dir is None:
            raise BackendError(f"the {self.name} backend loads weights from files: give staging_dir")
        target = os.path.join(os.fspath(staging_dir), f"v{version if version is not None else 'next'}")
        overrides = type(self).load_adapter is not Backend.load_adapter
        if policy.is_lora and getattr(policy, "adapters", None):  # an adapter per agent
            path = os.path.abspath(policy.save_adapter(target))
            names = list(policy.adapters.values())
            return await self.load_agent_loras({n: os.path.join(path, n) for n in names}, version=version)
        if policy.is_lora and overrides:
            path = os.path.abspath(policy.save_adapter(target))
            return await self.load_adapter(path, version=version)
        if policy.is_lora:
            raise BackendError(f"the {self.name} backend cannot load LoRA adapters")
        if type(self).load_weights is Backend.load_weights:
            raise BackendError(
                f"the {self.name} backend takes new weights only as LoRA adapters: train with lora=True"
            )
        path = os.path.abspath(policy.save_weights(target))
        return await self.load_weights(path, version=version)

    @property
    def can_push(self) -> bool:
        """Whether this backend can serve new weights at all (a scripted or hosted one cannot)."""
        cls = type(self)
        return (
            cls.push is not Backend.push
            or cls.load_adapter is not Backend.load_adapter
            or cls.load_weights is not Backend.load_weights
            or cls.load_agent_loras is not Backend.load_agent_loras
        )

    async def load_weights(self, source: Any, *, version: int | None = None) -> int:
        """Swap in new full weights (a path or a state dict); returns the new weight version."""
        raise BackendError(f"the {self.name} backend cannot load weights")

    async def load_adapter(self, path: str, *, name: str | None = None, version: int | None = None) -> int:
        """Swap in a LoRA adapter; returns the new weight version."""
        raise BackendError(f"the {self.name} backend cannot load adapters")

    async def load_agent_loras(self, paths: dict[str, str], *, version: int | None = None) -> int:
        """Swap in new weights of named agent adapters (``{adapter: peft adapter folder}``), all at
        once as one weight version; returns it."""
        raise BackendError(f"the {self.name} backend cannot serve an adapter per agent")

    def _bump_version(self, version: int | None) -> int:
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        return self.weight_version

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Called once by the server before the first request (load the model, open clients)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Called when the server stops."""
