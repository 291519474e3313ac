"""The embedded engine: a Hugging Face causal LM in this process, one worker thread that owns it, and
its weight swaps.

Token ids in, token ids out: a :class:`Job` is a prompt's ids with its sampling settings; the engine
generates it in the running batch and hands the finished row to the job's ``build`` (in the worker
thread), whose value the job's future gets. Rendering chats and building replies is the gateway
backend's (:class:`agl.gateway.backends.transformers.TransformersBackend`), which is a thin layer over
this class.

Concurrency: continuous batching (:mod:`agl.engine.batching`). One worker thread owns the model and
runs one batch: a job arriving while it runs is prefilled and joins the batch before the next decode
step, a finished one leaves it at once, and every row keeps its own temperature, top_p, top_k, max
tokens, stop strings and seed (``EngineSettings.max_batch_size`` rows at most; the others wait). Each
job that sets a ``seed`` draws from a ``torch.Generator`` of its own (else from the engine's): the
process-wide RNG that a trainer in the same process uses is never touched.

Weight swaps that keep the model object (every :meth:`Engine.push` after the first, ``load_weights``,
a new adapter on a peft model) do not drain the engine: the worker runs them between two decode steps
(:mod:`agl.engine.swaps`), and a running job draws its remaining tokens from the new weights, each
token tagged with the version that drew it (``Row.versions``). A swap that replaces the model
(``set_model``, the first push) takes the generation lock instead: new rows stop joining, the running
ones finish, and the swap happens between batches. A withdrawn job (its client went away) is dropped
from the queue, or leaves the running batch before the next step.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl.chat.stream_text import hand_over
from agl.engine.batching import Batch, BusyClock, Row
from agl.engine.dtype import resolve_dtype
from agl.engine.loader import load, read_weights, trainable
from agl.engine.loras import AgentLoras
from agl.engine.merged_lora import policy_copy
from agl.engine.prefix_cache import PrefixCache
from agl.engine.settings import EngineSettings
from agl.engine.swaps import LiveSwaps
from agl.errors import BackendError
from agl.lora import check_lora_dirs

__all__ = ["Engine", "Job"]

log = logging.getLogger("agl.gateway")


@dataclass
class Job:
    """One sequence to generate: the prompt's ids, how to sample, and where the result goes."""

    prompt_ids: list[int]
    max_new: int
    temperature: float
    top_p: float
    top_k: int | None
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    #: the finished row into the caller's result (run in the worker thread; an exception fails the job)
    build: Callable[[Job, Row], Any]
    stops: tuple[str, ...] = ()
    #: strings that end the reply with them kept (a forced tool call's closing tag)
    closers: tuple[str, ...] = ()
    seed: int | None = None
    #: the named LoRA that serves the job (None: the base model)
    adapter: str | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    #: streamed jobs: (token id, logprob) per generated token, then None when the job is done
    tokens: asyncio.Queue[tuple[int, float] | None] | None = None
    #: the jobs of one seeded request share one generator (else each would repeat the first)
    generator: Any = None
    #: the weight version that admitted the job (set by the worker)
    weight_version: int = 0
    #: the caller's own data (the request it came from)
    context: Any = None


class Engine(AgentLoras):
    """A causal LM served by one worker thread (see the module docstring).

    ``model``: None (the default SmolLM2-135M-Instruct, prepared on first use), a local path or a hub
    id (offline cache), or a loaded ``PreTrainedModel`` (loaded at once). ``loras``: named LoRA folders
    served beside the base model. ``batch_window_s``: how long the worker waits for concurrent jobs to
    be prefilled together.
    """

    def __init__(
        self,
        model: Any = None,
        *,
        settings: EngineSettings | None = None,
        tokenizer: Any = None,
        model_name: str | None = None,
        chat_template: str | None = None,
        device: str | None = None,
        max_context: int | None = None,
        batch_window_s: float = 0.005,
        loras: dict[str, str] | None = None,
        pushed_from: Any = None,
    ) -> None:
        self.settings = settings if settings is not None else EngineSettings()
        if not isinstance(self.settings, EngineSettings):
            raise TypeError(
                f"settings must be an agl.engine.EngineSettings, got {type(self.settings).__name__}"
            )
        budget = self.settings.prefix_cache_bytes
        #: recent prompts' KV, reused by prompts that start alike (off under ``deterministic``)
        self._prefix = PrefixCache(budget) if budget > 0 else None
        self._lora_stack: Any = None  # mixed batches: see agl.engine.batched_lora
        self._lora_paths = check_lora_dirs(loras) if loras else {}
        self._source = {
            "model": model,
            "tokenizer": tokenizer,
            "chat_template": chat_template,
            "device": device,
        }
        self._max_context_arg = max_context
        self.batch_window_s = batch_window_s
        #: the running batch's size after each admission of new rows (what concurrency actually bought)
        self.batch_sizes: deque[int] = deque(maxlen=256)
        self.weight_version = 0
        self._generator: Any = None
        self._pushed_from: Any = pushed_from
        #: the pushed policy's LoRA merged into this engine's own weights (another dtype than the
        #: policy's: agl.engine.merged_lora); None when the engine runs the adapter through peft
        self._merged: Any = None
        self.model: Any = None
        self.tokenizer: Any = None
        self.model_name = model_name
        self.max_context: int | None = None
        self.eos_ids: list[int] = []
        self.pad_id: int | None = None
        #: the named LoRAs served beside the base model (one per agent)
        self.lora_names: list[str] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agl-transformers")
        self._queue: list[Job] = []  # guarded by _queue_lock: the worker thread takes from it
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
        if model is not None and not isinstance(model, (str, Path)):
            self.load()

    @classmethod
    def for_policy(cls, policy: Any, **kwargs: Any) -> Engine:
        """An engine serving a :class:`~agl.algorithms.update.PolicyUpdate` of this process, sharing its
        frozen weights (see :meth:`push`); ``kwargs`` as for the constructor."""
        source = policy.model
        settings = kwargs.get("settings") or EngineSettings()
        dtype = resolve_dtype(settings.dtype, str(next(source.parameters()).device))
        model, merged = policy_copy(policy, dtype)
        engine = cls(model, pushed_from=source, **kwargs)
        engine._merged = merged
        engine.lora_names = list(getattr(policy, "adapters", {}).values())
        return engine

    # -------------------------------------------------------------------------- loading
    def load(self) -> None:
        """Load the model and tokenizer (once; the worker thread, or the constructor for an object)."""
        if self.model is not None:
            return
        if self.settings.threads:
            import torch

            torch.set_num_threads(self.settings.threads)
        src = self._source
        loaded = load(
            src["model"],
            src["tokenizer"],
            model_name=self.model_name,
            chat_template=src["chat_template"],
            device=src["device"],
            dtype=self.settings.dtype,
            cast=self._pushed_from is None,
            loras=self._lora_paths,
            max_context=self._max_context_arg,
        )
        if self._lora_paths:
            self.lora_names = list(self._lora_paths)
        self.model, self.tokenizer, self.model_name = loaded.model, loaded.tokenizer, loaded.model_name
        self.max_context, self.eos_ids, self.pad_id = loaded.max_context, loaded.eos_ids, loaded.pad_id

    async def start(self) -> None:
        if self.model is None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.load)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            self._worker = None

    @property
    def device(self) -> Any:
        return next(self.model.parameters()).device

    @property
    def serving_dtype(self) -> Any:
        """The dtype the engine computes in (None before the model is loaded)."""
        return None if self.model is None else next(self.model.parameters()).dtype

    def prefix_stats(self) -> dict[str, float]:
        """Prompt tokens admitted and those not run through the model (the prefix cache's hits and
        same-prompt rows of one admission); empty with the cache off."""
        return {} if self._prefix is None else self._prefix.stats()

    # ------------------------------------------------------------------------ scheduling
    def submit(self, job: Job) -> None:
        """Queue ``job`` (the event loop's thread); the worker admits it at its next step."""
        with self._queue_lock:
            self._queue.append(job)
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._lock = self._lock or asyncio.Lock()
            self._worker = asyncio.create_task(self._run_worker())
        assert self._wakeup is not None
        self._wakeup.set()

    def withdraw(self, job: Job) -> None:
        """The client went away: a queued job is dropped, a running one leaves the batch next step."""
        job.cancel.set()
        with self._queue_lock:
            if job in self._queue:
                self._queue.remove(job)

    def generator_for(self, seed: int | None) -> Any:
        """A seeded job gets a fresh generator of its own; the others share the engine's, seeded once
        from the OS. Neither touches the process-wide torch RNG."""
        import torch

        device = self.device
        if seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(int(seed) % (2**63))
            return gen
        if self._generator is None or self._generator.device != torch.device(device):
            self._generator = torch.Generator(device=device)
            self._generator.seed()
        return self._generator

    async def _run_worker(self) -> None:
        assert self._wakeup is not None and self._lock is not None
        loop = asyncio.get_running_loop()
        rows = self.settings.rows
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            waited = 0.0
            while self.batch_window_s > 0 and 0 < len(self._queue) < rows and waited < 0.05:
                # jobs of concurrent clients arrive a few ms apart: let them be prefilled together
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

    def _take(self, room: int) -> list[Job]:
        """Up to ``room`` queued jobs (the cancelled ones are dropped)."""
        with self._queue_lock:
            live = [j for j in self._queue if not (j.cancel.is_set() or j.future.done())]
            taken, self._queue = live[:room], live[room:]
        return taken

    def _serve(self) -> None:
        """The scheduler (worker thread): admit queued jobs into the running batch between decode
        steps until no row runs and none waits, or a weight swap waits."""
        import torch

        threads = self.settings.threads
        if threads and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        batch = Batch(self.model, self.pad_id, per_row_adapters=bool(self.lora_names), prefix=self._prefix)
        batch.version, batch.lora = self.weight_version, self._stacked_loras()
        with torch.inference_mode():
            while True:
                admitting: list[Row] = []
                ended: list[Row] = []
                try:
                    if self._live_swaps:  # between two decode steps: the rows go on with the new weights
                        with torch.inference_mode(False):
                            self._live_swaps.run()
                        batch.version, batch.lora = self.weight_version, self._stacked_loras()
                    ended = batch.cancel_ended()
                    room = self.settings.rows - len(batch)
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
                except Exception as exc:  # noqa: BLE001 - every job in the batch learns of it
                    self._hand_tokens()  # what was drawn before the failure, before the error
                    log.exception("agl gateway: generation failed")
                    error = BackendError(f"generation failed: {type(exc).__name__}: {exc}")
                    for r in admitting + batch.fail():
                        _deliver(r.payload, None, error)
                for r in ended:
                    self._finish(r)

    def _hand_tokens(self) -> None:
        """Hand this step's streamed tokens to their event loops (one wake-up per loop and step)."""
        drawn, self._drawn = self._drawn, []
        if drawn:
            hand_over(drawn)

    def _row(self, job: Job) -> Row:
        tok = self.tokenizer
        job.weight_version = self.weight_version
        on_token = None
        if job.tokens is not None:
            queue, loop = job.tokens, job.loop

            def on_token(token: int, logprob: float) -> None:
                self._drawn.append((loop, queue, (token, logprob)))

        return Row(
            prompt_ids=job.prompt_ids,
            max_new=job.max_new,
            temperature=job.temperature,
            top_p=job.top_p,
            top_k=job.top_k,
            generator=job.generator or self.generator_for(job.seed),
            eos=frozenset(self.eos_ids),
            stops=job.stops,
            closers=job.closers,
            decode=tok.decode,
            cancel=job.cancel,
            processors=self._processors(len(job.prompt_ids)),
            on_token=on_token,
            payload=job,
            adapter=job.adapter if self.lora_names else None,
        )

    def _processors(self, prompt_len: int) -> Any:
        """The logits processors ``generate`` would add from the model's generation config (e.g. a
        repetition penalty), sampling warpers left out (agl applies the job's own); None when there are
        none, which is the common case."""
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
        job: Job = row.payload
        try:
            result = job.build(job, row)
        except Exception as exc:  # noqa: BLE001
            log.exception("agl gateway: building a result failed")
            _deliver(job, None, BackendError(f"generation failed: {type(exc).__name__}: {exc}"))
            return
        _deliver(job, result, None)

    # ----------------------------------------------------------------------- weight swap
    def _bump_version(self, version: int | None) -> int:
        """Every swap ends here, in the worker thread, after the tensors changed: cached prefixes were
        computed by the old weights, and the batched-LoRA stacks (copies) are rebuilt on next use."""
        if self._prefix is not None:
            self._prefix.clear()
        self._lora_stack = None
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        return self.weight_version

    async def _swap(self, fn: Callable[[], int], *, in_place: bool = False) -> int:
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
        """Serve ``model`` (same tokenizer) from the next job on."""

        def swap() -> int:
            model.eval()
            self.model = model
            return self._bump_version(version)

        return await self._swap(swap)

    async def load_weights(self, source: Any, *, version: int | None = None) -> int:
        """New full weights: a state dict, a ``.safetensors`` file or a checkpoint directory."""

        def swap() -> int:
            state = read_weights(source, self.device)
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected:
                raise ValueError(f"the weights do not fit this model: unexpected keys {list(unexpected)[:5]}")
            known = {k for k, _ in self.model.named_parameters()}
            if not (set(state) & known):
                raise ValueError("the weights share no parameter with this model")
            return self._bump_version(version)

        return await self._swap(swap, in_place=self.model is not None)

    async def load_adapter(self, path: str, *, name: str | None = None, version: int | None = None) -> int:
        """A LoRA adapter (peft) replacing the previous one (an agent LoRA's ``name``: its new weights)."""
        if name is not None and name in self.lora_names:
            return await self.load_agent_loras({name: path}, version=version)

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

    async def push(self, policy: Any, *, version: int | None = None) -> int:
        """Serve ``policy`` (a :class:`~agl.algorithms.update.PolicyUpdate` in this process) from the next
        job on, without a second copy of its frozen weights.

        The first push builds the engine's model from the policy's: a copy of the module tree whose
        frozen tensors (the base weights under LoRA) *are* the policy's tensors, shared, and whose
        trainable tensors (the LoRA A/B matrices, a few MB) are its own. Every later push copies the
        trainable tensors in place, between two decode steps — nothing else is allocated or cloned.
        The engine keeps its own trainable copy so an update running while a late job still generates
        never changes the weights under it. Under full fine-tuning every tensor is trainable, so the
        engine holds one full copy (made once) and each push copies all weights in place.
        """
        source = policy.model

        def swap() -> int:
            import torch

            if self._pushed_from is not source:
                dtype = resolve_dtype(self.settings.dtype, str(self.device))
                self.model, self._merged = policy_copy(policy, dtype)
                self._pushed_from = source
                self.lora_names = list(getattr(policy, "adapters", {}).values())
            elif self._merged is not None:  # the adapter merged into the engine's own weights
                self._merged.refresh()
            else:
                with torch.no_grad():
                    pairs = zip(trainable(self.model, source), trainable(source, source), strict=True)
                    for (name, dst), (_, src) in pairs:
                        if dst.shape != src.shape:
                            raise BackendError(f"pushed tensor {name} changed shape")
                        dst.copy_(src.detach())
            return self._bump_version(version)

        return await self._swap(swap, in_place=self.model is not None and self._pushed_from is source)


def _deliver(job: Job, result: Any, error: BaseException | None) -> None:
    """Hand a job its result (or error) on its event loop; a streamed job's token queue ends after."""

    def settle() -> None:
        if not job.future.done():
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)
        if job.tokens is not None:
            job.tokens.put_nowait(None)

    try:
        job.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass
