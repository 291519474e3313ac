"""Pass-through to any OpenAI-compatible endpoint (hosted models for ``Trainer.dev`` runs).

Hosted APIs return no token ids, so spans record the text (``gen_ai.input.messages`` /
``gen_ai.output.messages``) and ``agl.llm.exact = False``; the adapter re-tokenises them later and
marks the transitions inexact. Model names are the upstream's business: any name is forwarded and an
unknown one comes back as the upstream's own 404.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

from agl.gateway.backends._http import HttpUpstreamBackend
from agl.gateway.backends.base import GenerationRequest, GenerationResult

__all__ = ["OpenAIBackend"]


class OpenAIBackend(HttpUpstreamBackend):
    """``OpenAIBackend("https://api.openai.com/v1", api_key=...)``; the key defaults to ``$OPENAI_API_KEY``."""

    name = "openai"
    exact = False

    def __init__(
        self,
        base_url: str = "https://api.openai.com/v1",
        *,
        api_key: str | None = None,
        models: Sequence[str] = (),
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY"), timeout_s=timeout_s)
        self._models = list(models)

    def models(self) -> list[str]:
        return list(self._models)

    def check_model(self, model: str) -> None:
        """Any name goes upstream, which answers 404 for names it does not know."""

    streams = True

    async def stream(self, request: GenerationRequest) -> AsyncIterator[dict[str, Any]]:
        """Chat streamed from the upstream; the result is text only, like :meth:`generate`'s."""
        async for event in self.stream_chat(request, request.model):
            if event["type"] == "end":
                _inexact(event["result"])
            yield event

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return _inexact(await self.forward(request, request.model))


def _inexact(result: GenerationResult) -> GenerationResult:
    """Hosted APIs give no token ids: keep the text and the reported token count only."""
    usage = (result.raw or {}).get("usage") or {}
    result.reported_completion_tokens = usage.get("completion_tokens", 0)
    result.exact = False
    result.prompt_ids = None
    for c in result.choices:
        c.response_ids = c.logprobs = None
    return result
