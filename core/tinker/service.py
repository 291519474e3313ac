"""One run's connection to a Tinker-API service: :class:`TinkerService`.

What the trainer and the gateway share: the SDK's ``ServiceClient``, one LoRA training client per
adapter (one for the policy, or one per agent with ``LoopConfig.adapter_per_agent``, all on the same
base model), and the sampling client that serves each adapter's current weight version. The trainer
sends it each step's data (:mod:`agl.algorithms.tinker_update`); the gateway's ``tinker`` backend samples through
it (:mod:`agl.gateway.backends.tinker`).

Written against the SDK's public clients only (``ServiceClient.create_lora_training_client``,
``TrainingClient.forward_backward`` / ``optim_step`` / ``save_state`` / ``load_state_with_optimizer``
/ ``save_weights_and_get_sampling_client``, ``SamplingClient.sample``), so it runs on the newest SDK
against a hosted service and on ``tinker==0.12.0`` against SkyRL's ``skyrl-tx==0.3.0`` (the pair the
``tinker`` tox env tests). ``tinker`` is imported here, never at the top of a module agl imports
eagerly.

Bounded time: the SDK retries a connection error for as long as two hours; every call agl makes
waits at most ``timeout_s`` (a sample call ``sample_timeout_s``), and a call that runs past it, or
fails on the connection, is an :class:`agl.InfraError` naming the service's URL. A managed server
(:class:`agl.tinker.server.SkyRLServer`) that died is restarted once by :meth:`recover`, which
recreates the training clients from the last saved state (:meth:`save_state`, after every update) and
serves that state's weights again; against a service agl does not manage, the run fails naming the URL
and the last good step.

The API key: ``api_key``, else ``$TINKER_API_KEY`` (the SDK's own variable); never written to the
run's config, its record or its logs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agl.errors import BackendError, InfraError, UsageError

__all__ = ["API_KEY_ENV", "POLICY", "TinkerService"]

log = logging.getLogger("agl.tinker")

#: the SDK's variable for the service's key
API_KEY_ENV = "TINKER_API_KEY"
#: the adapter name of a run's one policy (no adapter per agent)
POLICY = "policy"
#: skyrl-tx's FastAPI title (``GET /`` answers ``{"name": ...}``): its losses are per-sequence means
_SKYRL_NAME = "Tinker API Mock"
#: the key a service without auth still wants from the SDK (``ServiceClient`` refuses none)
_NO_KEY = "tml-agl-no-key"


class TinkerService:
    """The service at ``url`` training ``adapters`` (names; default one, :data:`POLICY`) of rank
    ``lora_rank`` on ``base_model``. ``server``: the managed :class:`~agl.tinker.server.SkyRLServer`
    (restarted by :meth:`recover`), or None. ``state_file``: where the sampler and state paths of
    each version are written (the run directory's ``tinker/versions.json``), which ``resume=True`` and
    ``agl export model`` read."""

    def __init__(
        self,
        url: str,
        *,
        base_model: str,
        lora_rank: int = 16,
        adapters: Sequence[str] = (POLICY,),
        api_key: str | None = None,
        seed: int = 0,
        server: Any = None,
        timeout_s: float = 600.0,
        sample_timeout_s: float = 300.0,
        state_file: str | os.PathLike[str] | None = None,
    ) -> None:
        if not url:
            raise UsageError("backend='tinker' needs tinker_url (the service's URL) or tinker_python")
        if not base_model:
            raise UsageError("backend='tinker' needs base_model (the service's name for the base model)")
        if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1:
            raise UsageError(f"the LoRA rank must be an integer >= 1, got {lora_rank!r}")
        self.url = url.rstrip("/")
        self.base_model = base_model
        self.lora_rank = lora_rank
        self.adapters = list(adapters) or [POLICY]
        self._api_key = api_key or os.environ.get(API_KEY_ENV) or _NO_KEY
        self.seed = seed
        self.server = server
        self.timeout_s = float(timeout_s)
        self.sample_timeout_s = float(sample_timeout_s)
        self.state_file = Path(state_file) if state_file is not None else None
        self._client: Any = None
        self.training: dict[str, Any] = {}
        #: ``{adapter: (sampling client, weight version)}``; None: the base model's sampler
        self.samplers: dict[str, tuple[Any, int]] = {}
        self._base_sampler: Any = None
        #: ``{version: {adapter: saved state path}}`` and the last update step that saved one
        self.states: dict[int, dict[str, str]] = {}
        self.last_good_step: int | None = None
        self.version = 0
        self.restarts = 0
        #: whether the service averages a datum's loss over its weights, then over the data
        #: (skyrl-tx), instead of summing over tokens (Tinker): the update scales for it
        self.sequence_mean = False
        self._lock = threading.RLock()
        #: the recovery a gateway call started (one at a time), which later calls wait for
        self._recovering: concurrent.futures.Future[bool] | None = None
        self._recover_lock = threading.Lock()

    # ------------------------------------------------------------------------------ connect
    def connect(self) -> TinkerService:
        """Open the SDK client and one LoRA training client per adapter (idempotent)."""
        with self._lock:
            if self._client is not None:
                return self
            import tinker

            self.sequence_mean = self._is_skyrl()
            self._client = tinker.ServiceClient(base_url=self.url, api_key=self._api_key)
            for name in self.adapters:
                self.training[name] = self._call(
                    f"create a LoRA training client ({name})",
                    lambda: self._client.create_lora_training_client(
                        base_model=self.base_model, rank=self.lora_rank, seed=self.seed
                    ),
                )
        return self

    def _is_skyrl(self) -> bool:
        import httpx

        try:
            resp = httpx.get(self.url + "/", timeout=10)
            return resp.status_code == 200 and resp.json().get("name") == _SKYRL_NAME
        except (httpx.HTTPError, ValueError, AttributeError):
            return False

    # ------------------------------------------------------------------------------ calls
    def _call(self, what: str, fn: Callable[[], Any], timeout_s: float | None = None) -> Any:
        """``fn()`` (an SDK call; an APIFuture or concurrent future is waited for), at most
        ``timeout_s``; a timeout or connection failure is an InfraError naming the service."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        # a daemon thread, not a pool: an SDK call that never returns (it retries a dead service for
        # hours) must not keep the interpreter from exiting
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def work() -> None:
            try:
                fut.set_result(_wait(fn(), limit))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

        threading.Thread(target=work, name="agl-tinker-call", daemon=True).start()
        end = time.monotonic() + limit
        try:
            while True:  # a managed server seen dead fails the call at once, not after the timeout
                try:
                    return fut.result(timeout=min(1.0, max(end - time.monotonic(), 0.01)))
                except concurrent.futures.TimeoutError:
                    if self.server is not None and not self.server.alive():
                        raise InfraError(self._lost(what, "the server process exited")) from None
                    if time.monotonic() >= end:
                        raise
        except concurrent.futures.TimeoutError:
            raise InfraError(self._lost(what, f"no answer within {limit:.0f} s")) from None
        except InfraError:
            raise
        except Exception as exc:
            if _is_connection_error(exc):
                raise InfraError(self._lost(what, f"{type(exc).__name__}: {exc}")) from exc
            raise

    def _lost(self, what: str, why: str) -> str:
        step = "none yet" if self.last_good_step is None else str(self.last_good_step)
        return f"the Tinker service at {self.url} failed to {what} ({why}); the last good step was {step}" + (
            " (its saved state is kept: resume=True goes on from it)" if self.states else ""
        )

    def alive(self) -> bool:
        """Whether the service answers (a managed server: its process runs)."""
        if self.server is not None and not self.server.alive():
            return False
        import httpx

        try:
            return httpx.get(self.url + "/api/v1/healthz", timeout=5).status_code < 500
        except httpx.HTTPError:
            return False

    # ------------------------------------------------------------------------------ training
    def forward_backward(
        self, adapter: str, data: list[Any], loss_fn: str, config: dict[str, float] | None
    ) -> Any:
        client = self.training[adapter]
        return self._call(
            f"run forward_backward ({adapter}, {len(data)} data)",
            lambda: client.forward_backward(data, loss_fn, loss_fn_config=config),
        )

    def optim_step(self, adapter: str, adam: dict[str, float]) -> Any:
        import tinker

        client = self.training[adapter]
        params = tinker.AdamParams(**_known(tinker.AdamParams, adam))
        return self._call(f"run optim_step ({adapter})", lambda: client.optim_step(params))

    def save_state(self, step: int) -> dict[str, str]:
        """Save every adapter's weights and optimizer state on the service as ``agl-step<step>``; the
        paths are what :meth:`load_state` (resume, a restarted server) starts from."""
        paths = {}
        for name, client in self.training.items():
            out = self._call(
                f"save the state of {name}", lambda c=client, n=name: c.save_state(f"agl-{n}-step{step}")
            )
            paths[name] = str(out.path)
        with self._lock:
            self.states[step] = paths
            self.last_good_step = step
            self._write_state()
        return paths

    def load_state(self, paths: Mapping[str, str]) -> None:
        """Load each adapter's saved state (weights and optimizer) into a fresh training client."""
        with self._lock:
            for name in self.adapters:
                if name not in paths:
                    raise UsageError(f"the saved Tinker state has no adapter {name!r}: {sorted(paths)}")
                client = self._call(
                    f"create a LoRA training client ({name})",
                    lambda: self._client.create_lora_training_client(
                        base_model=self.base_model, rank=self.lora_rank, seed=self.seed
                    ),
                )
                self._call(
                    f"load the state {paths[name]}",
                    lambda c=client, n=name: c.load_state_with_optimizer(paths[n]),
                )
                self.training[name] = client

    # ------------------------------------------------------------------------------ sampling
    def publish(self, version: int) -> dict[str, str]:
        """Serve every adapter's current weights as ``version``: one sampler per adapter
        (``save_weights_and_get_sampling_client``), switched all at once; returns their names."""
        if sorted(self.training) != sorted(self.adapters):
            raise InfraError(self._lost("save the sampler weights", "its training clients are gone"))
        fresh: dict[str, tuple[Any, int]] = {}
        for name, client in self.training.items():
            sampler = self._call(
                f"save the sampler weights of {name}",
                lambda c=client: c.save_weights_and_get_sampling_client(),
            )
            fresh[name] = (sampler, int(version))
        with self._lock:
            self.samplers.update(fresh)
            self.version = int(version)
        return {name: _sampler_name(s) for name, (s, _) in fresh.items()}

    def base_sampler(self) -> Any:
        with self._lock:
            if self._base_sampler is None:
                if self._client is None:
                    import tinker

                    self.sequence_mean = self._is_skyrl()
                    self._client = tinker.ServiceClient(base_url=self.url, api_key=self._api_key)
                self._base_sampler = self._call(
                    "create the base model's sampler",
                    lambda: self._client.create_sampling_client(base_model=self.base_model),
                )
            return self._base_sampler

    def sampler(self, adapter: str | None) -> tuple[Any, int]:
        """The sampling client serving ``adapter`` (None: the policy) and its weight version; the
        base model (version 0) before the first :meth:`publish`."""
        with self._lock:
            name = adapter or (self.adapters[0] if len(self.adapters) == 1 else None)
            if name is not None and name in self.samplers:
                return self.samplers[name]
            if name in self.adapters and self.version > 0:  # trained weights exist, their sampler is gone
                raise InfraError(self._lost(f"serve {name}", "its sampler is gone (a restart not restored)"))
        return self.base_sampler(), 0

    def sample_future(
        self, adapter: str | None, ids: list[int], n: int, params: dict[str, Any]
    ) -> tuple[Any, int]:
        """Start one sample call (a concurrent future of the SDK's ``SampleResponse``) and the weight
        version serving it."""
        import tinker

        sampler, version = self.sampler(adapter)
        prompt = tinker.ModelInput.from_ints(list(ids))
        sp = tinker.SamplingParams(**params)
        return sampler.sample(prompt=prompt, num_samples=n, sampling_params=sp), version

    # ------------------------------------------------------------------------------ the gateway's calls
    async def sample(
        self, adapter: str | None, ids: list[int], n: int, params: dict[str, Any]
    ) -> tuple[Any, int]:
        """One sampling call of the gateway (asyncio): the SDK's ``SampleResponse`` and the weight version
        that served it, after any recovery in progress, within ``sample_timeout_s``. Every failure is a
        :class:`BackendError` (the gateway's 502: an infrastructure failure, requeued); a managed server
        found dead fails the call at once and starts one recovery that later calls wait for."""
        await self._wait_recovery()
        try:
            future, version = self.sample_future(adapter, ids, n, params)
            return await self._answer(future), version
        except asyncio.TimeoutError:
            self._check_server()
            raise BackendError(
                f"the Tinker service at {self.url} did not sample within {self.sample_timeout_s:.0f} s"
            ) from None
        except BackendError:
            self._check_server()
            raise
        except Exception as exc:  # the SDK's errors, a closed connection, a dead server
            self._check_server()
            raise BackendError(f"the Tinker service at {self.url}: {type(exc).__name__}: {exc}") from exc

    async def _answer(self, future: concurrent.futures.Future[Any]) -> Any:
        """The SDK future's answer, at most ``sample_timeout_s``. The SDK retries a refused connection
        for hours, so a managed server found dead fails the call at once (BackendError: requeued)."""
        waiting = asyncio.wrap_future(future)
        loop = asyncio.get_running_loop()
        end = loop.time() + self.sample_timeout_s
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(waiting), min(1.0, max(end - loop.time(), 0.01)))
            except asyncio.TimeoutError:
                if self.server is not None and not self.server.alive():
                    future.cancel()
                    raise BackendError(f"the Tinker server at {self.url} died during the call") from None
                if loop.time() >= end:
                    future.cancel()
                    raise

    async def publish_for_gateway(self, version: int) -> None:
        """:meth:`publish` from the gateway's push: a failure is retried once after a recovery (a
        managed server restarted), else raised."""
        await self._wait_recovery()
        seen = self.restarts
        try:
            await asyncio.to_thread(self.publish, version)
        except Exception as exc:
            if not await asyncio.to_thread(self._recover_logged, seen):
                raise
            log.warning("agl tinker: the push of v%d failed (%s); retried after recovery", version, exc)
            await asyncio.to_thread(self.publish, version)

    def _check_server(self) -> None:
        """A managed server found dead: start one recovery in a thread (the call fails as retriable)."""
        if self.server is None or self.server.alive():
            return
        with self._recover_lock:
            if self._recovering is None or self._recovering.done():
                pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="agl-tinker-recover")
                self._recovering = pool.submit(self._recover_logged, self.restarts)
                pool.shutdown(wait=False)

    def _recover_logged(self, seen: int | None = None) -> bool:
        try:
            return bool(self.recover(seen))
        except Exception:  # noqa: BLE001 - the next calls fail on the service and say so
            log.exception("agl tinker: recovering the Tinker server failed")
            return False

    async def _wait_recovery(self) -> None:
        pending = self._recovering
        if pending is not None and not pending.done():
            await asyncio.wrap_future(pending)

    # ------------------------------------------------------------------------------ recovery
    def recover(self, seen: int | None = None) -> bool:
        """After the managed server died: restart it, reconnect, load the last saved state and serve
        it again as the current version. ``seen``: the :attr:`restarts` count the caller saw fail (a
        recovery done since then is not repeated). False when there is no server to restart (the caller
        fails the run, naming the URL and the last good step)."""
        if self.server is None:
            return False
        with self._lock:
            if seen is not None and self.restarts != seen:
                return True  # another caller recovered it already
            log.warning("agl tinker: the Tinker server at %s failed; restarting it", self.url)
            self.server.restart()
            self.restarts += 1
            self._client, self._base_sampler = None, None
            self.training, self.samplers = {}, {}
            self.connect()
            if self.states:
                last = max(self.states)
                self.load_state(self.states[last])
                log.warning("agl tinker: restored the state of step %d", last)
            self.publish(self.version)
        return True

    # ------------------------------------------------------------------------------ files
    def _write_state(self) -> None:
        if self.state_file is None:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "url": self.url,
            "base_model": self.base_model,
            "lora_rank": self.lora_rank,
            "adapters": self.adapters,
            "states": {str(k): v for k, v in sorted(self.states.items())},
            "last_good_step": self.last_good_step,
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=2))
        tmp.replace(self.state_file)

    def _unload(self, client: Any) -> None:
        import httpx

        model_id = getattr(client, "model_id", None)
        if not model_id:
            return
        try:
            httpx.post(
                self.url + "/api/v1/unload_model",
                json={"model_id": model_id, "type": "unload_model"},
                headers={"X-API-Key": self._api_key},
                timeout=10,
            )
        except httpx.HTTPError:
            log.debug("agl tinker: unloading %s failed", model_id, exc_info=True)

    def close(self) -> None:
        """Unload the run's training clients on the service (``POST /api/v1/unload_model``, the
        Tinker API's own route: a LoRA slot is freed at once, not when the session times out), then
        drop the clients. Best effort: a service that is gone frees them itself."""
        for client in self.training.values():
            self._unload(client)
        self._client, self._base_sampler = None, None
        self.training, self.samplers = {}, {}


def _wait(value: Any, limit: float) -> Any:
    """An SDK answer: an APIFuture / concurrent future waited for (at most ``limit``), else itself."""
    result = getattr(value, "result", None)
    if callable(result) and not hasattr(value, "model_dump"):
        return result(timeout=limit)
    return value


def _known(model: Any, values: Mapping[str, Any]) -> dict[str, Any]:
    """The ``values`` a pydantic model of this SDK has fields for (``grad_clip_norm`` is newer)."""
    fields = getattr(model, "model_fields", {})
    return {k: v for k, v in values.items() if k in fields}


def _sampler_name(sampler: Any) -> str:
    for attr in ("model_path", "_sampling_session_id", "sampling_session_id"):
        value = getattr(sampler, attr, None)
        if value:
            return str(value)
    return "sampler"


def _is_connection_error(exc: BaseException) -> bool:
    from agl.adapter.failures import is_infra_error

    seen: BaseException | None = exc
    while seen is not None:
        if is_infra_error(type(seen).__name__, str(seen)) or isinstance(
            seen, (ConnectionError, TimeoutError)
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def wait_until(pred: Callable[[], bool], timeout_s: float, every_s: float = 0.5) -> bool:
    """Poll ``pred`` until true or ``timeout_s`` passes; returns its last value."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(every_s)
    return bool(pred())
