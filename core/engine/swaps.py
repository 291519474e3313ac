"""Weight swaps that do not drain the engine: the transformers backend applies them between decode steps.

A swap that keeps the model object (new LoRA tensors copied in place, a state dict loaded into the same
modules, another adapter on the same peft model) is queued here by the event loop and run by the
engine's worker thread at the top of its next scheduler iteration: after one decode step and before the
next. Rows in the running batch keep their KV cache (computed by the old weights) and draw their
remaining tokens from the new ones, each token tagged with the version that drew it
(:attr:`agl.engine.batching.Row.versions`): a partial rollout, as AReaL and slime serve
them. The recorded log-probs stay those of the distribution each token was drawn from, so they are the
exact behaviour policy either way.

Nothing serves while a swap runs (the worker thread runs it), so no forward pass sees half-copied
weights. When the worker is idle, :meth:`LiveSwaps.drain` runs the queued swaps under the generation
lock instead.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["LiveSwaps"]


class LiveSwaps:
    """The swaps waiting for the worker thread (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[], int], asyncio.Future[int], asyncio.AbstractEventLoop]] = []
        self._drains: set[asyncio.Task[None]] = set()

    def __bool__(self) -> bool:
        return bool(self._pending)

    async def submit(
        self, fn: Callable[[], int], lock: asyncio.Lock, executor: Any, on_idle: Callable[[], None]
    ) -> int:
        """Queue ``fn`` and wait for its result. A worker serving a batch runs it between two decode
        steps; else a drain task runs it under the generation ``lock`` in the worker's ``executor``
        (``on_idle`` is that task's call: it runs every queued swap, see :meth:`run`)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        with self._lock:
            self._pending.append((fn, future, loop))

        async def drain() -> None:
            async with lock:
                await loop.run_in_executor(executor, on_idle)

        task = asyncio.create_task(drain())
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)
        return await future

    def run(self) -> bool:
        """Run every queued swap in order (the worker thread); returns whether any ran. Each caller gets
        its swap's version, or its exception."""
        with self._lock:
            pending, self._pending = self._pending, []
        for fn, future, loop in pending:
            try:
                value: Any = fn()
                error: BaseException | None = None
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                value, error = None, exc
            loop.call_soon_threadsafe(_settle, future, value, error)
        return bool(pending)


def _settle(future: asyncio.Future[int], value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
