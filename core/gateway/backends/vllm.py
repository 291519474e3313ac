"""Proxy to a vLLM OpenAI-compatible server, with the engine's exact token ids and logprobs.

One rendering on every engine (``render="auto"``, the default, when the served model's tokenizer folder
is readable here: ``tokenizer=``, else the ``root`` that ``/v1/models`` names): chats are rendered by
agl exactly as the embedded engine renders them (the template, tools lowered where it ignores them,
the opening a ``tool_choice`` forces) and sent as prompt token ids to ``POST /v1/completions``; the
reply is decoded from vLLM's token ids and parsed for tool calls by agl (:mod:`._rendered`), and a
completion's prompt is tokenised by agl too. vLLM's chat template and tool parser are then unused.
``render="upstream"`` (or no readable tokenizer under ``"auto"``, with one warning) forwards chats to
vLLM's chat route as below; ``render="agl"`` refuses to start without a tokenizer.

A managed server (``server=``, :class:`~agl.engine.vllm_server.VLLMServer`) that dies is
restarted by the next call (or by the call that saw it die, which fails as retriable), and the
adapters that served the current weight version are loaded again under their names.

On the upstream route, every forwarded request gets ``return_token_ids: true`` (vLLM >= 0.10.2: the chat response carries
``prompt_token_ids`` at top level and ``token_ids`` per choice; a completion choice carries both)
and ``logprobs: true`` with ``top_logprobs: 0`` (chat: ``choices[i].logprobs.content[j].logprob``;
completions: ``logprobs: 1`` → ``choices[i].logprobs.token_logprobs``). An upstream that returns no
ids (an older vLLM) still serves, and its spans say ``agl.llm.exact = False``.

Tool calls are parsed by vLLM itself (start it with ``--enable-auto-tool-choice --tool-call-parser
hermes`` or the parser of your model).

Weight swaps (LoRA adapters loaded at run time, an adapter per agent): :mod:`agl.engine.vllm_loras`.

Pause around a weight push (``pause_on_push``): :mod:`agl.engine.vllm_pause` (vLLM's ``POST
/pause?mode=keep`` and ``/resume``, asked for once; a push never leaves vLLM paused).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from agl.engine.vllm_loras import VLLMLoras
from agl.engine.vllm_pause import PushPause
from agl.errors import UsageError
from agl.gateway.backends import _rendered
from agl.gateway.backends._http import HttpUpstreamBackend
from agl.gateway.backends.base import (
    BackendError,
    GenerationRequest,
    GenerationResult,
    UnknownModelError,
    UpstreamError,
    whole_stream,
)
from agl.lora import is_lora_name
from agl.semconv import BASE_ADAPTER

__all__ = ["VLLMBackend"]

log = logging.getLogger("agl.gateway")

#: who renders a chat into prompt ids (see :class:`VLLMBackend`)
RENDERS = ("auto", "agl", "upstream")


class VLLMBackend(VLLMLoras, HttpUpstreamBackend):
    """``VLLMBackend("http://gpu-host:8000", model="Qwen/Qwen2.5-1.5B-Instruct")``."""

    name = "vllm"
    exact = True
    #: vLLM's HTTP server closes connections idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
    keepalive_s = 4.0

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        keep_adapters: int = 2,
        adapters: Sequence[str] | dict[str, str] | None = None,
        pause_on_push: bool | None = None,
        tokenizer: Any = None,
        render: str = "auto",
        server: Any = None,
    ) -> None:
        if render not in RENDERS:
            raise UsageError(f"render is one of {', '.join(RENDERS)}, not {render!r}")
        if pause_on_push is not None and not isinstance(pause_on_push, bool):
            raise UsageError(
                f"pause_on_push is True, False or None (when vLLM offers it), not {pause_on_push!r}"
            )
        super().__init__(base_url, api_key=api_key, timeout_s=timeout_s)
        #: pauses vLLM around a weight push: always (True), never (False), where it has mode=keep (None)
        self.push_pause = PushPause(self.root_url, self.request, pause_on_push)
        self.policy_name = model
        self.upstream_models: list[str] = []
        self.adapters: list[str] = []  # loaded LoRA names, oldest first
        self.current_upstream: str | None = model
        self.keep_adapters = max(1, keep_adapters)
        self._start_error: str | None = "not started"
        #: an adapter per agent: ``{adapter: upstream LoRA name serving it}`` (None: the base model, until
        #: its first load); the loaded names of each, oldest first; the digest of each one's last file
        self.lora_served: dict[str, str | None] = {name: None for name in adapters or ()}
        self._lora_loaded: dict[str, list[str]] = {name: [] for name in self.lora_served}
        self._agent_digest: dict[str, tuple[str, int]] = {}
        #: ``{adapter: folder}`` given up front (``agl gateway serve --adapter``): loaded once vLLM answers
        self._initial = dict(adapters) if isinstance(adapters, dict) else {}
        for name in self.lora_served:
            if not is_lora_name(name):
                raise UsageError(f"adapter name {name!r} is not one an agent's adapter has")
        #: who renders chats: "agl" (this gateway, as the embedded engine: prompt ids sent), "upstream"
        #: (vLLM's own template and tool parser), "auto" (agl when a tokenizer is found)
        self.render = render
        self._tokenizer_source = tokenizer
        self.tokenizer: Any = None  # the ChatTokenizer agl renders with (None: vLLM renders)
        self._eos: set[int] = set()
        self.max_model_len: int | None = None
        #: a managed server (:class:`~agl.engine.vllm_server.VLLMServer`): restarted when it dies
        self.server = server
        self.restarts = 0
        self._recovering: asyncio.Task[None] | None = None
        self._lora_paths: dict[str, str] = {}  # loaded LoRA name -> its folder (reloaded after a restart)

    async def start(self) -> None:
        """List the upstream's models and find the tokenizer agl renders with; an upstream that is not
        up yet is retried on the first request."""
        entries: list[dict[str, Any]] = []
        try:
            entries = await self._model_entries()
            self.upstream_models = [m["id"] for m in entries]
            self._start_error = None
            if not self.upstream_models:
                self._start_error = f"{self.base_url}/models answers but lists no models"
        except BackendError as exc:
            self._start_error = str(exc)
            if self.policy_name is None:
                log.warning("agl gateway: %s (retried on the first request)", exc)
                return
            log.warning("agl gateway: %s; serving %s until it answers", exc, self.policy_name)
            self.upstream_models = [self.policy_name]
        if self.policy_name is None:
            if not self.upstream_models:
                log.warning("agl gateway: vLLM at %s: %s", self.base_url, self._start_error)
                return
            self.policy_name = self.upstream_models[0]
        if self.current_upstream is None:
            self.current_upstream = self.policy_name
        if self._start_error is None:
            self._setup_rendering(entries)
        if self._initial and self._start_error is None:
            await self.load_agent_loras(self._initial, version=self.weight_version)
            self._initial = {}

    async def _model_entries(self) -> list[dict[str, Any]]:
        """``/v1/models`` entries (``id``, ``root``: the served folder, ``max_model_len``)."""
        url = self.base_url + "/models"
        status, raw = await self.request("GET", url)
        try:
            items = json.loads(raw).get("data") if status < 400 else None
        except (ValueError, AttributeError):
            items = None
        if not isinstance(items, list):
            raise BackendError(f"{url} answered {status} without a model list: {raw[:200]!r}")
        return [m for m in items if isinstance(m, dict) and isinstance(m.get("id"), str)]

    def _setup_rendering(self, entries: list[dict[str, Any]]) -> None:
        """Find the tokenizer agl renders with: the one given, else the served model's folder when
        this machine can read it. ``render="agl"`` without one is a UsageError; ``"auto"`` falls back
        to vLLM's rendering with one warning (tools may then reach the model differently)."""
        base = next((m for m in entries if m["id"] == self.policy_name), entries[0] if entries else {})
        if isinstance(base.get("max_model_len"), int):
            self.max_model_len = base["max_model_len"]
        if self.render == "upstream" or self.tokenizer is not None:
            return
        from agl.chat.tokenizer import ChatTokenizer

        source = self._tokenizer_source
        if (
            source is None
            and isinstance(base.get("root"), str)
            and Path(base["root"], "tokenizer.json").is_file()
        ):
            source = base["root"]
        if source is not None and not hasattr(source, "encode_chat"):
            try:
                source = ChatTokenizer.from_dir(source)
            except (OSError, ValueError) as exc:
                if self.render == "agl":
                    raise UsageError(f"render='agl': cannot read the tokenizer {source!r}: {exc}") from exc
                log.warning("agl gateway: cannot read the tokenizer %r (%s)", source, exc)
                source = None
        if source is None:
            if self.render == "agl":
                raise UsageError(
                    f"render='agl' needs the served model's tokenizer: vLLM at {self.base_url} serves "
                    f"{base.get('root')!r}, which this machine cannot read; pass tokenizer= (a folder)"
                )
            log.warning(
                "agl gateway: vLLM at %s serves %r, whose tokenizer this machine cannot read: vLLM renders "
                "the chats itself (its template and tool parser, not agl's); pass tokenizer= to render here",
                self.base_url,
                base.get("root"),
            )
            return
        self.tokenizer = source
        self._eos = {source.eos_token_id}

    def max_prompt_chars(self) -> int | None:
        if self.tokenizer is None or self.max_model_len is None:
            return None
        return self.tokenizer.max_prompt_chars(self.max_model_len)

    async def _ensure_started(self) -> None:
        if not self.upstream_models:
            await self.start()
            if not self.upstream_models:
                raise BackendError(f"vLLM at {self.base_url}: {self._start_error}")

    def models(self) -> list[str]:
        """The policy's name and the upstream's models, then ``"<policy>:<adapter>"`` for each agent's."""
        names = [self.policy_name] if self.policy_name else []
        names += [m for m in self.upstream_models if m not in names]
        return names + [f"{self.policy_name}:{a}" for a in self.lora_served if self.policy_name]

    def agent_loras(self) -> list[str]:
        return list(self.lora_served)

    def check_model(self, model: str) -> None:
        if not self.upstream_models:  # not listed yet: the call retries and says what the upstream answered
            return
        if model not in self.models():
            raise UnknownModelError(model, self.models())

    def _route(self, request: GenerationRequest) -> str:
        """The upstream model that serves ``request``: its agent's adapter (the base model until that
        is loaded), the base for another call under per-agent adapters, else the newest policy adapter."""
        model = request.model
        if self.lora_served:
            if request.adapter is not None:
                return self.lora_served.get(request.adapter) or self.policy_name or model
            base, sep, _ = model.rpartition(":")
            return (self.policy_name or model) if sep and base == self.policy_name else model
        return (self.current_upstream or model) if model == self.policy_name else model

    def _served_by(self, request: GenerationRequest) -> str | None:
        """The adapter recorded on the call's span (``agl.llm.adapter``): None without agent adapters."""
        return (request.adapter or BASE_ADAPTER) if self.lora_served else None

    def chat_body(self, request: GenerationRequest, model: str) -> dict[str, Any]:
        body = super().chat_body(request, model)
        body["return_token_ids"] = True
        body["logprobs"] = True
        body.setdefault("top_logprobs", 0)
        return body

    def completion_body(self, request: GenerationRequest, model: str) -> dict[str, Any]:
        body = super().completion_body(request, model)
        body["return_token_ids"] = True
        if not body.get("logprobs"):
            body["logprobs"] = 1
        return body

    streams = True

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        await self._ensure_started()
        await self._wait_recovered()
        version = self.weight_version
        upstream = self._route(request)
        async with self._crash_watch():
            if self.tokenizer is not None:
                result = await self._generate_rendered(request, upstream)
            else:
                result = await self.forward(request, upstream)
        result.weight_version = version
        result.adapter = self._served_by(request)
        if not result.exact:
            log.warning("agl gateway: vLLM at %s returned no token ids (needs vLLM >= 0.10.2)", self.base_url)
        return result

    async def stream(self, request: GenerationRequest) -> AsyncIterator[dict[str, Any]]:
        """Chat streamed from vLLM, token ids and logprobs collected from its chunks."""
        await self._ensure_started()
        await self._wait_recovered()
        version = self.weight_version
        upstream = self._route(request)
        events = (
            self._stream_rendered(request, upstream)
            if self.tokenizer
            else self.stream_chat(request, upstream)
        )
        async for event in self._watched(events):
            if event["type"] == "end":
                event["result"].weight_version = version
                event["result"].adapter = self._served_by(request)
                if not event["result"].exact:
                    log.warning("agl gateway: vLLM at %s streamed no token ids", self.base_url)
            yield event

    # ------------------------------------------------------------------ rendered by agl (one rendering)
    async def _generate_rendered(self, request: GenerationRequest, upstream: str) -> GenerationResult:
        """The call rendered and tokenised here (as the embedded engine does), sent as prompt ids."""
        if request.api == "completions" and not isinstance(request.prompt, str):
            return await self.forward(request, upstream)
        rendered = await _rendered.render(self.tokenizer, request, self.max_model_len)
        if request.api == "completions":  # the client's own completion body, its prompt as agl's ids
            body = self.completion_body(request, upstream)
            body["prompt"] = rendered.ids
            data = await self._post(self.base_url + "/completions", body)
            choices = [self.parse_completion_choice(c) for c in data["choices"]]
            for raw in data["choices"]:
                _rendered.check_prompt(raw.get("prompt_token_ids"), rendered)
            return GenerationResult(
                model=request.model,
                choices=choices,
                prompt_ids=list(rendered.ids),
                prompt_tokens=len(rendered.ids),
                exact=all(c.response_ids is not None for c in choices),
                raw=data,
            )
        body = _rendered.completion_body(request, rendered, upstream)
        data = await self._post(self.base_url + "/completions", body)
        return _rendered.rendered_result(self.tokenizer, request, rendered, data, self._eos)

    async def _stream_rendered(
        self, request: GenerationRequest, upstream: str
    ) -> AsyncIterator[dict[str, Any]]:
        """A chat streamed from vLLM's completions route, rendered and decoded here."""
        if request.n != 1 or request.messages is None:  # several choices, or a completion: sent whole
            result = await self._generate_rendered(request, upstream)
            async for event in whole_stream(result):
                yield event
            return
        rendered = await _rendered.render(self.tokenizer, request, self.max_model_len)
        body = _rendered.completion_body(request, rendered, upstream)
        body["stream"] = True
        stream = _rendered.RenderedStream(self.tokenizer, request, rendered, self._eos)
        yield {"type": "start", "prompt_ids": list(rendered.ids)}
        async for chunk in self.sse(self.base_url + "/completions", body):
            for raw in chunk.get("choices") or ():
                event = stream.chunk(raw)
                if event is not None:
                    yield event
        for event in stream.end():
            yield event

    # --------------------------------------------------------------------- a crashed managed server
    async def _wait_recovered(self) -> None:
        """Wait out a restart in progress; start one when the managed server is found dead."""
        if self.server is not None and not self.server.alive():
            await self.recover()
        elif self._recovering is not None and not self._recovering.done():
            await asyncio.shield(self._recovering)

    @asynccontextmanager
    async def _crash_watch(self) -> AsyncIterator[None]:
        """A call that fails because the managed server died restarts it (in the background) and fails
        as retriable (502): the caller retries, or the store retries its attempt."""
        try:
            yield
        except BackendError as exc:
            if await self._server_died(exc):
                self._start_recovery()
                raise BackendError(
                    f"the vLLM server died during the call and is being restarted: retry ({exc})"
                ) from exc
            raise

    async def _watched(self, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        async with self._crash_watch():
            async for event in events:
                yield event

    async def _server_died(self, exc: BaseException) -> bool:
        """Whether ``exc`` came from a managed server that is gone (its launcher notices within a
        second, so a failed call waits up to two for it)."""
        if self.server is None or isinstance(exc, UpstreamError):
            return False
        for _ in range(20):
            if not self.server.alive():
                return True
            await asyncio.sleep(0.1)
        return False

    def _start_recovery(self) -> asyncio.Task[None]:
        if self._recovering is None or self._recovering.done():
            self._recovering = asyncio.create_task(self._restart())
        return self._recovering

    async def recover(self) -> None:
        """Restart the managed server and load the adapters it served again (one restart at a time;
        every caller waits for the same one)."""
        await asyncio.shield(self._start_recovery())

    async def _restart(self) -> None:
        assert self.server is not None
        log.warning("agl gateway: the vLLM server at %s died; restarting it", self.base_url)
        try:
            await asyncio.to_thread(self.server.restart)
        except Exception as exc:  # the calls waiting fail as backend errors; the next call tries again
            raise BackendError(f"the vLLM server died and could not be restarted: {exc}") from exc
        self.restarts += 1
        await self.close()  # connections to the dead server go
        self.upstream_models = [m["id"] for m in await self._model_entries()]
        await self._reload_adapters()
        log.warning(
            "agl gateway: vLLM restarted (%d restart(s)); serving weight version %d",
            self.restarts,
            self.weight_version,
        )

    async def load_weights(self, source: Any, *, version: int | None = None) -> int:
        raise BackendError(
            "the vllm backend takes new weights as LoRA adapters (load_adapter); for full weights restart "
            "vLLM on the new checkpoint"
        )
