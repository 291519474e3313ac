"""Tracer provider, rollout context and span export from OpenTelemetry to a Store (DESIGN §4).

agl rides on the application's OpenTelemetry setup instead of replacing it: ``setup_tracing`` uses
the global SDK ``TracerProvider`` when the application has one (and only creates and sets one when it
does not), then *adds* one span processor, once per provider, which does two jobs:

- ``RolloutSpanProcessor`` stamps ``agl.rollout.id`` / ``agl.attempt`` on every span at start, from
  the current ``rollout_context`` (a contextvar) or from OTel baggage (a remote caller's context);
- with a store, its ``StoreSpanProcessor`` hands finished spans of a rollout to a worker thread that
  writes them to the Store in batches: off the agent's hot path, bounded in memory; spans that do not
  fit are dropped, counted (``stats()``) and logged once. ``flush()`` waits until every ended span is
  stored, and the provider's shutdown (at interpreter exit too) drains the queue.

The user's own processors and exporters (Jaeger, Phoenix, Langfuse...) are never removed or replaced,
so they keep receiving every span, agl's included.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import time
import uuid
import weakref
from collections import defaultdict, deque
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Status, StatusCode

from agl import semconv
from agl.tracing.spanconv import MissingRolloutError, _raw_attributes, _rollout_of, span_from_otel
from agl.types import Span

if TYPE_CHECKING:
    from agl.store.base import Store

__all__ = [
    "RolloutSpanProcessor",
    "StoreSpanExporter",
    "StoreSpanProcessor",
    "current_rollout",
    "flush",
    "get_tracer",
    "get_tracer_provider",
    "open_llm_calls",
    "reset_tracing",
    "rollout_context",
    "setup_tracing",
    "span_from_otel",
    "stats",
]

logger = logging.getLogger(__name__)

_ROLLOUT: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("agl_rollout", default=None)

_ROLLOUT_KEY = semconv.AGL_ROLLOUT_ID
_ATTEMPT_KEY = semconv.AGL_ATTEMPT

#: the span names of an LLM call (client or gateway side), as agl.adapter.failures reads them
_LLM_SPANS = frozenset({semconv.SPAN_CHAT, semconv.OP_TEXT_COMPLETION, semconv.OP_GENERATE_CONTENT})
_open_calls: dict[tuple[str, int], int] = {}
_open_lock = threading.Lock()


def _count_call(attributes: Any, delta: int) -> None:
    """One LLM call span of a rollout started (+1) or ended (-1) in this process."""
    try:
        key = (str(attributes[_ROLLOUT_KEY]), int(attributes[_ATTEMPT_KEY]))
    except (KeyError, TypeError, ValueError):
        return
    with _open_lock:
        n = _open_calls.get(key, 0) + delta
        if n > 0:
            _open_calls[key] = n
        else:
            _open_calls.pop(key, None)


def open_llm_calls(rollout_id: str, attempt: int) -> int:
    """How many LLM call spans of ``rollout_id``'s ``attempt`` this process has started and not ended:
    calls still waiting on a reply. The runner asks when a rollout runs past its timeout: a timeout
    while a call waits on the engine is the infrastructure's failure, not the agent's."""
    with _open_lock:
        return _open_calls.get((rollout_id, int(attempt)), 0)


def _log_once(key: str, level: int, msg: str, *args: Any) -> None:
    """Log a recurring problem once per process: a hot loop must not flood the log."""
    if key in _logged:
        return
    _logged.add(key)
    logger.log(level, msg, *args)


_logged: set[str] = set()


# ------------------------------------------------------------------------------------ rollout context


def _rollout_from_baggage(ctx: otel_context.Context | None) -> tuple[str, int] | None:
    rollout_id = baggage.get_baggage(semconv.BAGGAGE_ROLLOUT_ID, ctx)
    attempt = baggage.get_baggage(semconv.BAGGAGE_ATTEMPT, ctx)
    if rollout_id is None or attempt is None:
        return None
    try:
        number = int(str(attempt))
    except ValueError:
        return None
    return (str(rollout_id), number) if number >= 1 and rollout_id else None


def current_rollout() -> tuple[str, int] | None:
    """``(rollout_id, attempt)`` of the code running now, or None outside any rollout.

    Read from the ``rollout_context`` contextvar, else from OTel baggage (so a process that extracted
    a remote caller's ``baggage`` header knows the rollout too).
    """
    value = _ROLLOUT.get()
    return value if value is not None else _rollout_from_baggage(None)


def _check_rollout(rollout_id: Any, attempt: Any) -> tuple[str, int]:
    from agl.types import _check_id

    _check_id(rollout_id, "rollout id")
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise ValueError(f"attempt must be an integer >= 1, got {attempt!r}")
    return rollout_id, attempt


class rollout_context:  # noqa: N801 - used like a function: ``with agl.rollout_context(...)``
    """Mark everything that runs inside as part of one rollout attempt (``with`` and ``async with``).

    Sets a contextvar (copied into threads started through ``contextvars.copy_context().run`` and into
    asyncio tasks) and OTel baggage (``agl.rollout.id``, ``agl.attempt``), which the openai integration
    sends as the W3C ``baggage`` header so the gateway and other processes know the rollout too. It
    also opens an ``agl.rollout`` span, so all spans of the run share one trace; when a span is already
    active, the rollout span becomes its child instead of a new root.
    """

    def __init__(self, rollout_id: str, attempt: int = 1, *, span: bool = True) -> None:
        self.rollout_id, self.attempt = _check_rollout(rollout_id, attempt)
        self._open_span = span
        self.span: trace.Span | None = None
        self._tokens: tuple[Any, ...] | None = None

    def __enter__(self) -> rollout_context:
        if self._tokens is not None:
            raise RuntimeError("this rollout_context is already entered; create one per use")
        var_token = _ROLLOUT.set((self.rollout_id, self.attempt))
        ctx = baggage.set_baggage(semconv.BAGGAGE_ROLLOUT_ID, self.rollout_id)
        ctx = baggage.set_baggage(semconv.BAGGAGE_ATTEMPT, str(self.attempt), ctx)
        baggage_token = otel_context.attach(ctx)
        span_token = None
        if self._open_span:
            self.span = get_tracer(__name__).start_span(
                semconv.SPAN_ROLLOUT,
                attributes={_ROLLOUT_KEY: self.rollout_id, _ATTEMPT_KEY: self.attempt},
            )
            span_token = otel_context.attach(trace.set_span_in_context(self.span))
        self._tokens = (var_token, baggage_token, span_token)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._tokens is None:
            return
        var_token, baggage_token, span_token = self._tokens
        self._tokens = None
        if self.span is not None:
            if exc is not None:
                self.span.record_exception(exc)
                self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            self.span.end()
        for token in (span_token, baggage_token):
            if token is not None:
                try:
                    otel_context.detach(token)
                except Exception:  # noqa: BLE001 - exited in another context; nothing to restore
                    pass
        try:
            _ROLLOUT.reset(var_token)
        except ValueError:  # exited in a different context than entered
            _ROLLOUT.set(None)

    async def __aenter__(self) -> rollout_context:
        return self.__enter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"rollout_context({self.rollout_id!r}, {self.attempt})"


class StoreSpanExporter(SpanExporter):
    """An OTel ``SpanExporter`` that writes spans of rollouts into an agl Store.

    Spans without a rollout are counted (``skipped``) and left out. A batch the store refuses is
    retried per (rollout, attempt) so one unknown rollout cannot lose the others' spans; transport
    errors are retried with the same idempotency key, so a retried write is applied once.
    """

    def __init__(self, store: Store, *, retries: int = 3) -> None:
        self.store = store
        self.retries = retries
        self.exported = 0
        self.skipped = 0
        self.failed = 0
        self._lock = threading.Lock()

    def convert(self, spans: Sequence[ReadableSpan]) -> list[Span]:
        out: list[Span] = []
        skipped = invalid = 0
        for otel_span in spans:
            try:
                out.append(span_from_otel(otel_span))
            except MissingRolloutError:
                skipped += 1
            except ValueError as exc:
                invalid += 1
                _log_once(
                    "invalid-span", logging.WARNING, "agl: span %r cannot be stored: %s", otel_span.name, exc
                )
        with self._lock:
            self.skipped += skipped
            self.failed += invalid
        return out

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            converted = self.convert(spans)
        except Exception as exc:  # noqa: BLE001 - never raise into the SDK
            _log_once("convert-error", logging.ERROR, "agl: converting spans failed: %r", exc)
            with self._lock:
                self.failed += len(spans)
            return SpanExportResult.FAILURE
        return self.export_spans(converted)

    def export_spans(self, spans: Sequence[Span]) -> SpanExportResult:
        """Write already-converted spans (the batching processor converts off the hot path)."""
        if not spans:
            return SpanExportResult.SUCCESS
        from agl.store.base import StoreError

        try:
            self._add(spans)
            return SpanExportResult.SUCCESS
        except StoreError:
            pass  # one group may be the culprit: retry group by group below
        except Exception as exc:  # noqa: BLE001
            _log_once(
                "store-error", logging.ERROR, "agl: writing %d spans to the store failed: %r", len(spans), exc
            )
            with self._lock:
                self.failed += len(spans)
            return SpanExportResult.FAILURE
        groups: dict[tuple[str, int], list[Span]] = defaultdict(list)
        for s in spans:
            groups[(s.rollout_id, s.attempt)].append(s)
        ok = True
        for (rollout_id, attempt), group in groups.items():
            try:
                self._add(group)
            except Exception as exc:  # noqa: BLE001
                ok = False
                _log_once(
                    f"refused:{type(exc).__name__}",
                    logging.WARNING,
                    "agl: the store refused %d spans of rollout %s attempt %d: %s",
                    len(group),
                    rollout_id,
                    attempt,
                    exc,
                )
                with self._lock:
                    self.failed += len(group)
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def _add(self, spans: Sequence[Span]) -> None:
        from agl.store.base import StoreError

        key = uuid.uuid4().hex
        for i in range(self.retries + 1):
            try:
                self.store.add_spans(spans, idempotency_key=key)
                with self._lock:
                    self.exported += len(spans)
                return
            except StoreError:
                raise
            except Exception:
                if i == self.retries:
                    raise
                time.sleep(0.05 * 2**i)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# -------------------------------------------------------------------------------------- processors


class RolloutSpanProcessor(SpanProcessor):
    """Stamps ``agl.rollout.id``/``agl.attempt`` on every span when it starts; with ``export`` set,
    also hands every finished span to that ``StoreSpanProcessor``.

    The rollout comes from the parent context's baggage when one is given explicitly (a span started
    from an extracted remote context), else from the current ``rollout_context``, else from the
    current baggage. Spans that already carry a rollout keep it.

    ``setup_tracing`` registers this one processor per provider and attaches the store export to it,
    rather than adding a second processor: the SDK calls every processor's ``on_start`` and
    ``on_end`` for every span, and one processor doing both is the cheaper hot path.
    """

    def __init__(self, export: StoreSpanProcessor | None = None) -> None:
        self.export = export

    def on_start(self, span: Any, parent_context: otel_context.Context | None = None) -> None:
        attributes = getattr(span, "_attributes", None)  # the SDK span's own mapping: no proxy per span
        if attributes is None:
            attributes = span.attributes
        if attributes is None or _ROLLOUT_KEY not in attributes:
            # else instrumentation that knows the rollout set it already (the openai wrapper does)
            found = _rollout_from_baggage(parent_context) if parent_context is not None else None
            if found is None:
                found = _ROLLOUT.get() or _rollout_from_baggage(None)
            if found is None:
                return
            span.set_attributes({_ROLLOUT_KEY: found[0], _ATTEMPT_KEY: found[1]})
        if span.name in _LLM_SPANS:  # a call now waiting on its reply (open_llm_calls)
            _count_call(span.attributes, +1)

    def on_end(self, span: ReadableSpan) -> None:
        if span.name in _LLM_SPANS:
            _count_call(span.attributes, -1)
        export = self.export
        if export is not None:
            export.on_end(span)

    def shutdown(self) -> None:
        export = self.export
        if export is not None:
            export.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        export = self.export
        return export.force_flush(timeout_millis) if export is not None else True


_Key = tuple[str, int]  # (rollout id, attempt)


class StoreSpanProcessor(SpanProcessor):
    """Batches finished spans of rollouts into a Store from a worker thread, bounded in memory.

    ``on_end`` only appends to a bounded queue (the agent never waits for the store); when it is full
    the span is dropped, counted in ``dropped`` and logged once. Spans are queued per (rollout,
    attempt). The worker writes one attempt's spans per ``add_spans``, as soon as ``max_batch_size``
    spans wait, else every ``schedule_delay_s``. ``flush(rollout_id=, attempt=)`` writes that
    attempt's queued spans itself, in the calling thread, so the end of one attempt never waits on
    other rollouts' spans nor on a store write that is stuck for another rollout. One attempt's spans
    are written by one thread at a time (``_busy``), so they reach the store in the order they ended.
    """

    def __init__(
        self,
        exporter: StoreSpanExporter,
        *,
        max_queue_size: int = 16384,
        max_batch_size: int = 512,
        schedule_delay_s: float = 0.5,
    ) -> None:
        if max_queue_size < 1 or max_batch_size < 1 or schedule_delay_s <= 0:
            raise ValueError("max_queue_size and max_batch_size must be >= 1 and schedule_delay_s > 0")
        self.exporter = exporter
        self.max_queue_size = max_queue_size
        self.max_batch_size = max_batch_size
        self.schedule_delay_s = schedule_delay_s
        self.dropped = 0
        self.skipped = 0
        self._cond = threading.Condition(threading.Lock())
        self._reset_queue()
        self._shutdown = False
        self._worker: threading.Thread | None = None
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (p := ref()) is not None and p._after_fork())

    def _reset_queue(self) -> None:
        self._queues: dict[_Key, deque[ReadableSpan]] = {}  # insertion order: the oldest key first
        self._busy: set[_Key] = set()  # keys whose spans a thread is writing now
        self._size = 0  # spans queued, all keys
        self._done = 0  # spans written (stored or failed), ever

    def _after_fork(self) -> None:
        """In a forked child the worker thread is gone and the lock may be held: start afresh."""
        self._cond = threading.Condition(threading.Lock())
        self._reset_queue()
        self._worker = None

    # The store may change between runs (tests, a runner re-pointed at another store).
    def set_store(self, store: Store) -> None:
        if store is self.exporter.store:
            return
        self.flush()
        self.exporter.store = store

    def on_start(self, span: Any, parent_context: otel_context.Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        attributes = _raw_attributes(span)
        key = _rollout_of(attributes) if attributes else None
        if key is None:
            self.skipped += 1
            return
        with self._cond:
            if self._shutdown:
                return
            if self._size >= self.max_queue_size:
                self.dropped += 1
                _log_once(
                    "queue-full",
                    logging.WARNING,
                    "agl: span export queue full (%d spans); dropping spans (see agl.tracing.provider.stats())",
                    self.max_queue_size,
                )
                return
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = deque()
            queue.append(span)
            self._size += 1
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="agl-span-export", daemon=True)
                self._worker.start()
            if self._size >= self.max_batch_size:
                self._cond.notify_all()

    def _ready(self) -> int:
        """Spans queued under keys no thread is writing now (lock held)."""
        return sum(len(q) for k, q in self._queues.items() if k not in self._busy)

    def _take(self, key: _Key | None, limit: int) -> tuple[_Key, list[ReadableSpan]] | None:
        """Up to ``limit`` queued spans of ``key`` (None: the oldest key not being written), the key
        marked busy; None when there is nothing to take (lock held)."""
        if key is None:
            key = next((k for k in self._queues if k not in self._busy), None)
        queue = self._queues.get(key) if key is not None else None
        if key is None or not queue or key in self._busy:
            return None
        batch = [queue.popleft() for _ in range(min(limit, len(queue)))]
        del self._queues[key]
        if queue:
            self._queues[key] = queue  # to the end of the line: the keys take turns
        self._busy.add(key)
        self._size -= len(batch)
        return key, batch

    def _write(self, key: _Key, batch: list[ReadableSpan]) -> None:
        try:
            for i in range(0, len(batch), self.max_batch_size):
                chunk = batch[i : i + self.max_batch_size]
                self.exporter.export_spans(self.exporter.convert(chunk))
        except Exception as exc:  # noqa: BLE001 - the writer must survive anything
            _log_once("worker-error", logging.ERROR, "agl: span export failed: %r", exc)
        finally:
            with self._cond:
                self._done += len(batch)
                self._busy.discard(key)
                self._cond.notify_all()

    def _run(self) -> None:
        due = False  # a batch was due: write everything ready before waiting again
        while True:
            with self._cond:
                if not due:
                    self._wait_until_due()
                taken = self._take(None, self.max_batch_size)
                if taken is None:
                    if self._shutdown:
                        return
                    if due and self._size:  # what is left is being written by flushing threads
                        self._cond.wait(self.schedule_delay_s)
                    due = False
                    continue
                due = True
            self._write(*taken)

    def _wait_until_due(self) -> None:
        """Wait (lock held) until a full batch is ready, or spans waited ``schedule_delay_s``, or
        shutdown."""
        deadline = time.monotonic() + self.schedule_delay_s
        while not self._shutdown:
            ready = self._ready()
            if ready >= self.max_batch_size:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if ready:
                    return
                remaining = self.schedule_delay_s
                deadline = time.monotonic() + remaining
            self._cond.wait(remaining)

    def flush(
        self, timeout_s: float | None = 30.0, *, rollout_id: str | None = None, attempt: int | None = None
    ) -> bool:
        """Block until every span that ended before this call is stored (or failed); False on timeout.

        With ``rollout_id`` and ``attempt``, only that attempt's spans: this thread writes them itself
        (after any batch of them another thread is writing), whatever else is queued or stuck.
        The timeout bounds the waiting; a write this thread started runs to its end (the store's
        own timeouts bound it).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if rollout_id is not None or attempt is not None:
            return self._flush_key(_check_rollout(rollout_id, attempt), deadline)
        with self._cond:
            keys = list(dict.fromkeys([*self._queues, *self._busy]))
        ok = True
        for key in keys:
            ok = self._flush_key(key, deadline) and ok
        return ok

    def _flush_key(self, key: _Key, deadline: float | None) -> bool:
        with self._cond:
            while key in self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            taken = self._take(key, self.max_queue_size)
        if taken is not None:
            self._write(*taken)
        return True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.flush(timeout_millis / 1000)

    def shutdown(self) -> None:
        self.flush(10.0)
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()


# ------------------------------------------------------------------------------------------ setup


class _Pipeline:
    def __init__(self) -> None:
        self.rollout = RolloutSpanProcessor()
        self.export: StoreSpanProcessor | None = None


_lock = threading.RLock()
_pipelines: weakref.WeakKeyDictionary[TracerProvider, _Pipeline] = weakref.WeakKeyDictionary()
_provider: TracerProvider | None = None
_tracers: dict[tuple[int, str], trace.Tracer] = {}


def _resolve_provider(tracer_provider: Any) -> TracerProvider:
    if tracer_provider is not None:
        if not isinstance(tracer_provider, TracerProvider):
            raise TypeError(
                "agl needs an OpenTelemetry SDK TracerProvider (opentelemetry.sdk.trace.TracerProvider), "
                f"got {type(tracer_provider).__name__}"
            )
        return tracer_provider
    if _provider is not None:
        return _provider  # sticky: instrument() and the runner must agree on one provider
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current  # the application's own: add to it, never replace it
    provider = TracerProvider()
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        logger.warning(
            "agl: the global tracer provider is a %s that cannot be replaced; agl's spans use their own "
            "SDK provider, so spans a framework makes through the global provider are not recorded",
            type(trace.get_tracer_provider()).__name__,
        )
    return provider


def setup_tracing(
    store: Store | None = None,
    tracer_provider: TracerProvider | None = None,
    *,
    max_queue_size: int = 16384,
    max_batch_size: int = 512,
    schedule_delay_s: float = 0.5,
) -> TracerProvider:
    """Make spans carry their rollout and (with a store) reach it; returns the provider agl uses.

    The provider is ``tracer_provider`` when given; else the one an earlier call chose; else the
    application's global SDK provider; else a new SDK provider, set as the global one (so spans that
    frameworks make through the global provider are recorded too). Idempotent: the processors are added once per provider. Giving a different store re-points the
    export (after flushing what was queued for the previous one). The queue settings apply when the
    export processor is first created.
    """
    global _provider
    with _lock:
        provider = _resolve_provider(tracer_provider)
        pipeline = _pipelines.get(provider)
        if pipeline is None:
            pipeline = _Pipeline()
            provider.add_span_processor(pipeline.rollout)
            _pipelines[provider] = pipeline
        if store is not None:
            if pipeline.export is None:
                pipeline.export = StoreSpanProcessor(
                    StoreSpanExporter(store),
                    max_queue_size=max_queue_size,
                    max_batch_size=max_batch_size,
                    schedule_delay_s=schedule_delay_s,
                )
                pipeline.rollout.export = pipeline.export  # one processor per span, not two
            else:
                pipeline.export.set_store(store)
        _provider = provider
        return provider


def get_tracer_provider() -> trace.TracerProvider:
    """The provider agl makes its spans with: the last ``setup_tracing`` one, else the global one."""
    return _provider if _provider is not None else trace.get_tracer_provider()


def get_tracer(name: str, version: str | None = None) -> trace.Tracer:
    """A tracer from agl's provider (cached: emit and rollout spans are made on the hot path)."""
    provider = get_tracer_provider()
    key = (id(provider), name)
    tracer = _tracers.get(key)
    if tracer is None or getattr(tracer, "_agl_provider", provider) is not provider:
        tracer = provider.get_tracer(name, version)
        try:
            tracer._agl_provider = provider  # type: ignore[attr-defined]
        except AttributeError:
            pass
        _tracers[key] = tracer
    return tracer


def flush(
    timeout_s: float | None = 30.0, *, rollout_id: str | None = None, attempt: int | None = None
) -> bool:
    """Block until every span that ended before the call is in the store; False if time ran out.

    With ``rollout_id`` and ``attempt``, only that attempt's spans, written by the calling thread:
    the runner calls this before finishing an attempt, so the attempt's spans are stored before its
    status changes, without waiting on other rollouts' spans. Only agl's store export is flushed,
    not the user's other exporters.
    """
    if rollout_id is not None or attempt is not None:
        _check_rollout(rollout_id, attempt)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with _lock:
        processors = [p.export for p in _pipelines.values() if p.export is not None]
    ok = True
    for processor in processors:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ok = processor.flush(remaining, rollout_id=rollout_id, attempt=attempt) and ok
    return ok


def stats() -> dict[str, int]:
    """Counters of the store export: exported, dropped (queue full), skipped (no rollout), failed."""
    with _lock:
        processors = [p.export for p in _pipelines.values() if p.export is not None]
    out = {"exported": 0, "dropped": 0, "skipped": 0, "failed": 0, "queued": 0}
    for p in processors:
        out["exported"] += p.exporter.exported
        out["failed"] += p.exporter.failed
        out["skipped"] += p.skipped + p.exporter.skipped
        out["dropped"] += p.dropped
        out["queued"] += p._size
    return out


def reset_tracing() -> None:
    """Flush and detach agl's store export and forget agl's provider (tests).

    The rollout-stamping processor stays on providers it was added to (OTel cannot remove processors);
    it is harmless. The global OTel provider is left as it is.
    """
    global _provider
    with _lock:
        for pipeline in list(_pipelines.values()):
            if pipeline.export is not None:
                pipeline.rollout.export = None
                pipeline.export.shutdown()
                pipeline.export = None
        _provider = None
        _tracers.clear()
