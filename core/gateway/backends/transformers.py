"""The embedded default backend: any Hugging Face causal LM, in-process, on CPU or GPU.

Token ids are the ids the model actually consumed and produced: the prompt ids are the rendered chat
template encoded once (the same ids fed to the model), the response ids are the generated ids
(EOS included: the model chose to stop). Nothing is re-tokenised.

The logprobs are those of the distribution each token was actually drawn from (the behaviour policy):
``log_softmax(logits / temperature)`` after any processors the model's generation config adds, and,
when the request sets ``top_p < 1`` (or a ``top_k``), of the truncated, renormalised distribution. A
greedy request (``temperature=0``) records ``log_softmax(logits)``. agl samples itself
(:func:`agl.engine.batching.sample`), so this holds by construction, and each request
draws from a ``torch.Generator`` of its own when it sets a ``seed`` (else from the backend's): the
process-wide RNG that a trainer in the same process uses is never touched.

This module is the thin :class:`~agl.gateway.backends.base.Backend` over the embedded engine
(:class:`agl.engine.engine.Engine`): it renders a ``GenerationRequest`` into prompt ids and sampling
settings, hands the engine one job per choice, and builds the ``GenerationResult`` (or the stream of
deltas) from the finished rows. Loading, continuous batching, the prefix cache and the weight swaps are
the engine's (see :mod:`agl.engine.engine`): :meth:`TransformersBackend.push` serves a training policy
without a second copy of its frozen base weights; ``load_weights``/``load_adapter`` take files; a swap
during a call makes its remaining tokens come from the new weights, each tagged with the version that
drew it (``GenerationResult.weight_versions``; the result's ``weight_version`` is the oldest, the
version that admitted it). A client that disconnects cancels its request: a queued request is
dropped, a running one leaves the batch before the next step.

``tool_choice``: ``"none"`` hides the tools; ``"required"`` and a named function start the reply with
the tool-call opening (and the function's name), appended to the prompt as forced tokens: they are the
end of ``prompt_ids`` (context, outside the loss), counted in ``GenerationResult.forced_tokens`` (the
span's ``agl.llm.forced_tokens``), and the reply's text starts with them. A value it cannot honour (an
unknown one, a function not among the tools) is answered 400. Not enforced: ``response_format`` (no
constrained decoding; the request is served as plain text).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from agl.chat.format import ParsedReply, parse_reply
from agl.chat.stream_text import StreamText, tail_delta, token_logprobs
from agl.engine.batching import Row
from agl.engine.engine import Engine, Job
from agl.engine.settings import EngineSettings
from agl.gateway.backends._rendered import Rendered, render
from agl.gateway.backends.base import (
    Backend,
    Choice,
    GenerationRequest,
    GenerationResult,
    UnknownModelError,
    whole_stream,
)
from agl.semconv import BASE_ADAPTER

__all__ = ["TransformersBackend"]

#: a reply forced to open a tool call ends once that call is closed (vLLM's "required" ends with the
#: call too); what follows would be prose the client asked not to get
_TOOL_CLOSE = "</tool_call>"


def _top_k(request: GenerationRequest) -> int | None:
    """``top_k`` is not an OpenAI parameter; vLLM-style clients send it as an extra body field."""
    value = request.raw.get("top_k") if isinstance(request.raw, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


class TransformersBackend(Backend):
    """Serve a Hugging Face causal LM through the embedded engine (:class:`agl.engine.engine.Engine`).

    ``model``: None (the default SmolLM2-135M-Instruct, prepared on first use), a local path or a hub
    id (offline cache), or a loaded ``PreTrainedModel``. ``settings``: the engine's
    :class:`~agl.engine.EngineSettings` (dtype, prefix cache, batched LoRA, deterministic, batch size,
    threads). ``tokenizer``: None (the model's own, or the shipped SmolLM2 one for a model object), a
    Hugging Face fast tokenizer, or a :class:`~agl.chat.tokenizer.ChatTokenizer`. ``model_name`` is
    what clients put in ``model``. ``default_temperature``/``default_top_p``/``default_max_tokens``
    apply to requests that leave them out (the trainer sets the first two from its
    :class:`agl.RunConfig`). ``adapters``: named LoRA folders served beside the base model (``agl
    gateway serve --adapter``).
    """

    name = "transformers"
    streams = True

    def __init__(
        self,
        model: Any = None,
        *,
        settings: EngineSettings | None = None,
        tokenizer: Any = None,
        model_name: str | None = None,
        chat_template: str | None = None,
        device: str | None = None,
        default_max_tokens: int = 512,
        max_context: int | None = None,
        default_temperature: float = 1.0,
        default_top_p: float = 1.0,
        batch_window_s: float = 0.005,
        adapters: dict[str, str] | None = None,
        engine: Engine | None = None,
    ) -> None:
        if not (default_temperature >= 0 and default_temperature < float("inf")):
            raise ValueError(f"default_temperature must be a finite number >= 0, got {default_temperature!r}")
        if not (0 < default_top_p <= 1):
            raise ValueError(f"default_top_p must be in (0, 1], got {default_top_p!r}")
        self.engine = engine or Engine(
            model,
            settings=settings,
            tokenizer=tokenizer,
            model_name=model_name,
            chat_template=chat_template,
            device=device,
            max_context=max_context,
            batch_window_s=batch_window_s,
            loras=adapters,
        )
        super().__init__()
        self.default_temperature = float(default_temperature)
        self.default_top_p = float(default_top_p)
        self.default_max_tokens = default_max_tokens

    @classmethod
    def for_policy(
        cls, policy: Any, *, settings: EngineSettings | None = None, **kwargs: Any
    ) -> TransformersBackend:
        """A backend serving a :class:`~agl.algorithms.update.PolicyUpdate` of this process, its engine
        sharing the policy's frozen weights (see :meth:`Engine.push`); ``kwargs`` as for the
        constructor."""
        engine_keys = ("tokenizer", "model_name", "chat_template", "device", "max_context", "batch_window_s")
        engine_kw = {k: kwargs.pop(k) for k in engine_keys if k in kwargs}
        engine = Engine.for_policy(policy, settings=settings, **engine_kw)
        return cls(engine=engine, **kwargs)

    # ------------------------------------------------------------- the engine's surface
    @property
    def weight_version(self) -> int:  # type: ignore[override]
        return self.engine.weight_version

    @weight_version.setter
    def weight_version(self, value: int) -> None:
        self.engine.weight_version = value

    @property
    def settings(self) -> EngineSettings:
        return self.engine.settings

    @property
    def model(self) -> Any:
        return self.engine.model

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str | None:
        return self.engine.model_name

    @property
    def max_context(self) -> int | None:
        return self.engine.max_context

    @property
    def device(self) -> Any:
        return self.engine.device

    @property
    def serving_dtype(self) -> Any:
        """The dtype the engine computes in (None before the model is loaded)."""
        return self.engine.serving_dtype

    @property
    def busy(self) -> Any:
        """The engine's busy clock (seconds it ran at least one row)."""
        return self.engine.busy

    @property
    def batch_sizes(self) -> Any:
        return self.engine.batch_sizes

    def prefix_stats(self) -> dict[str, float]:
        return self.engine.prefix_stats()

    async def start(self) -> None:
        await self.engine.start()

    async def close(self) -> None:
        await self.engine.close()

    def models(self) -> list[str]:
        """The base model's name, then ``"<base>:<adapter>"`` for each named adapter."""
        base = self.model_name or "model"
        return [base, *(f"{base}:{name}" for name in self.engine.lora_names)]

    def agent_loras(self) -> list[str]:
        return list(self.engine.lora_names)

    def max_prompt_chars(self) -> int | None:
        tok = self.tokenizer
        return None if tok is None else tok.max_prompt_chars(self.max_context)

    def check_model(self, model: str) -> None:
        if self.model is None:
            self.engine.load()
        if model not in self.models():
            raise UnknownModelError(model, self.models())

    # ------------------------------------------------------------------------ weight swaps
    async def set_model(self, model: Any, *, version: int | None = None) -> int:
        """Serve ``model`` (same tokenizer) from the next request on."""
        return await self.engine.set_model(model, version=version)

    async def load_weights(self, source: Any, *, version: int | None = None) -> int:
        """New full weights: a state dict, a ``.safetensors`` file or a checkpoint directory."""
        return await self.engine.load_weights(source, version=version)

    async def load_adapter(self, path: str, *, name: str | None = None, version: int | None = None) -> int:
        """A LoRA adapter (peft) replacing the previous one (an agent LoRA's ``name``: its new weights)."""
        return await self.engine.load_adapter(path, name=name, version=version)

    async def load_agent_loras(self, paths: dict[str, str], *, version: int | None = None) -> int:
        return await self.engine.load_agent_loras(paths, version=version)

    async def push(self, policy: Any, *, version: int | None = None, staging_dir: Any = None) -> int:
        """Serve ``policy`` from the next request on, sharing its frozen weights (:meth:`Engine.push`)."""
        return await self.engine.push(policy, version=version)

    # ------------------------------------------------------------------------ generation
    async def _prepare(self, request: GenerationRequest) -> tuple[Rendered, int]:
        """The rendered prompt and the most new tokens; raises on an empty or too long prompt."""
        if self.model is None:
            await self.start()
        rendered = await render(self.tokenizer, request, self.max_context)
        max_new = request.max_tokens or self.default_max_tokens
        if self.max_context is not None:
            max_new = min(max_new, self.max_context - len(rendered.ids))
        return rendered, max_new

    def _job(self, request: GenerationRequest, rendered: Rendered, max_new: int, **extra: Any) -> Job:
        loop = asyncio.get_running_loop()
        return Job(
            prompt_ids=rendered.ids,
            max_new=max_new,
            temperature=float(
                request.temperature if request.temperature is not None else self.default_temperature
            ),
            top_p=float(request.top_p if request.top_p is not None else self.default_top_p),
            top_k=_top_k(request),
            future=loop.create_future(),
            loop=loop,
            build=self._result,
            stops=tuple(x for x in request.stop if x),
            closers=(_TOOL_CLOSE,) if rendered.forced else (),
            seed=request.seed,
            adapter=request.adapter,
            context=(request, rendered),
            **extra,
        )

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        rendered, max_new = await self._prepare(request)
        generator = None if request.seed is None else self.engine.generator_for(request.seed)
        jobs = [self._job(request, rendered, max_new, generator=generator) for _ in range(request.n)]
        for job in jobs:
            self.engine.submit(job)
        try:
            parts = await asyncio.gather(*(j.future for j in jobs))
        except asyncio.CancelledError:
            for j in jobs:
                self.engine.withdraw(j)
            raise
        first = parts[0]
        first.choices = [p.choices[0] for p in parts]
        return first

    async def stream(self, request: GenerationRequest) -> AsyncIterator[dict[str, Any]]:
        """Tokens leave as they are drawn; the ``end`` result is the very one ``generate`` returns.

        The job runs in the same batches, sampler and stopping rules as a non-streamed one, so ids and
        logprobs are equal for the same seed. Text deltas are decoded incrementally; text that may
        still change is held back (an incomplete UTF-8 sequence, a possible stop string, and with tools
        a possible ``<tool_call>``), and tool calls are sent as deltas once parsed at the end.
        """
        if request.n != 1:  # several choices: generated together, then sent as whole deltas
            async for event in whole_stream(await self.generate(request)):
                yield event
            return
        rendered, max_new = await self._prepare(request)
        tok = self.tokenizer
        job = self._job(request, rendered, max_new, tokens=asyncio.Queue())
        self.engine.submit(job)
        want_lp = bool(isinstance(request.raw, dict) and request.raw.get("logprobs"))
        text = StreamText(tok, request, set(self.engine.eos_ids), forced=bool(rendered.forced))
        ids: list[int] = []
        try:
            yield {"type": "start", "prompt_ids": list(rendered.ids)}
            while True:
                item = await job.tokens.get()  # type: ignore[union-attr]
                if item is None:
                    break
                if text.done or len(ids) >= max_new:
                    continue
                tid, lp = item
                ids.append(tid)
                delta = text.delta(ids, tid)
                lps = token_logprobs(tok, tid, lp) if want_lp else None
                yield {
                    "type": "delta",
                    "index": 0,
                    "delta": delta,
                    "token_ids": [tid],
                    "logprobs": lps,
                    "finish_reason": None,
                }
            result = await job.future
            choice = result.choices[0]
            yield {
                "type": "delta",
                "index": 0,
                "delta": tail_delta(choice, text.sent),
                "token_ids": [],
                "logprobs": [] if want_lp else None,
                "finish_reason": choice.finish_reason,
            }
            yield {"type": "end", "result": result}
        finally:
            if not job.future.done():  # the client went away: stop generating this row
                self.engine.withdraw(job)

    def _result(self, job: Job, row: Row) -> GenerationResult:
        """A finished row as the call's result (the engine's worker thread): the text decoded, cut at a
        stop string, led by the forced opening and parsed for tool calls."""
        request, rendered = job.context
        ids = list(row.ids)
        hit_eos = row.ended == "eos"
        text = self.tokenizer.decode(ids[:-1] if hit_eos else ids)
        finish = "stop" if hit_eos or row.ended == "closed" else "length"
        for s in request.stop:
            cut = text.find(s) if s else -1
            if cut >= 0:
                text, finish = text[:cut], "stop"
        if finish == "length" and row.ended == "cancelled":
            finish = "cancelled"
        text = rendered.forced + text  # what the model said: the forced opening, then what it drew
        parsed = ParsedReply(text, [])
        if (
            request.messages is not None
            and request.tools
            and request.tool_choice != "none"
            and finish == "stop"
        ):
            parsed = parse_reply(text)
            if parsed.tool_calls:
                finish = "tool_calls"
        choice = Choice(
            text=text,
            content=parsed.content,
            tool_calls=parsed.tool_calls,
            response_ids=ids,
            logprobs=list(row.logprobs),
            finish_reason=finish,
            tool_call_repairs=parsed.repairs,
        )
        served = bool(self.engine.lora_names)
        return GenerationResult(
            model=request.model,
            choices=[choice],
            prompt_ids=list(job.prompt_ids),
            prompt_tokens=len(job.prompt_ids),
            weight_version=job.weight_version,
            weight_versions=[(v, n) for v, n in row.versions],
            adapter=(request.adapter or BASE_ADAPTER) if served else None,
            prompt_text=rendered.text,
            forced_tokens=rendered.forced_tokens,
        )
