"""The running pieces of an APO run: the agent's store, gateway and runners, and the optimiser's own
gateway and store.

Both models sit behind an agl gateway, so every call is a recorded span: the agent's in the agent's
store (``run_dir/store.db`` by default), the optimiser's in a store of its own
(``run_dir/optimizer.db``). The optimiser's store must differ from the agent's, or the agent's
runners would claim the optimiser's rollouts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.algorithms.apo.settings import RunSettings

if TYPE_CHECKING:
    from agl.algorithms.apo.algorithm import APO
    from agl.store.base import Store

__all__ = ["Environment", "open_store"]

log = logging.getLogger("agl.apo")


def open_store(spec: Any, default_path: Path) -> Store:
    """A store from a URL, a store object, or (None) SQLite at ``default_path``."""
    import agl.store

    if spec is None:
        default_path.parent.mkdir(parents=True, exist_ok=True)
        return agl.store.open(f"sqlite:///{default_path.resolve()}")
    return agl.store.open(spec) if isinstance(spec, str) else spec


def agent_backend(s: RunSettings) -> Any:
    """The gateway backend serving the agent's model, from the run's settings."""
    backend = s.backend
    if not isinstance(backend, str):
        return backend
    from agl import gateway

    if backend == "scripted":
        if s.script is None:
            raise ValueError("backend='scripted' needs script= (replies, see agl.gateway.ScriptedBackend)")
        return gateway.ScriptedBackend(s.script, accept_any_model=True, on_exhausted="repeat")
    if backend == "openai":
        if not s.base_url or not s.model_name:
            raise ValueError(
                "the openai backend needs base_url (an OpenAI-compatible endpoint) and the model's "
                "name (Trainer model_name=, agl apo --model)"
            )
        return gateway.OpenAIBackend(
            s.base_url, api_key=s.api_key, models=[s.model_name] if s.model_name else []
        )
    if backend == "vllm":
        if not s.vllm_url:
            raise ValueError("backend='vllm' needs vllm_url")
        return gateway.VLLMBackend(s.vllm_url, model=s.model_name)
    if backend != "transformers":
        raise ValueError(f"unknown backend {backend!r}")
    model = s.model
    if model is None:
        from agl.gateway.models import prepare_default_model

        model = str(prepare_default_model(progress=s.progress))
    name = s.model_name or (Path(str(model)).name if isinstance(model, (str, os.PathLike)) else None)
    return gateway.TransformersBackend(
        str(model) if isinstance(model, os.PathLike) else model, model_name=name
    )


class Environment:
    """Starts the stores, gateways and in-process runners; :meth:`close` stops them all.

    ``store``/``agent_url``/``model_name``: where the agent's rollouts go and which model they call;
    ``opt_store``/``opt_url``/``opt_model``: the same for the optimiser.
    """

    def __init__(self, apo: APO, settings: RunSettings, agent: Any) -> None:
        self.apo = apo
        self.settings = settings
        self._stack = contextlib.ExitStack()
        self._runner: Any = None
        self._runner_thread: threading.Thread | None = None
        try:
            self._start(agent)
        except BaseException:
            self.close()
            raise

    def _serve(self, backend: Any, store: Store) -> str:
        from agl.gateway.app import create_app
        from agl.gateway.testing import serve_asgi

        root = self._stack.enter_context(serve_asgi(create_app(backend, store), startup_timeout_s=900.0))
        return root + "/v1"

    def _start(self, agent: Any) -> None:
        s = self.settings
        self.store = open_store(s.store, s.run_dir / "store.db")
        if s.gateway_url:
            url = s.gateway_url.rstrip("/")
            self.agent_url = url if url.endswith("/v1") else url + "/v1"
            self.model_name = s.model_name or "model"
        else:
            backend = agent_backend(s)
            self.agent_url = self._serve(backend, self.store)
            models = backend.models()
            self.model_name = s.model_name or (models[0] if models else "model")
        self._start_optimizer()
        if s.runners > 0:
            self._start_runners(agent)

    def _start_optimizer(self) -> None:
        """The optimiser: its own backend, or any OpenAI-compatible URL, or (by default) the agent's
        own model through the agent's gateway — always behind a gateway that records its calls."""
        apo = self.apo
        self.opt_store = open_store(apo.optimizer_store, self.settings.run_dir / "optimizer.db")
        if self.opt_store is self.store:
            raise ValueError(
                "optimizer_store must not be the agent's store: runners would claim the optimiser's rollouts"
            )
        if apo.optimizer_backend is not None:
            opt_backend = apo.optimizer_backend
        else:
            from agl import gateway

            url = apo.optimizer_base_url or self.agent_url
            opt_backend = gateway.OpenAIBackend(
                url,
                api_key=apo.optimizer_api_key or (None if apo.optimizer_base_url else "agl"),
                models=[apo.optimizer_model] if apo.optimizer_model else [],
                timeout_s=apo.optimizer_timeout_s,
            )
        self.opt_url = self._serve(opt_backend, self.opt_store)
        opt_models = opt_backend.models() if hasattr(opt_backend, "models") else []
        self.opt_model = apo.optimizer_model or (opt_models[0] if opt_models else self.model_name)

    def _start_runners(self, agent: Any) -> None:
        from agl.runner import Runner

        self._runner = Runner(
            agent, self.store, concurrency=self.settings.runners, claim_timeout_s=1.0, worker_id="agl-apo"
        )
        self._runner_thread = threading.Thread(target=self._run_runner, name="agl-apo-runners", daemon=True)
        self._runner_thread.start()

    def _run_runner(self) -> None:
        import asyncio

        try:
            asyncio.run(self._runner.run_async())
        except Exception:  # noqa: BLE001
            log.exception("agl apo: the in-process runner crashed")

    def close(self) -> None:
        if self._runner is not None:
            self._runner.stop(now=True)
            if self._runner_thread is not None:
                self._runner_thread.join(timeout=30)
            self._runner = None
        with contextlib.suppress(Exception):
            from agl.tracing import flush

            flush(10.0)
        self._stack.close()
