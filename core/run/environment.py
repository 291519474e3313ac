"""``Environment(serving)``: the running pieces of a run, started and stopped in one place.

- the store (a URL, a Store, or SQLite at ``run_dir/store.db``);
- the backend (through :func:`agl.gateway.backends.from_spec`), served by an in-process gateway in a
  thread (:class:`~agl.gateway.serve.ServedGateway`), or a gateway started elsewhere
  (``gateway_url``); the URL published to the agents (advertised name, ``/v1`` normalised once);
- the in-process runners (a ``Runner``'s asyncio workers in a daemon thread);
- weight pushes: in process through the serving loop (``Backend.push``), or to an external gateway
  as saved files announced on its ``/agl/v1`` API; old weight files pruned;
- :meth:`close`, which stops them all.

It never calls back into its user: the trainer builds the policy and the tokenizer and hands them to
:meth:`Environment.start`, so ``agl.run`` sits below ``agl.trainer.trainer`` and every algorithm can use it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.gateway.serve import ServedGateway, root_url, v1_url
from agl.run.served import prove_push
from agl.run.settings import Serving
from agl.types import LLM

if TYPE_CHECKING:
    from agl.store.base import Store

__all__ = ["Environment", "open_store"]

log = logging.getLogger("agl.run")

#: the in-process gateway may load a model in its lifespan (minutes on a first prepare)
GATEWAY_STARTUP_S = 600.0


def open_store(spec: Any, default_path: Path) -> Store:
    """A store from a URL, a store object, or (None) SQLite at ``default_path``."""
    import agl.store

    if spec is None:
        default_path.parent.mkdir(parents=True, exist_ok=True)
        return agl.store.open(f"sqlite:///{default_path.resolve()}")
    return agl.store.open(spec) if isinstance(spec, str) else spec


class RunnerThread:
    """In-process runners: a ``Runner``'s asyncio workers on their own loop in a daemon thread."""

    def __init__(self, runner: Any, name: str = "agl-runners") -> None:
        self.runner = runner
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            asyncio.run(self.runner.run_async())
        except Exception:  # noqa: BLE001
            log.exception("agl: the in-process runner crashed")

    def close(self) -> None:
        self.runner.stop(now=True)
        self._thread.join(timeout=30)


class Environment:
    """The store, gateway and runners of one run described by ``serving``.

    ``store`` (after :meth:`open_store`), ``url`` (the ``/v1`` URL published to the agents),
    ``model_name`` (the served model's name) and ``gateway`` (the in-process one, or None) are set by
    :meth:`start`.
    """

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.store: Store | None = None
        self.gateway: ServedGateway | None = None
        self.url: str | None = None
        self.model_name: str | None = None
        self._runner: RunnerThread | None = None
        #: the vLLM server this run started (``serving.vllm_python``), stopped by :meth:`close`
        self.vllm_server: Any = None
        #: the Tinker service of a ``tinker`` run (:meth:`tinker_service`) and the server agl started
        #: for it (``serving.tinker_python``), stopped by :meth:`close`
        self.tinker: Any = None

    # ------------------------------------------------------------------------------ start
    def open_store(self) -> Store:
        """Open (once) the run's store."""
        if self.store is None:
            self.store = open_store(self.serving.store, self.serving.run_dir / "store.db")
        return self.store

    def model_source(self) -> Any:
        """The model to train or serve: ``serving.model``, or the default model (prepared on first use)."""
        if self.serving.model is not None:
            return self.serving.model
        from agl.chat.models import prepare_default_model

        return str(prepare_default_model(progress=self.serving.progress))

    def served_name(self, source: Any) -> str | None:
        """The model's name for the agents: ``model_name``, else a path's last part."""
        if self.serving.model_name:
            return self.serving.model_name
        return Path(str(source)).name if isinstance(source, (str, os.PathLike)) else None

    def start(
        self,
        agent: Any = None,
        *,
        policy: Any = None,
        tokenizer: Any = None,
        source: Any = None,
        base_url: str | None = None,
        defaults: dict[str, Any] | None = None,
        worker_id: str = "agl-trainer",
        sampling: Any = None,
    ) -> None:
        """Open the store, serve the backend (``policy``: the engine shares the trainer's policy;
        ``source``: the model to load otherwise; ``base_url``: serve that OpenAI-compatible endpoint
        instead; ``defaults``: the embedded engine's ``default_temperature``/``default_top_p``, its
        settings being ``serving.engine``; ``sampling``: the in-process gateway's
        :class:`~agl.gateway.sampling.SamplingLimits`) and start the runners for ``agent`` (none when
        ``serving.runners`` is 0 or ``agent`` is None)."""
        self.open_store()
        s = self.serving
        if s.gateway_url is None or base_url is not None:
            backend = self.make_backend(
                policy=policy, tokenizer=tokenizer, source=source, base_url=base_url, defaults=defaults
            )
            host, port = s.bind
            self.gateway = ServedGateway.for_backend(
                backend,
                self.store,
                api_key=s.gateway_api_key,
                app_options={"sampling": sampling} if sampling is not None else None,
                host=host,
                port=port,
                startup_timeout_s=GATEWAY_STARTUP_S,
            )
            self.url = self._advertised(self.gateway.url, host)
            models = backend.models()
        else:
            self.url = v1_url(s.gateway_url)
            models = [s.model_name] if s.model_name else []
        self.model_name = s.model_name or (models[0] if models else "model")
        if s.runners > 0 and agent is not None:
            self.start_runners(agent, worker_id=worker_id)

    def make_backend(
        self,
        *,
        policy: Any = None,
        tokenizer: Any = None,
        source: Any = None,
        base_url: str | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> Any:
        """The backend ``serving`` names, through the one factory (``gateway.backends.from_spec``); the
        embedded engine gets ``serving.engine`` whole (``defaults``: its sampling defaults)."""
        from agl.gateway.backends import from_spec

        s = self.serving
        if not isinstance(s.backend, str):
            return s.backend
        if base_url is not None or s.backend == "openai":
            models = [s.model_name] if s.model_name else []
            return from_spec("openai", url=base_url or s.base_url, api_key=s.api_key, models=models)
        if s.backend == "scripted":
            return from_spec("scripted", script=s.script, accept_any_model=True, on_exhausted="repeat")
        if s.backend == "vllm":
            return self._vllm_backend(policy, source, tokenizer)
        if s.backend == "tinker":
            return self._tinker_backend(policy, source, tokenizer)
        options = dict(defaults or {}, model_name=self.served_name(source), settings=s.engine)
        if policy is not None:
            # the engine serves the policy itself: frozen base weights shared, LoRA tensors pushed
            return from_spec("transformers", policy=policy, tokenizer=tokenizer, **options)
        if source is None:
            source = self.model_source()
            options["model_name"] = self.served_name(source)
        if isinstance(source, (str, os.PathLike)):
            return from_spec("transformers", model=str(source), **options)
        return from_spec("transformers", model=copy.deepcopy(source), tokenizer=tokenizer, **options)

    def _vllm_backend(self, policy: Any, source: Any, tokenizer: Any) -> Any:
        """The vllm backend: at ``vllm_url``, or at a server started here (``vllm_python``) on the run's
        model with the policy's LoRA rank and adapters (:mod:`agl.engine.vllm_server`).
        agl renders the chats with the run's tokenizer (the trainer's, else the model folder's): one
        rendering on every engine."""
        from agl.chat.tokenizer import as_chat_tokenizer
        from agl.gateway.backends import from_spec

        s = self.serving
        adapters = list(getattr(policy, "adapters", {}).values()) or None  # an adapter per agent
        folder = str(source) if isinstance(source, (str, os.PathLike)) else None
        if s.vllm_python and self.vllm_server is None:
            from agl.engine.vllm_server import VLLMServer

            model = folder or str(self.model_source())
            self.vllm_server = VLLMServer(
                model,
                python=s.vllm_python,
                served_name=self.served_name(model),
                port=s.vllm_port,
                lora_rank=int(getattr(getattr(policy, "config", None), "lora_r", 16) or 16),
                adapters=len(adapters or ()) or 1,
                extra_args=s.vllm_args or (),
                log_path=s.run_dir / "vllm.log",
            )
            log.info("agl: starting vLLM (%s); its log: %s", model, s.run_dir / "vllm.log")
            self.vllm_server.start()
            folder = model
        url = self.vllm_server.url if self.vllm_server is not None else s.vllm_url
        name = s.model_name or (self.vllm_server.served_name if self.vllm_server is not None else None)
        chat = as_chat_tokenizer(tokenizer) if tokenizer is not None else None
        render_with = chat if hasattr(chat, "encode_chat") else folder
        return from_spec(
            "vllm", url=url, model=name, adapters=adapters, server=self.vllm_server, tokenizer=render_with
        )

    def tinker_service(
        self, source: Any = None, *, adapters: list[str] | None = None, lora_rank: int = 16, seed: int = 0
    ) -> Any:
        """The run's :class:`~agl.tinker.service.TinkerService` (made once): at ``tinker_url``, or at
        SkyRL's server started here (``tinker_python``) on the run's model folder ``source``, with
        ``adapters`` LoRA training clients (one per agent, else one) of rank ``lora_rank``."""
        if self.tinker is not None:
            return self.tinker
        from agl.tinker.service import POLICY, TinkerService

        s = self.serving
        names = list(adapters or []) or [POLICY]
        server, url, base = None, s.tinker_url, s.base_model
        state = s.run_dir / "tinker"
        if s.tinker_python:
            from agl.tinker.server import SkyRLServer

            folder = str(source) if isinstance(source, (str, os.PathLike)) else str(self.model_source())
            server = SkyRLServer(
                folder, python=s.tinker_python, state_dir=state, lora_rank=lora_rank, adapters=len(names)
            )
            log.info("agl: starting SkyRL's Tinker server (%s); its log: %s", folder, server.log_path)
            server.start()
            url, base = server.url, base or server.base_model
        self.tinker = TinkerService(
            url or "",
            base_model=base or "",
            lora_rank=lora_rank,
            adapters=names,
            api_key=os.environ.get(s.tinker_api_key_env) or None,
            seed=seed,
            server=server,
            timeout_s=s.tinker_timeout_s,
            sample_timeout_s=s.tinker_timeout_s,
            state_file=state / "versions.json",
        )
        return self.tinker

    def _tinker_backend(self, policy: Any, source: Any, tokenizer: Any) -> Any:
        """The tinker backend: sampling through the run's Tinker service (the policy's, when training),
        rendered with the run's tokenizer (the trainer's, else the model folder's)."""
        from agl.chat.tokenizer import as_chat_tokenizer
        from agl.gateway.backends import from_spec

        service = getattr(policy, "service", None) or self.tinker_service(source)
        adapters = list(getattr(policy, "adapters", {}).values()) or None
        chat = as_chat_tokenizer(tokenizer) if tokenizer is not None else None
        render_with = chat if hasattr(chat, "encode_chat") else str(source or self.model_source())
        return from_spec(
            "tinker",
            service=service,
            tokenizer=render_with,
            model_name=self.served_name(source) or self.served_name(service.base_model),
            adapters=adapters,
        )

    def _advertised(self, bound_url: str, host: str) -> str:
        """The URL published to the runners: ``gateway_advertise``, this host's name for a wildcard
        bind, else the bound address."""
        if self.serving.gateway_advertise:
            return v1_url(self.serving.gateway_advertise)
        if host in ("0.0.0.0", "::"):
            return bound_url.replace(f"//{host}:", f"//{socket.getfqdn()}:", 1)
        return bound_url

    def start_runners(self, agent: Any, *, worker_id: str = "agl-trainer") -> None:
        """``serving.runners`` in-process runners of ``agent`` against the store."""
        from agl.runner.runner import Runner

        runner = Runner(
            agent,
            self.open_store(),
            concurrency=self.serving.runners,
            claim_timeout_s=1.0,
            worker_id=worker_id,
        )
        self._runner = RunnerThread(runner, name=f"{worker_id}-runners")

    # ------------------------------------------------------------------------------ use
    def publish(self, sampling: dict[str, Any]) -> int:
        """Publish the ``LLM`` resource (gateway URL, model, ``sampling``, key); returns its version."""
        assert self.store is not None, "start() the environment first"
        llm = LLM(
            base_url=self.url or "",
            model=self.model_name or "model",
            sampling=sampling,
            api_key=self.serving.gateway_api_key,
        )
        return self.store.add_resources({"main": llm}).version

    def push_weights(self, policy: Any, version: int) -> float:
        """Push ``policy``'s weights to the inference engine as ``version`` (``Backend.push``: shared
        tensors in process, a LoRA adapter or full weights as files elsewhere); returns seconds taken."""
        t0 = time.perf_counter()
        if policy is None:
            return 0.0
        run_dir = self.serving.run_dir
        staging = run_dir / ("adapters" if policy.is_lora else "weights")
        if self.gateway is not None:
            backend = self.gateway.backend
            if not backend.can_push:  # scripted replies: there is nothing to serve new weights with
                return 0.0
            self.gateway.call(lambda: backend.push(policy, version=version, staging_dir=staging))
            prove_push(backend.weight_version, version, "the in-process gateway")
        else:
            self._push_remote(policy, version, staging)
        # Old weight files are dead weight (a full model each); vLLM keeps the last adapters loaded.
        prune(run_dir / "weights", keep=1)
        prune(run_dir / "adapters", keep=3)
        return time.perf_counter() - t0

    def _push_remote(self, policy: Any, version: int, staging: Path) -> None:
        """An external gateway (``agl gateway serve``): save the adapter (or, under full fine-tuning,
        the weights) where it can read them and tell it through its ``/agl/v1`` API. With an adapter per
        agent, every adapter's folder goes in one request, so the gateway swaps them as one version."""
        import httpx

        target = staging / f"v{version}"
        body: dict[str, Any]
        if policy.is_lora:
            path, route = Path(policy.save_adapter(target)).resolve(), "/agl/v1/adapters"
            body = {"path": str(path)}
            if getattr(policy, "adapters", None):  # an adapter per agent: each in its folder, one version
                body = {"adapters": {n: str(path / n) for n in policy.adapters.values()}}
        else:
            path, route = policy.save_weights(target), "/agl/v1/weights"
            body = {"path": str(Path(path).resolve())}
        key = self.serving.gateway_api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        resp = httpx.post(
            root_url(self.url or "") + route,
            json={**body, "version": version},
            headers=headers,
            timeout=600,
        )
        if resp.status_code >= 400:
            raise RuntimeError(f"the gateway refused the new weights: {resp.text[:300]}")
        prove_push(resp.json().get("weight_version"), version, f"the gateway's reply to {route}")
        status = httpx.get(root_url(self.url or "") + "/agl/v1/status", headers=headers, timeout=60)
        reported = status.json().get("weight_version") if status.status_code < 400 else status.text[:200]
        prove_push(reported, version, "the gateway's /agl/v1/status")

    def engine_restarts(self) -> int:
        """How many times the engine was restarted after dying (a managed vLLM server)."""
        backend = self.gateway.backend if self.gateway is not None else None
        return int(getattr(backend, "restarts", 0) or 0)

    def engine_busy_s(self) -> float | None:
        """Seconds the in-process engine has spent generating so far (None: no such engine here)."""
        backend = self.gateway.backend if self.gateway is not None else None
        seconds = getattr(getattr(backend, "busy", None), "seconds", None)  # a BusyClock
        return float(seconds) if isinstance(seconds, (int, float)) else None

    def engine_differs(self, policy: Any) -> str | None:
        """Which engine computes this run's log-probs with other numerics than ``policy``'s model (so
        the update trains by decoupled PPO against its own log-probs), or None: ``"vllm"`` (another
        engine: other kernels, often another dtype), ``"transformers (other dtype)"`` for the
        in-process engine serving in another dtype (``EngineSettings.dtype``, e.g. bf16 on a CPU with
        native bf16), None for the in-process engine in the policy's dtype."""
        if self.serving.backend == "vllm":
            return "vllm"
        if self.serving.backend == "tinker":  # one service samples and trains: its ppo ratio is its own
            return None
        from agl.engine.dtype import serves_other_dtype

        backend = self.gateway.backend if self.gateway is not None else None
        return "transformers (other dtype)" if serves_other_dtype(backend, policy) else None

    @property
    def serves_pushed_weights(self) -> bool:
        """Whether a weight push reaches an engine (False for a scripted or hosted backend, whose weight
        version never follows the trainer's)."""
        if self.gateway is None:
            return self.url is not None
        return bool(self.gateway.backend.can_push)

    # ------------------------------------------------------------------------------ stop
    def stop_runners(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None

    def close(self) -> None:
        """Stop the runners, flush the spans, stop the gateway (the store stays open for reading)."""
        self.stop_runners()
        try:
            from agl.tracing.provider import flush

            flush(10.0)
        except Exception:  # noqa: BLE001 - a flush failure must not keep the gateway running
            log.debug("agl: flushing spans on close failed", exc_info=True)
        if self.gateway is not None:
            self.gateway.close()
            self.gateway = None
        if self.vllm_server is not None:
            self.vllm_server.stop()
            self.vllm_server = None
        if self.tinker is not None:
            server = self.tinker.server
            self.tinker.close()
            self.tinker = None
            if server is not None:
                server.stop()


def prune(folder: Path, keep: int) -> None:
    """Remove all but the ``keep`` newest ``v<N>`` directories in ``folder``."""
    if not folder.is_dir():
        return
    versions = sorted((int(p.name[1:]), p) for p in folder.iterdir() if p.is_dir() and p.name[1:].isdigit())
    for _, path in versions[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
