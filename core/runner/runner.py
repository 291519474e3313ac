"""The Runner (DESIGN §9): claims rollouts from a store, runs the user's agent on them, reports back.

A runner is the agent side of the loop. It long-polls the store for work, runs up to ``concurrency``
rollouts at once (async agents as asyncio tasks; sync agents in threads, with their context copied so
the rollout context and OTel context follow them), heartbeats each claimed attempt, honours a
per-rollout timeout, and finishes the attempt:

- the agent's return value (a number) becomes the attempt's primary ``agl.reward`` span
  (``agl.reward.source = "return"``); ``None`` means the agent emitted its rewards itself;
- an exception becomes an ``agl.exception`` span with the traceback and the attempt's error;
- ``agl.tracing.provider.flush()`` runs before ``finish_attempt``, so every span of an attempt is in the store
  before its status changes (the trainer reads spans as soon as a rollout is terminal).

The agent is called as ``agent(task_input, resources)``, where ``resources`` is the ``Resources``
snapshot the rollout was enqueued with, its main LLM's ``base_url`` rewritten to the gateway's
per-rollout path ``{gateway}/rollouts/{id}/attempts/{n}/v1``: the gateway knows which rollout a call
belongs to even when a framework drops the tracing headers.

SIGINT/SIGTERM stop claiming; in-flight rollouts get ``grace_s`` to finish, then are finished as failed
(the store requeues them while attempts remain). A second signal stops at once, the same way.

A store that becomes unreachable (a claim's HTTP retries ran out) is one warning; the runner then
waits for it with backoff and claims again once it answers (:mod:`agl.runner.store_gate`).

Hung sync agents: Python cannot stop a thread. When a sync agent's rollout times out (or is lost or
released) the attempt is finished at once, but the agent's thread runs on until the agent returns by
itself. Such threads are counted (``stats.hung``); once ``max_hung`` are still running the runner
stops claiming until some return (with ``until_idle`` it exits instead), so a wedged agent cannot pile
up threads without bound. An async agent has no such problem: it is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import importlib
import inspect
import logging
import math
import os
import signal
import socket
import sys
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agl import semconv
from agl.errors import UsageError
from agl.gateway.serve import rollout_base_url
from agl.types import LLM, AttemptError, Claim, Mode, Resources

if TYPE_CHECKING:
    from agl.store.base import Store

__all__ = [
    "RolloutFunction",
    "Runner",
    "RunnerStats",
    "instrument_imported_frameworks",
    "load_agent",
    "rollout",
    "rollout_resources",
]

log = logging.getLogger("agl.runner")

AgentFn = Callable[..., Any]


# ------------------------------------------------------------------------------------- decorator


class RolloutFunction:
    """An agent function marked with ``@agl.rollout``: called as ``fn(task_input, resources)``.

    The function may take ``(task)`` or ``(task, resources)`` and may be sync or async; it returns a
    reward (a number) or None. Calling the decorated object directly calls the function unchanged.
    """

    def __init__(
        self,
        fn: AgentFn,
        *,
        timeout_s: float | None = None,
        name: str | None = None,
        replayable: bool = False,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"@agl.rollout needs a function, got {type(fn).__name__}")
        if timeout_s is not None and (not math.isfinite(timeout_s) or timeout_s <= 0):
            raise UsageError(f"timeout_s must be a positive number, got {timeout_s!r}")
        if not isinstance(replayable, bool):
            raise UsageError(f"replayable must be True or False, got {replayable!r}")
        self.fn = fn
        self.timeout_s = timeout_s
        #: the function is deterministic given the LLM's responses: the trainer may branch it at a call
        #: (agl.trainer.branching), the gateway replaying the calls before it (agl.gateway.replay)
        self.replayable = replayable
        self.name = name or getattr(fn, "__name__", "agent")
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - async callable objects
        )
        self.takes_resources = _takes_two(fn)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def invoke(self, task_input: Any, resources: Resources | None) -> Any:
        """Call with the runner's convention, whatever the function's arity."""
        return self.fn(task_input, resources) if self.takes_resources else self.fn(task_input)

    def __repr__(self) -> str:
        return f"<agl.rollout {self.name}>"


def _takes_two(fn: AgentFn) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    params = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values()):
        return True
    if not params:
        raise TypeError(
            f"agent {getattr(fn, '__name__', fn)!r} must take the task input as its first argument"
        )
    return len(params) >= 2


def rollout(
    fn: AgentFn | None = None,
    *,
    timeout_s: float | None = None,
    name: str | None = None,
    replayable: bool = False,
) -> Any:
    """Mark a function as an agl agent: ``@agl.rollout`` or ``@agl.rollout(timeout_s=60)``.

    The function is called as ``fn(task_input, resources)`` (or ``fn(task_input)``), sync or async,
    and returns a reward or None (rewards emitted with ``agl.emit_reward``). ``replayable=True``
    declares it deterministic given the LLM's responses (same task and same replies: the same calls,
    in the same order, with the same messages), which lets the trainer branch it at a call
    (``LoopConfig.branches``, :mod:`agl.trainer.branching`).
    """
    if fn is None:
        return lambda f: RolloutFunction(f, timeout_s=timeout_s, name=name, replayable=replayable)
    return RolloutFunction(fn, timeout_s=timeout_s, name=name, replayable=replayable)


def _as_rollout_function(agent: AgentFn | RolloutFunction) -> RolloutFunction:
    return agent if isinstance(agent, RolloutFunction) else RolloutFunction(agent)


def load_agent(spec: str) -> RolloutFunction:
    """``module:function`` (or ``module.function``) → the agent; the current directory is importable."""
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    else:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise UsageError(f"--agent must be module:function, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import agent module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return _as_rollout_function(obj)


def rollout_resources(resources: Resources | None, rollout_id: str, attempt: int) -> Resources | None:
    """The snapshot an agent sees: every LLM's gateway URL rewritten to the per-rollout path."""
    if resources is None:
        return None
    items: dict[str, Any] = {}
    changed = False
    for key, item in resources.items.items():
        if isinstance(item, LLM) and "/rollouts/" not in item.base_url:
            items[key] = item.model_copy(
                update={"base_url": rollout_base_url(item.base_url, rollout_id, attempt)}
            )
            changed = True
        else:
            items[key] = item
    return resources.model_copy(update={"items": items}) if changed else resources


# ------------------------------------------------------------------------------------------ runner


@dataclass
class RunnerStats:
    """What a runner did; ``errors`` keeps the last few error messages for a human."""

    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    timed_out: int = 0
    lost: int = 0  #: attempts the store ended under us (lease expired, cancelled)
    released: int = 0  #: claimed work handed back on shutdown
    hung: int = 0  #: sync agent threads still running after their rollout was given up (now)
    endpoint_pauses: int = 0  #: times claiming paused because the agents' LLM endpoint was down
    rewards: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "claimed": self.claimed,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "timed_out": self.timed_out,
            "lost": self.lost,
            "released": self.released,
            "hung": self.hung,
            "endpoint_pauses": self.endpoint_pauses,
            "reward_mean": sum(self.rewards) / len(self.rewards) if self.rewards else None,
        }


def report_margin(timeout_s: float) -> float:
    """How long before the store's ``timeout_s`` a live runner stops a rollout, to record why and finish
    the attempt itself: a fifth of it, at most a second."""
    return min(1.0, 0.2 * timeout_s)


class _Lost(Exception):
    """The store ended our attempt (lease expired or rollout cancelled): stop working on it."""


class _Shutdown(Exception):
    """The runner is stopping and this rollout did not finish within the grace period."""


def _reward_value(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        v = float(value)
        if not math.isfinite(v):
            raise ValueError(f"the agent returned a non-finite reward ({value!r})")
        return v
    try:  # numpy scalars, 0-d tensors
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"the agent returned {type(value).__name__}; an agent returns a reward (a number) or None"
        ) from None
    if not math.isfinite(v):
        raise ValueError(f"the agent returned a non-finite reward ({value!r})")
    return v


def _emit_return_reward(value: float) -> None:
    """The agent's return value as the attempt's primary reward (source "return")."""
    from agl.tracing.provider import get_tracer

    get_tracer("agl.runner").start_span(
        semconv.SPAN_REWARD,
        attributes={
            semconv.AGL_REWARD_VALUE: value,
            semconv.AGL_REWARD_NAME: "reward",
            semconv.AGL_REWARD_PRIMARY: True,
            semconv.AGL_REWARD_SOURCE: "return",
        },
    ).end()


@contextlib.contextmanager
def _invoke(rid: str, number: int, resources: Resources | None, *, span: bool = True) -> Iterator[None]:
    """The one place the runner enters a rollout attempt's context, for sync agents (in their thread)
    and async ones (in their task) alike: the rollout context (``agl.rollout`` span unless ``span``
    is False), the rollout's resources for ``agl.prompt()``, and the agent's exception recorded as an
    error span inside the rollout's trace before it propagates. A cancelled task (timeout, lost
    lease, shutdown) records nothing here: the runner records why it gave up."""
    from agl.tracing.emit import emit_exception
    from agl.tracing.prompts import resources_context
    from agl.tracing.provider import rollout_context

    with rollout_context(rid, number, span=span), resources_context(resources):
        try:
            yield
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            emit_exception(exc)
            raise


def _settle(returned: Any) -> float | None:
    """The agent's return value as the attempt's primary reward (emitted as a reward span), or None."""
    value = _reward_value(returned)
    if value is not None:
        _emit_return_reward(value)
    return value


class Runner:
    """Run ``agent`` on rollouts claimed from ``store``, ``concurrency`` at a time.

    ``timeout_s`` caps each rollout (the rollout's own ``config.timeout_s`` or the ``@agl.rollout``
    timeout apply when smaller). ``heartbeat_s`` defaults to a third of the rollout's lease.
    ``modes`` restricts what is claimed (e.g. ``["val"]``). ``grace_s`` is how long in-flight work may
    run on after a stop request before it is released. ``max_hung`` (default ``max(4, concurrency)``)
    is how many sync agent threads may still run after their rollouts were given up before the
    runner stops claiming (see the module docstring).
    """

    def __init__(
        self,
        agent: AgentFn | RolloutFunction,
        store: Store,
        *,
        concurrency: int = 1,
        worker_id: str | None = None,
        timeout_s: float | None = None,
        heartbeat_s: float | None = None,
        modes: Sequence[Mode] | None = None,
        claim_timeout_s: float = 1.0,
        grace_s: float = 30.0,
        trace: bool = True,
        max_hung: int | None = None,
    ) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise UsageError(f"concurrency must be an integer >= 1, got {concurrency!r}")
        for name, value in (("timeout_s", timeout_s), ("heartbeat_s", heartbeat_s)):
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise UsageError(f"{name} must be a positive number, got {value!r}")
        if claim_timeout_s < 0 or grace_s < 0:
            raise UsageError("claim_timeout_s and grace_s must be >= 0")
        if max_hung is not None and (
            isinstance(max_hung, bool) or not isinstance(max_hung, int) or max_hung < 1
        ):
            raise UsageError(f"max_hung must be an integer >= 1, got {max_hung!r}")
        self.max_hung = max_hung if max_hung is not None else max(4, concurrency)
        #: sync agent threads given up on but still running (touched on the event loop only)
        self._hung: set[threading.Thread] = set()
        self._hung_warned = False
        self.agent = _as_rollout_function(agent)
        self.store = store
        self.concurrency = concurrency
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.modes = list(modes) if modes is not None else None
        self.claim_timeout_s = claim_timeout_s
        self.grace_s = grace_s
        self.stats = RunnerStats()
        self._stop = threading.Event()
        self._hard_stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_evt: asyncio.Event | None = None
        self._hard_evt: asyncio.Event | None = None
        self._resources: dict[int | None, Resources | None] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._remaining: int | None = None
        self._idle_exit = False
        if trace:
            from agl.tracing.provider import setup_tracing

            setup_tracing(store)
        from agl.instrumentation.attribution import AttributionCheck

        # warns once when LLM calls left no client span or lost their agent (from the stored spans, at
        # the end of an attempt: before the agent runs, integrations may still wait for their import)
        self._attribution = AttributionCheck(store)
        from agl.runner.endpoint_gate import EndpointGate

        self._gate = EndpointGate()  # no claims while the agents' LLM endpoint refuses connections
        from agl.runner.store_gate import StoreGate

        self._store_gate = StoreGate(store, self.worker_id)  # nor while the store is unreachable

    # ------------------------------------------------------------------------------ control
    def stop(self, *, now: bool = False) -> None:
        """Stop claiming; with ``now`` (or a second call) release in-flight work at once. Thread-safe."""
        if self._stop.is_set() or now:
            self._hard_stop.set()
        self._stop.set()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._sync_events)

    def _sync_events(self) -> None:
        if self._stop.is_set() and self._stop_evt is not None:
            self._stop_evt.set()
        if self._hard_stop.is_set() and self._hard_evt is not None:
            self._hard_evt.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self, *, max_rollouts: int | None = None, until_idle: bool = False) -> RunnerStats:
        """Run until stopped (SIGINT/SIGTERM in the main thread), ``max_rollouts`` are done, or, with
        ``until_idle``, no work arrives within ``claim_timeout_s``. Blocks; returns the stats."""
        return asyncio.run(self.run_async(max_rollouts=max_rollouts, until_idle=until_idle, signals=True))

    async def run_async(
        self, *, max_rollouts: int | None = None, until_idle: bool = False, signals: bool = False
    ) -> RunnerStats:
        """The runner's loop as a coroutine (to run beside other tasks, e.g. in the trainer)."""
        if max_rollouts is not None and max_rollouts < 0:
            raise UsageError(f"max_rollouts must be >= 0, got {max_rollouts}")
        self._stop.clear()
        self._hard_stop.clear()
        self._loop = asyncio.get_running_loop()
        self._stop_evt, self._hard_evt = asyncio.Event(), asyncio.Event()
        self._remaining = max_rollouts
        self._idle_exit = until_idle
        loop = asyncio.get_running_loop()
        installed: list[int] = []
        if signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.add_signal_handler(sig, self._on_signal, sig)
                    installed.append(sig)
                except (NotImplementedError, RuntimeError):  # pragma: no cover - non-Unix loops
                    pass
        # Blocking store calls and long-poll claims each hold a thread (sync agents get their own).
        self._executor = ThreadPoolExecutor(
            max_workers=2 * self.concurrency + 4, thread_name_prefix=f"agl-runner-{self.worker_id}"
        )
        try:
            workers = [asyncio.create_task(self._worker(i)) for i in range(self.concurrency)]
            await asyncio.gather(*workers)
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
            self._loop = None
        return self.stats

    def _on_signal(self, sig: int) -> None:
        hard = self._stop.is_set()
        log.warning(
            "agl runner %s: %s — %s",
            self.worker_id,
            signal.Signals(sig).name,
            "releasing in-flight rollouts now"
            if hard
            else f"no new claims; finishing in-flight work (grace {self.grace_s:g}s)",
        )
        self.stop(now=hard)

    # --------------------------------------------------------------------------- internals
    async def _blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a blocking call in the runner's threads, with the caller's context (contextvars, OTel)."""
        ctx = contextvars.copy_context()
        call = functools.partial(ctx.run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def _in_daemon_thread(self, fn: Callable[[], Any]) -> Any:
        """Run a sync agent in its own daemon thread (with the caller's context): a rollout that is
        abandoned (timeout, shutdown) cannot keep the process alive at exit, as a pool thread would."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        ctx = contextvars.copy_context()
        returned = threading.Event()

        def settle(ok: bool, value: Any) -> None:
            if not fut.done():
                fut.set_result(value) if ok else fut.set_exception(value)

        def target() -> None:
            try:
                value = ctx.run(fn)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                ok, value = False, exc
            else:
                ok = True
            returned.set()
            with contextlib.suppress(RuntimeError):  # the runner's loop closed while this agent hung
                loop.call_soon_threadsafe(settle, ok, value)
                loop.call_soon_threadsafe(self._thread_returned, thread)

        thread = threading.Thread(target=target, name=f"agl-agent-{self.worker_id}", daemon=True)
        thread.start()
        try:
            return await fut
        except asyncio.CancelledError:
            if not returned.is_set():  # given up on (timeout, lost, shutdown), but it runs on
                self._hung.add(thread)
                self.stats.hung = len(self._hung)
            raise

    def _thread_returned(self, thread: threading.Thread) -> None:
        if thread in self._hung:
            self._hung.discard(thread)
            self.stats.hung = len(self._hung)
            log.info(
                "agl runner %s: a hung agent thread returned (%d still hung)", self.worker_id, len(self._hung)
            )

    async def _pause_while_hung(self) -> bool:
        """Claim nothing while ``max_hung`` given-up sync agents still run; False: stop claiming."""
        if not self._hung_warned:
            self._hung_warned = True
            log.warning(
                "agl runner %s: %d sync agent threads are still running after their rollouts were given "
                "up (timeout, lost lease or shutdown); Python cannot stop a thread, so no new work is "
                "claimed until fewer than %d remain%s. Make the agent honour a timeout of its own (e.g. on "
                "its HTTP calls), or write it async so the runner can cancel it.",
                self.worker_id,
                len(self._hung),
                self.max_hung,
                "" if not self._idle_exit else " (until_idle: the runner exits)",
            )
        if self._idle_exit:
            return False
        while len(self._hung) >= self.max_hung and not self._stop.is_set():
            await asyncio.sleep(0.1)
        self._hung_warned = False
        return True

    def _take_slot(self) -> bool:
        if self._remaining is None:
            return True
        if self._remaining <= 0:
            return False
        self._remaining -= 1
        return True

    async def _worker(self, index: int) -> None:
        assert self._stop_evt is not None
        while not self._stop.is_set():
            if self._gate.down is not None and not self._idle_exit:  # until_idle: fail fast, exit
                await self._gate.wait(self._stop_evt, functools.partial(self.store.get_resources, None))
                self._resources.pop(None, None)  # "the latest" may have changed meanwhile
                continue
            if self._store_gate.down:
                await self._store_gate.wait(self._stop_evt)
                continue
            if len(self._hung) >= self.max_hung:
                if not await self._pause_while_hung():
                    return
                continue
            if not self._take_slot():
                return
            try:
                claim: Claim | None = await self._blocking(
                    self.store.claim, self.worker_id, timeout_s=self.claim_timeout_s, modes=self.modes
                )
            except Exception as exc:  # noqa: BLE001 - a store hiccup must not kill the worker
                self._give_back_slot()
                if not self._store_gate.note(exc):  # unreachable: one line, then wait for it
                    log.warning("agl runner %s: claim failed: %r", self.worker_id, exc)
                    await asyncio.sleep(min(1.0, self.claim_timeout_s or 0.1))
                continue
            if claim is None:
                self._give_back_slot()
                if self._idle_exit:
                    return
                continue
            self.stats.claimed += 1
            if self._stop.is_set():
                await self._finish(claim, "failed", _shutdown_error(), released=True)
                continue
            await self._run_claim(claim)

    def _give_back_slot(self) -> None:
        if self._remaining is not None:
            self._remaining += 1

    async def _resources_for(self, version: int | None) -> Resources | None:
        if version not in self._resources:
            try:
                self._resources[version] = await self._blocking(self.store.get_resources, version)
            except Exception as exc:  # noqa: BLE001
                log.warning("agl runner: resources version %s unavailable: %r", version, exc)
                return None
        return self._resources[version]

    def _timeout_for(self, claim: Claim) -> float | None:
        """The rollout's time limit here: the smallest of the runner's, the agent's and the rollout's.
        The rollout's own ``config.timeout_s`` is the store's too, which ends the attempt ``timed_out``
        as a backstop for a dead runner; a live runner stops the agent a moment earlier
        (:func:`report_margin`), so its own verdict (a call still waiting on the engine, or the agent's
        slow code: agl.adapter.failures) ends the attempt, not the store's blind one."""
        store_limit = claim.rollout.config.timeout_s
        limits = [t for t in (self.timeout_s, self.agent.timeout_s) if t]
        if store_limit:
            limits.append(store_limit - report_margin(store_limit))
        return min(limits) if limits else None

    async def _run_claim(self, claim: Claim) -> None:
        rollout, attempt = claim.rollout, claim.attempt
        rid, number = rollout.id, attempt.number
        resources = rollout_resources(await self._resources_for(rollout.resources_version), rid, number)
        agent_task = asyncio.create_task(self._call_agent(rollout.input, resources, rid, number))
        hb_every = self.heartbeat_s or max(0.05, rollout.config.lease_s / 3.0)
        hb_task = asyncio.create_task(self._heartbeat(rid, number, hb_every))
        stop_task = asyncio.create_task(self._wait_for_release())
        timeout = self._timeout_for(claim)
        status, error, reward = "succeeded", None, None
        try:
            done, _ = await asyncio.wait(
                {agent_task, hb_task, stop_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if agent_task in done:
                reward = agent_task.result()  # raises the agent's exception, already recorded as a span
            elif hb_task in done:
                hb_task.result()
                raise _Lost("the attempt ended in the store")
            elif stop_task in done:
                raise _Shutdown()
            else:
                raise asyncio.TimeoutError()
        except _Lost as exc:
            agent_task.cancel()
            self.stats.lost += 1
            log.warning("agl runner: rollout %s attempt %d was lost (%s); dropping it", rid, number, exc)
            return
        except _Shutdown:
            agent_task.cancel()
            await self._record_in_context(
                rid, number, _ShutdownError("worker shutting down before the rollout finished")
            )
            await self._finish(claim, "failed", _shutdown_error(), released=True)
            return
        except asyncio.TimeoutError:
            agent_task.cancel()
            from agl.tracing.provider import open_llm_calls

            # a call still waiting on the engine: the infrastructure's failure (agl.adapter.failures)
            waiting = open_llm_calls(rid, number)
            why = f" while {waiting} LLM call(s) waited on a reply" if waiting else ""
            limit = min(
                t for t in (self.timeout_s, self.agent.timeout_s, claim.rollout.config.timeout_s) if t
            )
            exc = TimeoutError(f"rollout {rid} ran past its {limit:g} s timeout{why}")
            await self._record_in_context(rid, number, exc, infra=True if waiting else None)
            status, error = "failed", AttemptError(type="TimeoutError", message=str(exc))
            self.stats.timed_out += 1
        except Exception as exc:  # noqa: BLE001 - the agent's own failure (or its endpoint's)
            if self._gate.note(exc, resources):
                self.stats.endpoint_pauses = self._gate.waits
            status, error = (
                "failed",
                AttemptError(
                    type=type(exc).__qualname__,
                    message=str(exc),
                    traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                ),
            )
        finally:
            hb_task.cancel()
            stop_task.cancel()
        if reward is not None:
            self.stats.rewards.append(reward)
        await self._finish(claim, status, error)

    async def _wait_for_release(self) -> None:
        """Completes when in-flight work must be handed back (hard stop, or grace period over)."""
        assert self._stop_evt is not None and self._hard_evt is not None
        await self._stop_evt.wait()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._hard_evt.wait(), self.grace_s)

    async def _heartbeat(self, rollout_id: str, attempt: int, every: float) -> None:
        from agl.store.base import ConflictError, NotFoundError

        while True:
            await asyncio.sleep(every)
            try:
                await self._blocking(self.store.heartbeat, rollout_id, attempt)
            except (ConflictError, NotFoundError):
                return  # the attempt ended: the caller treats this as lost
            except Exception as exc:  # noqa: BLE001 - transient: the lease has slack for a retry
                log.warning("agl runner: heartbeat for %s/%d failed: %r", rollout_id, attempt, exc)

    async def _call_agent(
        self, task_input: Any, resources: Resources | None, rid: str, number: int
    ) -> float | None:
        agent = self.agent
        if not agent.is_async:

            def in_thread() -> float | None:
                with _invoke(rid, number, resources):
                    return _settle(agent.invoke(task_input, resources))

            return await self._in_daemon_thread(in_thread)
        with _invoke(rid, number, resources):
            return _settle(await agent.invoke(task_input, resources))

    async def _record_in_context(
        self, rid: str, number: int, exc: BaseException, infra: bool | None = None
    ) -> None:
        """An error the runner itself detected (timeout, shutdown), recorded on the rollout's trace
        (``infra``: as ``agl.emit_exception`` takes it)."""
        from agl.tracing.emit import emit_exception

        def record() -> None:
            with _invoke(rid, number, None, span=False):
                emit_exception(exc, infra=infra)

        try:
            await self._blocking(record)
        except Exception as err:  # noqa: BLE001
            log.debug("agl runner: could not record %r: %r", exc, err)

    async def _finish(
        self, claim: Claim, status: str, error: AttemptError | None, *, released: bool = False
    ) -> None:
        from agl.store.base import ConflictError, NotFoundError
        from agl.tracing.provider import flush

        rid, number = claim.rollout.id, claim.attempt.number
        # The flush guarantee: the attempt's spans are stored before its status changes. Only this
        # attempt's: other rollouts' queued (or stuck) spans do not hold its end back.
        if not await self._blocking(flush, 30.0, rollout_id=rid, attempt=number):
            log.warning("agl runner: spans of %s/%d not all stored before finishing", rid, number)
        if not released:
            await self._blocking(self._attribution.after_attempt, rid, number)
        try:
            await self._blocking(self.store.finish_attempt, rid, number, status, error=error)
        except (ConflictError, NotFoundError) as exc:
            self.stats.lost += 1
            log.warning("agl runner: could not finish %s/%d (%s): the store ended it first", rid, number, exc)
            return
        except Exception as exc:  # noqa: BLE001
            self.stats.errors.append(f"{rid}/{number}: finish failed: {exc!r}")
            log.error("agl runner: finishing %s/%d failed: %r", rid, number, exc)
            return
        if released:
            self.stats.released += 1
        elif status == "succeeded":
            self.stats.succeeded += 1
        else:
            self.stats.failed += 1
            if error is not None:
                self.stats.errors = [
                    *self.stats.errors[-9:],
                    f"{rid}/{number}: {error.type}: {error.message}",
                ]


class _ShutdownError(RuntimeError):
    pass


def instrument_imported_frameworks() -> list[str]:
    """Instrument the integrations whose framework the (just loaded) agent module imported (a failure
    raises), and the others when their framework is imported later (``agl.instrument()``'s post-import
    hooks): importing every installed framework only to instrument it costs seconds each."""
    import agl
    from agl.instrumentation import available_instrumentors, is_installed
    from agl.instrumentation.registry import is_imported

    chosen = [
        name for name, cls in available_instrumentors().items() if is_installed(cls) and is_imported(cls)
    ]
    done = agl.instrument(*chosen) if chosen else []
    agl.instrument()
    return done


def _shutdown_error() -> AttemptError:
    return AttemptError(
        type="WorkerShutdown", message="the runner stopped before the rollout finished; requeued"
    )
