"""The embedded default backend: any Hugging Face causal LM, in-process, on CPU or GPU.

Token ids are the ids the model actually consumed and produced: the prompt ids are the rendered chat
template encoded once (the same ids fed to ``generate``), the response ids are the generated ids
(EOS included: the model chose to stop), and the logprobs are ``log_softmax`` of the model's raw
logits at each generated position (``generate(output_logits=True)``, before temperature/top-p), the
same quantity a trainer recomputes. Nothing is re-tokenised.

Concurrency: requests wait in a queue; one worker thread runs the model. Waiting requests with the
same sampling settings are generated together as one left-padded batch (``max_batch_size``), so
throughput grows with concurrency while one request's rows never mix with another's. Weight swaps
take the same lock as generation: they happen between batches, never during one.

A client that disconnects cancels its request: a queued request is dropped, a running one stops at
the next token (a per-row stopping criterion).

Not enforced: ``response_format`` (no constrained decoding; the request is served as plain text) and
``tool_choice`` other than ``"none"`` (which hides the tools); the scripted, vllm and openai
backends cover those where it matters.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl.gateway.backends.base import (
    Backend,
    BackendError,
    Choice,
    ContextWindowError,
    GenerationRequest,
    GenerationResult,
    UnknownModelError,
)
from agl.gateway.chat_format import parse_tool_calls
from agl.gateway.tokenizer import ChatTokenizer, load_default_tokenizer

__all__ = ["TransformersBackend"]

log = logging.getLogger("agl.gateway")


@dataclass
class _Job:
    request: GenerationRequest
    prompt_ids: list[int]
    prompt_text: str
    max_new: int
    future: asyncio.Future[GenerationResult]
    cancel: threading.Event = field(default_factory=threading.Event)

    def batch_key(self) -> tuple[Any, ...]:
        r = self.request
        seeded = r.seed is not None
        return (r.temperature, r.top_p, seeded, id(self) if seeded else None)


class TransformersBackend(Backend):
    """Serve a Hugging Face causal LM.

    ``model``: None (the default SmolLM2-135M-Instruct, prepared on first use), a local path or a hub
    id (offline cache), or a loaded ``PreTrainedModel``. ``tokenizer``: None (the model's own, or the
    shipped SmolLM2 one for a model object), a Hugging Face fast tokenizer, or a
    :class:`~agl.gateway.tokenizer.ChatTokenizer`. ``model_name`` is what clients put in ``model``.
    ``threads`` sets torch's intra-op threads (fewer than the cores helps on a busy CPU).
    """

    name = "transformers"

    def __init__(
        self,
        model: Any = None,
        *,
        tokenizer: Any = None,
        model_name: str | None = None,
        chat_template: str | None = None,
        device: str | None = None,
        dtype: Any = None,
        max_batch_size: int = 8,
        default_max_tokens: int = 512,
        max_context: int | None = None,
        threads: int | None = None,
    ) -> None:
        super().__init__()
        self.threads = threads
        self._model_arg = model
        self._tokenizer_arg = tokenizer
        self._chat_template = chat_template
        self._device = device
        self._dtype = dtype
        self.max_batch_size = max_batch_size
        self.default_max_tokens = default_max_tokens
        self._max_context_arg = max_context
        self.model: Any = None
        self.tokenizer: ChatTokenizer | None = None
        self.model_name = model_name
        self.max_context: int | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agl-transformers")
        self._queue: list[_Job] = []
        self._wakeup: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._worker: asyncio.Task[None] | None = None
        self._peft_adapter: str | None = None
        if model is not None and not isinstance(model, (str, Path)):
            self._load_sync()

    # -------------------------------------------------------------------------- loading
    def _load_sync(self) -> None:
        if self.model is not None:
            return
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        model = self._model_arg
        tok = self._tokenizer_arg
        if model is None or isinstance(model, (str, Path)):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            if model is None:
                from agl.gateway.models import DEFAULT_MODEL, prepare_default_model

                path = str(prepare_default_model())
                self.model_name = self.model_name or DEFAULT_MODEL
            else:
                path = str(model)
                self.model_name = self.model_name or Path(path).name
            device = self._device or ("cuda" if torch.cuda.is_available() else "cpu")
            dtype = self._dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
            if tok is None:
                tok = AutoTokenizer.from_pretrained(path)
        if tok is None:
            tok = load_default_tokenizer()
        if not isinstance(tok, ChatTokenizer):
            tok = ChatTokenizer.from_hf(
                tok,
                chat_template=self._chat_template
                or getattr(tok, "chat_template", None)
                or load_default_tokenizer().chat_template,
            )
        elif self._chat_template:
            tok.chat_template = self._chat_template
        model.eval()
        self.model = model
        self.tokenizer = tok
        self.model_name = (
            self.model_name or getattr(getattr(model, "config", None), "_name_or_path", None) or "model"
        )
        limits = [
            x
            for x in (
                self._max_context_arg,
                getattr(model.config, "max_position_embeddings", None),
                tok.max_context,
            )
            if x
        ]
        self.max_context = min(limits) if limits else None
        eos = {tok.eos_token_id}
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            eos.add(gen_eos)
        elif isinstance(gen_eos, (list, tuple)):
            eos.update(gen_eos)
        self._eos_ids = sorted(e for e in eos if e is not None)
        self._pad_id = tok.token_to_id(tok.pad_token) if tok.pad_token else None
        if self._pad_id is None:
            self._pad_id = self._eos_ids[0]

    async def start(self) -> None:
        if self.model is None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._load_sync)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            self._worker = None

    def models(self) -> list[str]:
        return [self.model_name or "model"]

    def check_model(self, model: str) -> None:
        if self.model is None:
            self._load_sync()
        if model not in self.models():
            raise UnknownModelError(model, self.models())

    @property
    def device(self) -> Any:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------------ generation
    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._lock = self._lock or asyncio.Lock()
            self._worker = asyncio.create_task(self._run_worker())

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self.model is None:
            await self.start()
        assert self.tokenizer is not None
        tok = self.tokenizer
        if request.messages is not None:
            tools = None if request.tool_choice == "none" else request.tools
            prompt_text, prompt_ids = tok.encode_chat(request.messages, tools)
        else:
            prompt_text = request.prompt or ""
            prompt_ids = tok.encode(prompt_text)
        if not prompt_ids:
            raise BackendError("the prompt is empty")
        limit = self.max_context
        if limit is not None and len(prompt_ids) >= limit:
            raise ContextWindowError(len(prompt_ids), limit)
        max_new = request.max_tokens or self.default_max_tokens
        if limit is not None:
            max_new = min(max_new, limit - len(prompt_ids))
        self._ensure_worker()
        jobs = []
        for _ in range(request.n):
            fut: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
            job = _Job(request, prompt_ids, prompt_text, max_new, fut)
            jobs.append(job)
            self._queue.append(job)
        assert self._wakeup is not None
        self._wakeup.set()
        try:
            parts = await asyncio.gather(*(j.future for j in jobs))
        except asyncio.CancelledError:
            for j in jobs:
                j.cancel.set()
                if j in self._queue:
                    self._queue.remove(j)
            raise
        first = parts[0]
        first.choices = [p.choices[0] for p in parts]
        return first

    async def _run_worker(self) -> None:
        assert self._wakeup is not None and self._lock is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                async with self._lock:
                    head = self._queue[0]
                    key = head.batch_key()
                    batch = [j for j in self._queue if j.batch_key() == key and not j.future.done()][
                        : self.max_batch_size
                    ]
                    for j in batch:
                        self._queue.remove(j)
                    self._queue = [j for j in self._queue if not j.future.done()]
                    if not batch:
                        continue
                    try:
                        results = await loop.run_in_executor(self._executor, self._generate_batch, batch)
                    except Exception as exc:  # noqa: BLE001 - every waiting request learns of it
                        log.exception("agl gateway: generation failed")
                        for j in batch:
                            if not j.future.done():
                                j.future.set_exception(
                                    BackendError(f"generation failed: {type(exc).__name__}: {exc}")
                                )
                        continue
                    for j, res in zip(batch, results, strict=True):
                        if not j.future.done():
                            j.future.set_result(res)

    def _generate_batch(self, batch: Sequence[_Job]) -> list[GenerationResult]:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        tok = self.tokenizer
        assert tok is not None
        model = self.model
        version = self.weight_version
        req = batch[0].request
        device = self.device
        width = max(len(j.prompt_ids) for j in batch)
        input_ids = torch.full((len(batch), width), self._pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, j in enumerate(batch):
            n = len(j.prompt_ids)
            input_ids[row, width - n :] = torch.tensor(j.prompt_ids, dtype=torch.long)
            attention[row, width - n :] = 1
        stops = [j.request.stop for j in batch]
        max_new = max(j.max_new for j in batch)
        ended_at: list[int | None] = [None] * len(batch)
        eos_ids = self._eos_ids

        class _PerRow(StoppingCriteria):
            """Stop a row on its own limit, its stop strings or its cancellation."""

            def __call__(self, ids: Any, scores: Any, **kwargs: Any) -> Any:
                step = ids.shape[1] - width
                done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
                for row, j in enumerate(batch):
                    if ended_at[row] is not None:
                        done[row] = True
                        continue
                    stop = j.cancel.is_set() or step >= j.max_new
                    if not stop and stops[row]:
                        tail = tok.decode(ids[row, width:].tolist()[-32:])
                        stop = any(s in tail for s in stops[row])
                    if stop:
                        ended_at[row] = step
                        done[row] = True
                return done

        sample = req.temperature is None or req.temperature > 0
        kwargs: dict[str, Any] = {}
        if sample:
            kwargs.update(do_sample=True, temperature=req.temperature or 1.0, top_p=req.top_p or 1.0, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if req.seed is not None:
            torch.manual_seed(req.seed)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                max_new_tokens=max_new,
                stopping_criteria=StoppingCriteriaList([_PerRow()]),
                eos_token_id=eos_ids,
                pad_token_id=self._pad_id,
                output_logits=True,
                return_dict_in_generate=True,
                **kwargs,
            )
        generated = out.sequences[:, width:].tolist()
        logits = out.logits
        results = []
        for row, j in enumerate(batch):
            ids = generated[row]
            n = len(ids)
            if ended_at[row] is not None:
                n = min(n, ended_at[row])
            eos_pos = next((k for k, t in enumerate(ids[:n]) if t in eos_ids), None)
            hit_eos = eos_pos is not None
            if hit_eos:
                n = eos_pos + 1
            ids = ids[:n]
            if n:
                step_logits = torch.stack([logits[k][row] for k in range(n)]).float()
                lp = torch.log_softmax(step_logits, dim=-1).gather(
                    1, torch.tensor(ids, device=step_logits.device)[:, None]
                )
                logprobs = lp[:, 0].tolist()
            else:
                logprobs = []
            text_ids = ids[:-1] if hit_eos else ids
            text = tok.decode(text_ids)
            finish = "stop" if hit_eos else "length"
            for s in j.request.stop:
                cut = text.find(s)
                if cut >= 0:
                    text, finish = text[:cut], "stop"
            if finish == "length" and j.cancel.is_set():
                finish = "cancelled"
            content: str | None = text
            calls = []
            r = j.request
            if r.messages is not None and r.tools and r.tool_choice != "none" and finish == "stop":
                content, calls = parse_tool_calls(text)
                if calls:
                    finish = "tool_calls"
            choice = Choice(
                text=text,
                content=content,
                tool_calls=calls,
                response_ids=ids,
                logprobs=logprobs,
                finish_reason=finish,
            )
            results.append(
                GenerationResult(
                    model=r.model,
                    choices=[choice],
                    prompt_ids=list(j.prompt_ids),
                    prompt_tokens=len(j.prompt_ids),
                    weight_version=version,
                    prompt_text=j.prompt_text,
                )
            )
        return results

    # ----------------------------------------------------------------------- weight swap
    async def _swap(self, fn: Any) -> int:
        if self.model is None:
            await self.start()
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def set_model(self, model: Any, *, version: int | None = None) -> int:
        """Serve ``model`` (same tokenizer) from the next request on."""

        def swap() -> int:
            model.eval()
            self.model = model
            return self._bump_version(version)

        return await self._swap(swap)

    async def load_weights(self, source: Any, *, version: int | None = None) -> int:
        """New full weights: a state dict, a ``.safetensors`` file or a checkpoint directory."""

        def swap() -> int:
            state = source
            if isinstance(source, (str, Path)):
                path = Path(source)
                if path.is_dir():
                    files = sorted(path.glob("*.safetensors"))
                    if not files:
                        raise FileNotFoundError(f"no .safetensors file in {path}")
                else:
                    files = [path]
                    if not path.exists():
                        raise FileNotFoundError(f"no weights at {path}")
                from safetensors.torch import load_file

                state = {}
                for f in files:
                    state.update(load_file(str(f), device=str(self.device)))
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected:
                raise ValueError(f"the weights do not fit this model: unexpected keys {list(unexpected)[:5]}")
            known = {k for k, _ in self.model.named_parameters()}
            if not (set(state) & known):
                raise ValueError("the weights share no parameter with this model")
            return self._bump_version(version)

        return await self._swap(swap)

    async def load_adapter(self, path: str, *, name: str | None = None, version: int | None = None) -> int:
        """A LoRA adapter (peft) on top of the base weights; replaces the previous adapter."""

        def swap() -> int:
            if not Path(path).exists():
                raise FileNotFoundError(f"no adapter at {path}")
            from peft import PeftModel

            adapter = name or f"agl-{self.weight_version + 1}"
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(path, adapter_name=adapter)
                self.model.set_adapter(adapter)
                if self._peft_adapter and self._peft_adapter != adapter:
                    self.model.delete_adapter(self._peft_adapter)
            else:
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=adapter)
            self.model.eval()
            self._peft_adapter = adapter
            return self._bump_version(version)

        return await self._swap(swap)
