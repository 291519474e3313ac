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

Weights: :meth:`TransformersBackend.push` serves a training policy without a second copy of its frozen
base weights (see its docstring); ``load_weights``/``load_adapter`` take files. Concurrency: continuous batching (:mod:`agl.engine.batching`). One worker thread owns the
model and runs one batch: a request arriving while it runs is prefilled and joins the batch before
the next decode step, a finished one leaves it at once, and every row keeps its own temperature,
top_p, top_k, max_tokens, stop strings and seed (``max_batch_size`` rows at most; the others wait).
Weight swaps that keep the model object (every :meth:`push` after the first, ``load_weights``, a new
adapter on a peft model) do not drain the engine: the worker runs them between two decode steps
(:mod:`agl.engine.swaps`), and a running call draws its remaining tokens from the new
weights, each token tagged with the version that drew it (``GenerationResult.weight_versions``; the
result's ``weight_version`` is the oldest, the version that admitted it). A swap that replaces the model
(``set_model``, the first push) takes the generation lock instead: new rows stop joining, the running
ones finish, and the swap happens between batches. A client that disconnects cancels its request: a
queued request is dropped, a running one leaves the batch before the next step.

``tool_choice``: ``"none"`` hides the tools; ``"required"`` and a named function start the reply with
the tool-call opening (and the function's name), appended to the prompt as forced tokens: they are the
end of ``prompt_ids`` (context, outside the loss), counted in ``GenerationResult.forced_tokens`` (the
span's ``agl.llm.forced_tokens``), and the reply's text starts with them. A value it cannot honour (an
unknown one, a function not among the tools) is answered 400. Not enforced: ``response_format`` (no
constrained decoding; the request is served as plain text).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl.chat.format import ParsedReply, forced_tool_prefix, parse_reply
from agl.chat.stream_text import StreamText, hand_over, tail_delta, token_logprobs
from agl.chat.tokenizer import ChatTokenizer, load_default_tokenizer
from agl.engine.batching import Batch, BusyClock, Row
from agl.engine.dtype import resolve_dtype
from agl.engine.loras import AgentAdapters, with_adapters
from agl.engine.merged_lora import policy_copy as _policy_copy
from agl.engine.prefix_cache import PrefixCache
from agl.engine.swaps import LiveSwaps
from agl.gateway.backends.base import (
    Backend,
    BackendError,
    Choice,
    ContextWindowError,
    GenerationRequest,
    GenerationResult,
    UnknownModelError,
    UpstreamError,
    whole_stream,
)
from agl.lora import check_lora_dirs
from agl.semconv import BASE_ADAPTER

__all__ = ["TransformersBackend"]

log = logging.getLogger("agl.gateway")


@dataclass
class _Job:
    request: GenerationRequest
    prompt_ids: list[int]
    prompt_text: str
    max_new: int
    future: asyncio.Future[GenerationResult]
    loop: asyncio.AbstractEventLoop
    cancel: threading.Event = field(default_factory=threading.Event)
    #: streamed jobs: (token id, logprob) per generated token, then None when the job is done
    tokens: asyncio.Queue[tuple[int, float] | None] | None = None
    #: the choices of one seeded request share one generator (else each would repeat the first)
    generator: Any = None
    weight_version: int = 0


def _top_k(request: GenerationRequest) -> int | None:
    """``top_k`` is not an OpenAI parameter; vLLM-style clients send it as an extra body field."""
    value = request.raw.get("top_k") if isinstance(request.raw, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def _forced_prefix(request: GenerationRequest) -> str:
    """The tool-call opening ``request.tool_choice`` forces (``""`` for none); an unsupported value is
    the client's error (400), never silently ignored."""
    try:
        return forced_tool_prefix(request.tool_choice, request.tools)
    except ValueError as exc:
        raise UpstreamError(400, str(exc), {"error": {"message": str(exc), "param": "tool_choice"}}) from None


class TransformersBackend(AgentAdapters, Backend):
    """Serve a Hugging Face causal LM.

    ``model``: None (the default SmolLM2-135M-Instruct, prepared on first use), a local path or a hub
    id (offline cache), or a loaded ``PreTrainedModel``. ``tokenizer``: None (the model's own, or the
    shipped SmolLM2 one for a model object), a Hugging Face fast tokenizer, or a
    :class:`~agl.chat.tokenizer.ChatTokenizer`. ``model_name`` is what clients put in ``model``.
    ``threads`` sets torch's intra-op threads (fewer than the cores helps on a busy CPU).
    ``default_temperature``/``default_top_p`` apply to requests that leave them out (the trainer sets
    them from its :class:`agl.RunConfig`). ``deterministic=True``: one row at a time (a padded batch's
    logits differ in the last bits), so a seed reproduces a call's tokens (cost: bench/reproducible.py).
    """

    name = "transformers"
    streams = True

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
        default_temperature: float = 1.0,
        default_top_p: float = 1.0,
        batch_window_s: float = 0.005,
        adapters: dict[str, str] | None = None,
        batched_lora: bool = False,
        deterministic: bool = False,
        prefix_cache_mb: float = 128.0,
        _pushed_from: Any = None,
    ) -> None:
        super().__init__()
        if not isinstance(deterministic, bool):
            raise ValueError(f"deterministic must be True or False, got {deterministic!r}")
        if isinstance(prefix_cache_mb, bool) or not (
            isinstance(prefix_cache_mb, (int, float)) and 0 <= prefix_cache_mb < float("inf")
        ):
            raise ValueError(f"prefix_cache_mb must be a number >= 0 (0: off), got {prefix_cache_mb!r}")
        #: recent prompts' KV, reused by prompts that start alike (off under ``deterministic``: a cached
        #: prefix was computed in another batch, so its last bits may differ from the row's own prefill)
        self._prefix = (
            PrefixCache(int(prefix_cache_mb * 2**20)) if prefix_cache_mb > 0 and not deterministic else None
        )
        self.deterministic = deterministic  # batch-invariant logits: one row at a time
        self.batched_lora, self._lora_stack = batched_lora, None  # mixed batches: see _batched_lora
        #: named LoRA adapter folders to serve beside the base model (``agl gateway serve --adapter``)
        self._adapter_paths = check_lora_dirs(adapters) if adapters else {}
        self.batch_window_s = batch_window_s
        #: the running batch's size after each admission of new rows (what concurrency actually bought)
        self.batch_sizes: deque[int] = deque(maxlen=256)
        if not (default_temperature >= 0 and default_temperature < float("inf")):
            raise ValueError(f"default_temperature must be a finite number >= 0, got {default_temperature!r}")
        if not (0 < default_top_p <= 1):
            raise ValueError(f"default_top_p must be in (0, 1], got {default_top_p!r}")
        self.default_temperature = float(default_temperature)
        self.default_top_p = float(default_top_p)
        self._generator: Any = None
        self._pushed_from: Any = _pushed_from
        #: the pushed policy's LoRA merged into this engine's own weights (another dtype than the
        #: policy's: :mod:`._merged_lora`); None when the engine runs the adapter through peft
        self._merged: Any = None
        self.threads = threads
        self._model_arg = model
        self._tokenizer_arg = tokenizer
        self._chat_template = chat_template
        self._device = device
        self._dtype = dtype
        self.max_batch_size = 1 if deterministic else max_batch_size
        self.default_max_tokens = default_max_tokens
        self._max_context_arg = max_context
        self.model: Any = None
        self.tokenizer: ChatTokenizer | None = None
        self.model_name = model_name
        self.max_context: int | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agl-transformers")
        self._queue: list[_Job] = []  # guarded by _queue_lock: the worker thread takes from it
        self._queue_lock = threading.Lock()
        self._swaps_waiting = 0
        #: in-place swaps waiting for the worker's next scheduler iteration (between decode steps)
        self._live_swaps = LiveSwaps()
        self.busy = BusyClock()  # seconds the scheduler ran at least one row (the busy share metric)
        self._drawn: list[tuple[Any, Any, Any]] = []  # streamed tokens of this step (worker thread)
        self._processors_cache: dict[Any, Any] = {}  # per prompt length (min_length rules)
        self._wakeup: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._worker: asyncio.Task[None] | None = None
        self._peft_adapter: str | None = None
        #: the named LoRA adapters served beside the base model (one per agent; see :meth:`route`)
        self.agent_adapters: list[str] = []
        if model is not None and not isinstance(model, (str, Path)):
            self._load_sync()

    @classmethod
    def for_policy(cls, policy: Any, **kwargs: Any) -> TransformersBackend:
        """An engine serving a :class:`~agl.algorithms.update.PolicyUpdate` of this process, sharing
        its frozen weights (see :meth:`push`); ``kwargs`` as for the constructor."""
        source = policy.model
        dtype = resolve_dtype(kwargs.get("dtype"), str(next(source.parameters()).device))
        model, merged = _policy_copy(policy, dtype)
        backend = cls(model, _pushed_from=source, **kwargs)
        backend._merged = merged
        backend.agent_adapters = list(getattr(policy, "adapters", {}).values())
        return backend

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
                from agl.chat.models import DEFAULT_MODEL, prepare_default_model

                path = str(prepare_default_model())
                self.model_name = self.model_name or DEFAULT_MODEL
            else:
                path = str(model)
                self.model_name = self.model_name or Path(path).name
            device = self._device or ("cuda" if torch.cuda.is_available() else "cpu")
            dtype = resolve_dtype(self._dtype, device) or (
                torch.bfloat16 if device.startswith("cuda") else torch.float32
            )
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
            if tok is None:
                tok = AutoTokenizer.from_pretrained(path)
        elif self._dtype is not None and self._pushed_from is None:  # a model object, cast as asked
            model = model.to(resolve_dtype(self._dtype, str(next(model.parameters()).device)))
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
        if self._adapter_paths:
            model = with_adapters(model, self._adapter_paths)
            self.agent_adapters = list(self._adapter_paths)
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
        tok.max_token_chars  # noqa: B018 - computed once here (a worker thread), not during a request
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
        """The base model's name, then ``"<base>:<adapter>"`` for each named adapter."""
        base = self.model_name or "model"
        return [base, *(f"{base}:{name}" for name in self.agent_adapters)]

    def agent_loras(self) -> list[str]:
        return list(self.agent_adapters)

    def max_prompt_chars(self) -> int | None:
        tok = self.tokenizer
        return None if tok is None else tok.max_prompt_chars(self.max_context)

    def check_model(self, model: str) -> None:
        if self.model is None:
            self._load_sync()
        if model not in self.models():
            raise UnknownModelError(model, self.models())

    @property
    def device(self) -> Any:
        return next(self.model.parameters()).device

    @property
    def serving_dtype(self) -> Any:
        """The dtype the engine computes in (None before the model is loaded)."""
        return None if self.model is None else next(self.model.parameters()).dtype

    # ------------------------------------------------------------------------ generation
    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._lock = self._lock or asyncio.Lock()
            self._worker = asyncio.create_task(self._run_worker())

    async def _prepare(self, request: GenerationRequest) -> tuple[str, list[int], int]:
        """(prompt text, prompt ids, max new tokens) of a request; raises on an empty or long prompt."""
        if self.model is None:
            await self.start()
        assert self.tokenizer is not None
        tok = self.tokenizer
        if request.messages is not None:
            tools = None if request.tool_choice == "none" else request.tools
            prompt_text, prompt_ids = await tok.aencode_chat(
                request.messages, tools
            )  # off the loop when long
            forced = _forced_prefix(request)
            if forced:  # honour tool_choice: the reply starts with the tool-call opening
                prompt_text, prompt_ids = prompt_text + forced, [*prompt_ids, *await tok.aencode(forced)]
        else:
            prompt_text = request.prompt or ""
            prompt_ids = await tok.aencode(prompt_text)
        if not prompt_ids:
            raise BackendError("the prompt is empty")
        limit = self.max_context
        if limit is not None and len(prompt_ids) >= limit:
            raise ContextWindowError(len(prompt_ids), limit)
        max_new = request.max_tokens or self.default_max_tokens
        if limit is not None:
            max_new = min(max_new, limit - len(prompt_ids))
        return prompt_text, prompt_ids, max_new

    def _submit(self, job: _Job) -> None:
        with self._queue_lock:
            self._queue.append(job)
        self._ensure_worker()
        assert self._wakeup is not None
        self._wakeup.set()

    def _withdraw(self, job: _Job) -> None:
        """The client went away: a queued job is dropped, a running one leaves the batch next step."""
        job.cancel.set()
        with self._queue_lock:
            if job in self._queue:
                self._queue.remove(job)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        prompt_text, prompt_ids, max_new = await self._prepare(request)
        loop = asyncio.get_running_loop()
        generator = None if request.seed is None else self._generator_for(request.seed, self.device)
        jobs = [
            _Job(request, prompt_ids, prompt_text, max_new, loop.create_future(), loop, generator=generator)
            for _ in range(request.n)
        ]
        for job in jobs:
            self._submit(job)
        try:
            parts = await asyncio.gather(*(j.future for j in jobs))
        except asyncio.CancelledError:
            for j in jobs:
                self._withdraw(j)
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
        prompt_text, prompt_ids, max_new = await self._prepare(request)
        tok = self.tokenizer
        assert tok is not None
        loop = asyncio.get_running_loop()
        job = _Job(
            request, prompt_ids, prompt_text, max_new, loop.create_future(), loop, tokens=asyncio.Queue()
        )
        self._submit(job)
        want_lp = bool(isinstance(request.raw, dict) and request.raw.get("logprobs"))
        forced = bool(request.messages is not None and _forced_prefix(request))
        text = StreamText(tok, request, set(self._eos_ids), forced=forced)
        ids: list[int] = []
        try:
            yield {"type": "start", "prompt_ids": list(prompt_ids)}
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
                self._withdraw(job)

    async def _run_worker(self) -> None:
        assert self._wakeup is not None and self._lock is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            waited = 0.0
            while self.batch_window_s > 0 and 0 < len(self._queue) < self.max_batch_size and waited < 0.05:
                # requests of concurrent clients arrive a few ms apart: let them be prefilled together
                # (one forward pass), for as long as more keep arriving (at most 50 ms); later ones join
                # the running batch between decode steps
                seen = len(self._queue)
                await asyncio.sleep(self.batch_window_s)
                waited += self.batch_window_s
                if len(self._queue) == seen:
                    break
            while self._queue:
                async with self._lock:
                    self.busy.start()
                    try:
                        await loop.run_in_executor(self._executor, self._serve)
                    except Exception:  # noqa: BLE001 - _serve fails its rows itself; keep serving
                        log.exception("agl gateway: the generation loop failed")
                    finally:
                        self.busy.stop()

    def _take(self, room: int) -> list[_Job]:
        """Up to ``room`` queued jobs (the cancelled ones are dropped)."""
        with self._queue_lock:
            live = [j for j in self._queue if not (j.cancel.is_set() or j.future.done())]
            taken, self._queue = live[:room], live[room:]
        return taken

    def _serve(self) -> None:
        """The scheduler (worker thread): admit queued jobs into the running batch between decode
        steps until no row runs and none waits, or a weight swap waits."""
        import torch

        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        batch = Batch(
            self.model, self._pad_id, per_row_adapters=bool(self.agent_adapters), prefix=self._prefix
        )
        batch.version, batch.lora = self.weight_version, self._stacked_adapters()
        with torch.inference_mode():
            while True:
                admitting: list[Row] = []
                ended: list[Row] = []
                try:
                    if self._live_swaps:  # between two decode steps: the rows go on with the new weights
                        with torch.inference_mode(False):
                            self._live_swaps.run()
                        batch.version, batch.lora = self.weight_version, self._stacked_adapters()
                    ended = batch.cancel_ended()
                    room = self.max_batch_size - len(batch)
                    if room > 0 and not self._swaps_waiting and batch.joinable():
                        admitting = [self._row(j) for j in self._take(room)]
                    if admitting:
                        ended += batch.admit(admitting)
                        self._hand_tokens()
                        admitting = []
                        self.batch_sizes.append(len(batch))
                    if not len(batch):
                        for r in ended:
                            self._finish(r)
                        if self._swaps_waiting or not self._queue:
                            return
                        continue
                    ended += batch.step()
                    self._hand_tokens()
                except Exception as exc:  # noqa: BLE001 - every request in the batch learns of it
                    self._hand_tokens()  # what was drawn before the failure, before the error
                    log.exception("agl gateway: generation failed")
                    error = BackendError(f"generation failed: {type(exc).__name__}: {exc}")
                    for r in admitting + batch.fail():
                        self._deliver(r.payload, None, error)
                for r in ended:
                    self._finish(r)

    def _hand_tokens(self) -> None:
        """Hand this step's streamed tokens to their event loops (one wake-up per loop and step)."""
        drawn, self._drawn = self._drawn, []
        if drawn:
            hand_over(drawn)

    def _row(self, job: _Job) -> Row:
        r = job.request
        tok = self.tokenizer
        assert tok is not None
        job.weight_version = self.weight_version
        on_token = None
        if job.tokens is not None:
            queue, loop = job.tokens, job.loop

            def on_token(token: int, logprob: float) -> None:
                self._drawn.append((loop, queue, (token, logprob)))

        return Row(
            prompt_ids=job.prompt_ids,
            max_new=job.max_new,
            temperature=float(r.temperature if r.temperature is not None else self.default_temperature),
            top_p=float(r.top_p if r.top_p is not None else self.default_top_p),
            top_k=_top_k(r),
            generator=job.generator or self._generator_for(r.seed, self.device),
            eos=frozenset(self._eos_ids),
            stops=tuple(x for x in r.stop if x),
            # a reply forced to open a tool call ends once that call is closed (vLLM's "required" ends
            # with the call too); what follows would be prose the client asked not to get
            closers=("</tool_call>",) if r.messages is not None and _forced_prefix(r) else (),
            decode=tok.decode,
            cancel=job.cancel,
            processors=self._processors(len(job.prompt_ids)),
            on_token=on_token,
            payload=job,
            adapter=r.adapter if self.agent_adapters else None,
        )

    def _processors(self, prompt_len: int) -> Any:
        """The logits processors ``generate`` would add from the model's generation config (e.g. a
        repetition penalty), sampling warpers left out (agl applies the request's own); None when
        there are none, which is the common case."""
        model = self.model
        config = getattr(model, "generation_config", None)
        getter = getattr(model, "_get_logits_processor", None)
        if config is None or getter is None:
            return None
        if self._processors_cache.get("model") is not model:  # a swapped model: start afresh
            self._processors_cache = {"model": model}
        if prompt_len in self._processors_cache:
            return self._processors_cache[prompt_len]
        try:
            config = copy.deepcopy(config)
            config.do_sample = False
            config.temperature = config.top_p = config.top_k = None
            procs = getter(config, input_ids_seq_length=prompt_len, device=str(self.device), model_kwargs={})
            procs = procs if len(procs) else None
        except Exception:  # noqa: BLE001 - a private transformers API: without it, none
            procs = None
        if len(self._processors_cache) < 4096:
            self._processors_cache[prompt_len] = procs
        return procs

    def _finish(self, row: Row) -> None:
        job: _Job = row.payload
        try:
            result = self._result(job, row)
        except Exception as exc:  # noqa: BLE001
            log.exception("agl gateway: building a result failed")
            self._deliver(job, None, BackendError(f"generation failed: {type(exc).__name__}: {exc}"))
            return
        self._deliver(job, result, None)

    @staticmethod
    def _deliver(job: _Job, result: GenerationResult | None, error: BaseException | None) -> None:
        """Hand a job its result (or error) on its event loop; a streamed job's token queue ends after."""

        def settle() -> None:
            if not job.future.done():
                if error is not None:
                    job.future.set_exception(error)
                else:
                    job.future.set_result(result)  # type: ignore[arg-type]
            if job.tokens is not None:
                job.tokens.put_nowait(None)

        try:
            job.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _result(self, job: _Job, row: Row) -> GenerationResult:
        tok = self.tokenizer
        assert tok is not None
        ids = list(row.ids)
        hit_eos = row.ended == "eos"
        text = tok.decode(ids[:-1] if hit_eos else ids)
        finish = "stop" if hit_eos or row.ended == "closed" else "length"
        r = job.request
        for s in r.stop:
            cut = text.find(s) if s else -1
            if cut >= 0:
                text, finish = text[:cut], "stop"
        if finish == "length" and row.ended == "cancelled":
            finish = "cancelled"
        forced = _forced_prefix(r) if r.messages is not None else ""
        text = forced + text  # what the model said: the forced opening, then what it drew
        parsed = ParsedReply(text, [])
        if r.messages is not None and r.tools and r.tool_choice != "none" and finish == "stop":
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
        return GenerationResult(
            model=r.model,
            choices=[choice],
            prompt_ids=list(job.prompt_ids),
            prompt_tokens=len(job.prompt_ids),
            weight_version=job.weight_version,
            weight_versions=[(v, n) for v, n in row.versions],
            adapter=(r.adapter or BASE_ADAPTER) if self.agent_adapters else None,
            prompt_text=job.prompt_text,
            forced_tokens=len(tok.encode(forced)) if forced else 0,  # the ids _prepare appended
        )

    def _generator_for(self, seed: int | None, device: Any) -> Any:
        """A seeded request gets a fresh generator of its own; the others share the backend's, seeded
        once from the OS. Neither touches the process-wide torch RNG."""
        import torch

        if seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(int(seed) % (2**63))
            return gen
        if self._generator is None or self._generator.device != torch.device(device):
            self._generator = torch.Generator(device=device)
            self._generator.seed()
        return self._generator

    # ----------------------------------------------------------------------- weight swap
    def _bump_version(self, version: int | None) -> int:
        """Every swap ends here (worker thread): cached prefixes were computed by the old weights."""
        if self._prefix is not None:
            self._prefix.clear()
        return int(super()._bump_version(version))

    def prefix_stats(self) -> dict[str, float]:
        """Prompt tokens admitted and those not run through the model (the prefix cache's hits and
        same-prompt rows of one admission); empty with the cache off."""
        return {} if self._prefix is None else self._prefix.stats()

    async def _swap(self, fn: Any, *, in_place: bool = False) -> int:
        """Run the swap ``fn`` in the worker thread: ``in_place`` (the model object stays) between two
        decode steps of the running batch, else once the batch has drained."""
        if self.model is None:
            await self.start()
        self._lock = self._lock or asyncio.Lock()
        if in_place:
            return await self._live_swaps.submit(fn, self._lock, self._executor, self._live_swaps.run)
        self._swaps_waiting += 1  # the running batch admits no new rows: it drains, then the swap runs
        try:
            async with self._lock:
                return await asyncio.get_running_loop().run_in_executor(self._executor, fn)
        finally:
            self._swaps_waiting -= 1

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

        return await self._swap(swap, in_place=self.model is not None)

    async def load_adapter(self, path: str, *, name: str | None = None, version: int | None = None) -> int:
        """A LoRA adapter (peft) replacing the previous one (an agent adapter's ``name``: its new weights)."""
        if name is not None and name in self.agent_adapters:
            return await self.load_agent_adapters({name: path}, version=version)

        def swap() -> int:
            if not Path(path).exists():
                raise FileNotFoundError(f"no adapter at {path}")
            from peft import PeftModel

            adapter = name or f"agl-{self.weight_version + 1}"
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(path, adapter)
                self.model.set_adapter(adapter)
                if self._peft_adapter and self._peft_adapter != adapter:
                    self.model.delete_adapter(self._peft_adapter)
            else:
                self.model = PeftModel.from_pretrained(self.model, path, adapter)
            self.model.eval()
            self._peft_adapter = adapter
            return self._bump_version(version)

        # a new adapter on a peft model keeps the model object: applied between decode steps
        return await self._swap(swap, in_place=getattr(self.model, "peft_config", None) is not None)

    async def push(self, policy: Any, *, version: int | None = None, staging_dir: Any = None) -> int:
        """Serve ``policy`` (a :class:`~agl.algorithms.update.PolicyUpdate` in this process) from the next
        request on, without a second copy of its frozen weights.

        The first push builds the engine's model from the policy's: a copy of the module tree whose
        frozen tensors (the base weights under LoRA) *are* the policy's tensors, shared, and whose
        trainable tensors (the LoRA A/B matrices, a few MB) are its own. Every later push copies the
        trainable tensors in place, between two decode steps — nothing else is allocated or cloned.
        The engine keeps its own trainable copy so an update running while a late request still
        generates never changes the weights under it. Under full fine-tuning every tensor is trainable,
        so the engine holds one full copy (made once) and each push copies all weights in place.
        """
        source = policy.model

        def swap() -> int:
            import torch

            if self._pushed_from is not source:
                self.model, self._merged = _policy_copy(policy, resolve_dtype(self._dtype, str(self.device)))
                self._pushed_from = source
                self.agent_adapters = list(getattr(policy, "adapters", {}).values())
            elif self._merged is not None:  # the adapter merged into the engine's own weights
                self._merged.refresh()
            else:
                with torch.no_grad():
                    for (name, dst), (_, src) in zip(
                        _trainable(self.model, source), _trainable(source, source), strict=True
                    ):
                        if dst.shape != src.shape:
                            raise BackendError(f"pushed tensor {name} changed shape")
                        dst.copy_(src.detach())
            return self._bump_version(version)

        return await self._swap(swap, in_place=self.model is not None and self._pushed_from is source)


def _trainable(model: Any, reference: Any) -> list[tuple[str, Any]]:
    """``model``'s parameters that are trainable in ``reference`` (by name, in a fixed order)."""
    wanted = {name for name, p in reference.named_parameters() if p.requires_grad}
    return [(name, p) for name, p in model.named_parameters() if name in wanted]
