"""Sampling through a Tinker-API service's ``SamplingClient``, token ids in and out.

One rendering on every engine: a chat is rendered and tokenised by agl (:mod:`._rendered`, as the
embedded engine and the vLLM backend do), the ids go to ``SamplingClient.sample`` with the call's
seed, temperature, top-p and ``max_tokens`` (stop: the tokenizer's end-of-turn id; stop strings are cut
from the decoded text), and the reply is decoded and parsed for tool calls from the service's token
ids, with its per-token log-probs: exact ids on every span.

The service client, the samplers and their weight versions belong to the run's
:class:`~agl.tinker.service.TinkerService` (the trainer's update shares it); this backend only picks the
sampler that serves a call (its agent's adapter, :meth:`Backend.route`, else the policy) and names
that sampler's weight version on the span. :meth:`push` takes up the weights the trainer just updated
(``save_weights_and_get_sampling_client`` per adapter) as the step's version.

A service error or timeout is a :class:`BackendError` (the gateway's 502, an infrastructure failure:
the rollout is requeued, never scored): :meth:`~agl.tinker.service.TinkerService.sample` bounds the
call, and a managed server found dead starts one recovery (restart, last saved state, samplers again)
that later calls wait for.
"""

from __future__ import annotations

from typing import Any

from agl.gateway.backends import _rendered
from agl.gateway.backends.base import Backend, BackendError, GenerationRequest, GenerationResult
from agl.semconv import BASE_ADAPTER

__all__ = ["TinkerBackend"]

#: max_tokens when a call sets none (the service requires one)
_DEFAULT_MAX_TOKENS = 512
_FINISH = {"length": "length", "stop": "stop"}


class TinkerBackend(Backend):
    """``TinkerBackend(service, tokenizer=ChatTokenizer, model_name="SmolLM2-135M-Instruct")``."""

    name = "tinker"
    exact = True

    def __init__(
        self,
        service: Any,
        *,
        tokenizer: Any,
        model_name: str | None = None,
        adapters: list[str] | None = None,
        max_context: int | None = None,
    ) -> None:
        super().__init__()
        from agl.chat.tokenizer import ChatTokenizer

        if tokenizer is None:
            raise BackendError("the tinker backend renders chats itself: give tokenizer= (a folder or one)")
        self.tokenizer = tokenizer if hasattr(tokenizer, "encode_chat") else ChatTokenizer.from_dir(tokenizer)
        self._eos = {int(self.tokenizer.eos_token_id)}
        self.service = service
        self.model_name = model_name or "model"
        self.adapters = list(adapters or [])
        self.max_context = max_context

    @property
    def restarts(self) -> int:
        return int(getattr(self.service, "restarts", 0))

    def models(self) -> list[str]:
        return [self.model_name, *(f"{self.model_name}:{a}" for a in self.adapters)]

    def agent_loras(self) -> list[str]:
        return list(self.adapters)

    def max_prompt_chars(self) -> int | None:
        return self.tokenizer.max_prompt_chars(self.max_context) if self.max_context else None

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        rendered = await _rendered.render(self.tokenizer, request, self.max_context)
        params: dict[str, Any] = {
            "max_tokens": int(rendered.max_new or _DEFAULT_MAX_TOKENS),
            "temperature": 1.0 if request.temperature is None else float(request.temperature),
            "top_p": 1.0 if request.top_p is None else float(request.top_p),
            "seed": request.seed,
            "stop": sorted(self._eos),
        }
        raw = request.raw if isinstance(request.raw, dict) else {}
        if raw.get("top_k") is not None:
            params["top_k"] = int(raw["top_k"])
        response, version = await self.service.sample(request.adapter, rendered.ids, request.n, params)
        choices = [
            _rendered.rendered_choice(
                self.tokenizer,
                request,
                rendered,
                list(seq.tokens),
                list(seq.logprobs) if seq.logprobs is not None else None,
                _FINISH.get(str(getattr(seq.stop_reason, "value", seq.stop_reason)), "stop"),
                None,
                self._eos,
            )
            for seq in response.sequences
        ]
        adapter = (request.adapter or BASE_ADAPTER) if self.adapters else None
        return rendered.result(request, choices, weight_version=version, adapter=adapter)

    # ------------------------------------------------------------------------------ weights
    async def push(self, policy: Any, *, version: int | None = None, staging_dir: Any = None) -> int:
        """Serve the service's current weights of every adapter as ``version`` (the files stay on the
        service: ``staging_dir`` is not used)."""
        target = self.weight_version + 1 if version is None else int(version)
        await self.service.publish_for_gateway(target)
        return self._bump_version(target)
