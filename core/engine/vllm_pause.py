"""Pausing a vLLM server around a weight push: :class:`PushPause`, used by the gateway's vllm backend.

Pause around a weight push (``pause_on_push``). vLLM's HTTP API for RL weight sync, at the server's
root (not under ``/v1``) and only when vLLM runs with ``VLLM_SERVER_DEV_MODE=1``
(``vllm/entrypoints/serve/rlhf/api_router.py``, ``attach_router`` returns early without it; newer
trees keep the same routes in ``vllm/entrypoints/serve/dev/rlhf/api_router.py``, vLLM 0.32 in
``vllm/entrypoints/rl/online/api_router.py``):

- ``POST /pause`` with query parameters ``mode`` (``PauseMode`` in ``vllm/v1/engine/__init__.py``:
  ``"abort"``, the default, aborts the requests in flight and returns their partial output; ``"wait"``
  waits until they finish; ``"keep"`` freezes them in the scheduler, KV cache kept, and they go on at
  the resume), ``wait_for_inflight_requests`` (deprecated bool, true means ``mode="wait"``) and
  ``clear_cache`` (bool, default true; documented as ignored with ``mode="keep"``). It answers
  ``{"status": "paused"}`` once the engine is paused, 400 ``{"error"}`` on a bad value;
- ``POST /resume`` → ``{"status": "resumed"}``; ``GET /is_paused`` → ``{"is_paused": bool}``.

The engine side is ``AsyncLLM.pause_generation(mode=..., clear_cache=...)`` /
``resume_generation()`` (``vllm/v1/engine/async_llm.py``): requests that arrive while paused are
accepted and queued, not scheduled until the resume. History: the routes came with vLLM PR #28037
(``/pause`` had only ``wait_for_inflight_requests`` and ``clear_cache``), ``mode`` with ``"keep"``
with PR #32351, and PR #34125 moved the pause into the engine core.

A push pauses with ``mode=keep&clear_cache=false``, loads the new adapters, switches the routing,
then resumes in a ``finally`` (a failed load never leaves vLLM paused) and unloads the old copies
after the resume. ``keep`` is the one mode that loses nothing and does not drain: ``abort`` would
drop every call in flight, ``wait`` would hold the push until the longest call ends (a drain). A
frozen call keeps the adapter it was admitted with, so it finishes on the weights its span names.
``clear_cache=false``: vLLM keys cached blocks by LoRA adapter and each push loads new adapter names,
so no stale block can serve the new weights, and the base model's prefixes stay cached.

Whether the server can: once, on the first push, the backend reads ``GET /openapi.json`` (FastAPI's
schema, served unless ``--disable-fastapi-docs``) for ``/pause`` and its ``mode`` parameter, else
asks ``GET /is_paused``. A ``/pause`` without ``mode`` (an older vLLM) ignores ``mode=keep`` and
aborts, so it is not used. ``pause_on_push=None`` (default) pauses only where ``mode`` is listed and
otherwise loads without pausing, as before, after one log line; ``True`` requires the pause (also
when the schema is not served), ``False`` never pauses.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from agl.errors import BackendError

__all__ = ["PAUSE_QUERY", "PushPause"]

log = logging.getLogger("agl.gateway")

#: the pause a weight push asks for: in-flight requests frozen in place, caches kept (see above)
PAUSE_QUERY = "mode=keep&clear_cache=false"
#: what the server offers: pause with ``mode`` / no ``/pause`` / ``/pause`` without ``mode`` /
#: ``/pause`` whose parameters could not be read (no OpenAPI schema)
_KEEP, _ABSENT, _NO_KEEP, _UNKNOWN = "keep", "absent", "no-keep", "unknown"

#: ``request(method, url) -> (status, body)``: the backend's HTTP client, which raises BackendError
Request = Callable[[str, str], Awaitable[tuple[int, bytes]]]


class PushPause:
    """``async with PushPause(root_url, request, pause_on_push).held():`` one weight push, paused
    where the server (asked once) offers ``mode=keep``; pushes never interleave (one lock)."""

    def __init__(self, root_url: str, request: Request, pause_on_push: bool | None) -> None:
        #: pause generation around a weight push: True always, False never, None when vLLM has mode=keep
        self.pause_on_push = pause_on_push
        self.root_url = root_url
        self.request = request
        self._pause_support: str | None = None  # what the server offers, asked once
        self._push_lock = asyncio.Lock()  # one push at a time: pauses and resumes do not interleave

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Generation paused (``mode=keep``) for the body when the server offers it, resumed in a
        ``finally``: the body's failure still resumes and then propagates; a failed resume raises
        BackendError (vLLM may still be paused) unless the body failed, whose error wins."""
        async with self._push_lock:
            if not await self._should_pause() or not await self._pause():
                yield
                return
            failed = True
            try:
                yield
                failed = False
            finally:
                await self._resume(quiet=failed)

    async def _should_pause(self) -> bool:
        """Whether this push pauses: asks the server once (:meth:`_probe_pause`) and logs one line."""
        if self.pause_on_push is False:
            return False
        if self._pause_support is None:
            self._pause_support = await self._probe_pause()
            self._log_pause_support()
        if self._pause_support == _KEEP or (self.pause_on_push and self._pause_support == _UNKNOWN):
            return True
        if self.pause_on_push:
            raise BackendError(
                f"pause_on_push=True but vLLM at {self.root_url} offers no POST /pause?mode=keep "
                "(start a vLLM that has it with VLLM_SERVER_DEV_MODE=1, or pass pause_on_push=None)"
            )
        return False

    async def _probe_pause(self) -> str:
        """What the server offers, from FastAPI's ``/openapi.json`` (``/pause`` and its ``mode``
        parameter), else from ``GET /is_paused`` (200: a ``/pause`` whose options are unknown)."""
        status, raw = await self.request("GET", self.root_url + "/openapi.json")
        if status == 200 and (support := _pause_support_in_schema(raw)) is not None:
            return support
        status, _ = await self.request("GET", self.root_url + "/is_paused")
        return _UNKNOWN if status == 200 else _ABSENT

    def _log_pause_support(self) -> None:
        where, support = f"agl gateway: vLLM at {self.root_url}", self._pause_support
        if support == _KEEP or (support == _UNKNOWN and self.pause_on_push):
            log.info(
                "%s: weight pushes pause generation (POST /pause?%s, then POST /resume)", where, PAUSE_QUERY
            )
        elif support == _ABSENT:
            log.warning(
                "%s offers no POST /pause (vLLM with pause mode=keep, run with VLLM_SERVER_DEV_MODE=1): "
                "weight pushes load adapters without pausing",
                where,
            )
        elif support == _NO_KEEP:
            log.warning(
                "%s has POST /pause without mode=keep (an older vLLM: it would abort or wait out the calls "
                "in flight): weight pushes load adapters without pausing",
                where,
            )
        else:
            log.warning(
                "%s has POST /pause but serves no /openapi.json to tell whether it has mode=keep: weight "
                "pushes load adapters without pausing (pause_on_push=True pauses anyway)",
                where,
            )

    async def _pause(self) -> bool:
        """``POST /pause?mode=keep&clear_cache=false``; True once paused. A refusal is resumed away (the
        server may have paused half-way) and raises BackendError under ``pause_on_push=True``, else is
        logged and the push goes on unpaused (pausing is not needed to load an adapter)."""
        why = await self._control(f"/pause?{PAUSE_QUERY}")
        if why is None:
            return True
        await self._resume(quiet=True)
        message = f"vLLM at {self.root_url} did not pause for the weight push ({why})"
        if self.pause_on_push:
            raise BackendError(message)
        log.warning("agl gateway: %s; this push loads without pausing", message)
        return False

    async def _resume(self, *, quiet: bool) -> None:
        """``POST /resume``. A failure raises BackendError (calls would hang on a paused vLLM), or is
        only logged when ``quiet`` (another error is already on its way)."""
        why = await self._control("/resume")
        if why is None:
            return
        message = f"vLLM at {self.root_url} did not resume generation ({why}): it may still be paused"
        if quiet:
            log.error("agl gateway: %s", message)
            return
        raise BackendError(message)

    async def _control(self, route: str) -> str | None:
        """``POST`` to one of vLLM's root control routes; None when it succeeded, else why not."""
        try:
            status, raw = await self.request("POST", self.root_url + route)
        except BackendError as exc:
            return str(exc)
        return None if status < 400 else f"answered {status}: {raw[:300].decode(errors='replace')}"


def _pause_support_in_schema(raw: bytes) -> str | None:
    """What an OpenAPI schema says of ``POST /pause``: ``_KEEP`` (it has ``mode``), ``_NO_KEEP``,
    ``_ABSENT``; None when ``raw`` is not an OpenAPI schema."""
    try:
        schema = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(schema, dict) or not isinstance(schema.get("paths"), dict):
        return None
    pause = schema["paths"].get("/pause")
    if not isinstance(pause, dict) or not isinstance(pause.get("post"), dict):
        return _ABSENT
    params = pause["post"].get("parameters") or []
    names = {p.get("name") for p in params if isinstance(p, dict)}
    return _KEEP if "mode" in names else _NO_KEEP
