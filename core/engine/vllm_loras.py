"""Weight swaps on a vLLM server: LoRA adapters loaded at run time, an adapter per agent — the
:class:`VLLMLoras` half of the gateway's vllm backend (:class:`agl.gateway.backends.vllm.VLLMBackend`).

Weight swap: new weights arrive as LoRA adapters loaded at run time through vLLM's
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` (the server needs ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``). After a load, requests for the policy's name (``model``,
by default the upstream's first model) are sent to the newest adapter, so agents keep their model
name while the weights change; the adapter two versions back is unloaded. Requests that name another
upstream model explicitly go to it unchanged.

An adapter per agent (``adapters=["writer", "rewriter"]``, :mod:`agl.algorithms.per_agent_lora`): each agent's
adapter is loaded by name at run time as ``<policy>-<adapter>-v<version>`` (vLLM refuses a name twice),
and each call goes to the adapter :meth:`Backend.route` picked for it (``model="<base>:writer"`` or the
caller's baggage ``agl.agent``). Until an adapter's first load its calls go to the base model, which is
what a fresh LoRA adapter computes (B = 0). A push (:meth:`load_agent_loras`) loads every adapter
whose weights changed, then switches the routing of all of them at once, so one weight version names
one set of adapters. An unchanged adapter keeps serving its loaded copy only when the push just before
loaded it (else it is loaded again from this push's folder): vLLM may re-read an evicted adapter from
its path, and the trainer keeps only the last few pushes' folders. Calls of agents without an adapter
go to the base model.

A managed server that died and was restarted loads again the adapters that served the current weight
version, under their names (:meth:`VLLMLoras._reload_adapters`).

The host class provides: ``request(method, url, body)`` and ``base_url`` (its HTTP client to vLLM's
``/v1``), ``push_pause`` (:class:`agl.engine.vllm_pause.PushPause`), ``policy_name``,
``upstream_models``, ``adapters``, ``current_upstream``, ``keep_adapters``, ``lora_served``,
``_lora_loaded``, ``_agent_digest``, ``_lora_paths``, ``weight_version`` / ``_bump_version`` (the
backend's weight version), ``_ensure_started`` and the managed server's ``recover`` /
``_server_died`` / ``_recovering``.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from agl.errors import BackendError

__all__ = ["VLLMLoras"]

log = logging.getLogger("agl.gateway")


class VLLMLoras:
    """Loading, routing and unloading the LoRA adapters a vLLM server serves (see the module docstring)."""

    # provided by the host backend (the module docstring lists them)
    lora_served: dict[str, str | None]
    _lora_loaded: dict[str, list[str]]
    _agent_digest: dict[str, tuple[str, int]]
    _lora_paths: dict[str, str]
    adapters: list[str]
    upstream_models: list[str]
    current_upstream: str | None
    policy_name: str | None
    keep_adapters: int
    base_url: str
    push_pause: Any
    weight_version: int
    _recovering: Any

    async def _reload_adapters(self) -> None:
        """Load the adapters that served the current weight version again, under their names; the
        older copies (kept for calls in flight) died with the server."""
        current = [n for n in self.lora_served.values() if n]
        if not self.lora_served and self.current_upstream in self.adapters:
            current = [self.current_upstream]
        for lora_name in current:
            await self._load_lora(lora_name, self._lora_paths[lora_name], replace=True)
            if lora_name not in self.upstream_models:
                self.upstream_models.append(lora_name)
        self.adapters = [n for n in self.adapters if n in current]
        for adapter, names in self._lora_loaded.items():
            self._lora_loaded[adapter] = [n for n in names if n in current]

    async def load_adapter(self, path: str, *, name: str | None = None, version: int | None = None) -> int:
        """Load a LoRA adapter into vLLM and route the policy's requests to it (``name`` an agent's
        adapter: that adapter's new weights, :meth:`load_agent_loras`)."""
        if name is not None and name in self.lora_served:
            return await self.load_agent_loras({name: path}, version=version)
        await self._ensure_started()
        new_version = self.weight_version + 1 if version is None else int(version)
        lora_name = name or f"{self.policy_name}-agl-v{new_version}"
        async with self.push_pause.held():
            await self._load_lora(lora_name, path, replace=name is None)
            self.adapters.append(lora_name)
            self.current_upstream = lora_name
            if lora_name not in self.upstream_models:
                self.upstream_models.append(lora_name)
            self._bump_version(new_version)
        while len(self.adapters) > self.keep_adapters:
            await self._unload_lora(self.adapters.pop(0))
        return self.weight_version

    async def load_agent_loras(self, paths: dict[str, str], *, version: int | None = None) -> int:
        """Serve each agent's adapter from its folder (``{adapter: path}``) as weight ``version``: the
        changed ones are loaded by name, then every call is routed to its adapter's new copy at once;
        the copies ``keep_adapters`` loads back are unloaded. A refused load leaves the routing as it
        was (the copies this push loaded are unloaded) and raises BackendError."""
        await self._ensure_started()
        unknown = sorted(set(paths) - set(self.lora_served))
        if self.lora_served and unknown:
            raise BackendError(f"no agent adapter {unknown}: this gateway serves {sorted(self.lora_served)}")
        new_version = self.weight_version + 1 if version is None else int(version)
        changed = self._changed(paths)  # the files are read before the pause, which stays short
        if changed:
            async with self.push_pause.held():
                loaded = await self._load_changed(changed, new_version)
                self._bump_version(new_version)
        else:
            loaded = {}
            self._bump_version(new_version)
        for adapter in loaded:
            names = self._lora_loaded[adapter]
            while len(names) > self.keep_adapters:
                await self._unload_lora(names.pop(0))
        return self.weight_version

    def _changed(self, paths: dict[str, str]) -> dict[str, tuple[str, str]]:
        """``{adapter: (path, digest)}`` of the adapters to load: those whose weights file differs from
        the copy the last push loaded (an unchanged one, no gradient, keeps serving its loaded copy)."""
        changed: dict[str, tuple[str, str]] = {}
        for adapter, path in paths.items():
            digest = _digest(path)
            if not digest or self._agent_digest.get(adapter) != (digest, self.weight_version):
                changed[adapter] = (path, digest)
        return changed

    async def _load_changed(self, changed: dict[str, tuple[str, str]], new_version: int) -> dict[str, str]:
        """Load each changed adapter as ``<policy>-<adapter>-v<new_version>`` and route its calls there
        (all at once, after every load succeeded); ``{adapter: LoRA name}`` of those loaded. A refused
        load unloads this push's copies and raises BackendError, the routing unchanged."""
        loaded: dict[str, str] = {}
        try:
            for adapter, (path, _) in changed.items():
                lora_name = f"{self.policy_name}-{adapter}-v{new_version}"
                await self._load_lora(lora_name, path, replace=True)
                loaded[adapter] = lora_name
        except BackendError:
            for lora_name in loaded.values():
                await self._unload_lora(lora_name)
            raise
        for adapter, lora_name in loaded.items():
            self.lora_served[adapter] = lora_name
            self._agent_digest[adapter] = (changed[adapter][1], new_version)
            self._lora_loaded.setdefault(adapter, []).append(lora_name)
        return loaded

    async def _load_lora(self, lora_name: str, path: str, *, replace: bool = False) -> None:
        """``POST /v1/load_lora_adapter``; BackendError with vLLM's answer when it refuses. ``replace``
        (a name agl made up): a name an earlier run left loaded on a long-running server is loaded
        again in place from this run's folder (``load_inplace``; a new path, so no stale cache)."""
        body: dict[str, Any] = {"lora_name": lora_name, "lora_path": path}
        try:
            status, raw = await self.request("POST", self.base_url + "/load_lora_adapter", body)
        except BackendError as exc:  # a managed server that died: restarted, then loaded there
            if (
                self._recovering is not None
                and not self._recovering.done()
                or not await self._server_died(exc)
            ):
                raise
            await self.recover()
            status, raw = await self.request("POST", self.base_url + "/load_lora_adapter", body)
        if replace and status == 400 and b"already been loaded" in raw:
            log.info(
                "agl gateway: vLLM already had an adapter %s (an earlier run's): replacing it", lora_name
            )
            status, raw = await self.request(
                "POST", self.base_url + "/load_lora_adapter", {**body, "load_inplace": True}
            )
        if status < 400:
            self._lora_paths[lora_name] = path
        if status >= 400:
            raise BackendError(
                f"vLLM refused to load adapter {lora_name!r} from {path!r}: {raw[:500].decode(errors='replace')}"
            )

    async def _unload_lora(self, lora_name: str) -> None:
        """``POST /v1/unload_lora_adapter``; a failure is only logged (an adapter left loaded is harmless)."""
        try:
            await self.request("POST", self.base_url + "/unload_lora_adapter", {"lora_name": lora_name})
            self._lora_paths.pop(lora_name, None)
            if lora_name in self.upstream_models:
                self.upstream_models.remove(lora_name)
        except Exception as exc:  # noqa: BLE001 - an adapter left loaded is harmless
            log.warning("agl gateway: could not unload adapter %s: %s", lora_name, exc)


def _digest(path: str) -> str:
    """A digest of the adapter's weights file (empty when there is none: always loaded)."""
    weights = Path(path) / "adapter_model.safetensors"
    if not weights.is_file():
        return ""
    return hashlib.sha256(weights.read_bytes()).hexdigest()
