"""agl.tracing.provider: rollout context, span stamping, export to the store, flush, bounds, user exporters."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest
from opentelemetry import baggage, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

import agl
from agl import semconv
from agl.store.memory import MemoryStore
from agl.tracing import provider as tracing
from agl.tracing.provider import (
    MissingRolloutError,
    StoreSpanExporter,
    current_rollout,
    rollout_context,
    span_from_otel,
)
from agl.types import NewRollout, Span


@pytest.fixture()
def store() -> Iterator[MemoryStore]:
    s = MemoryStore()
    yield s
    s.close()


def _claim(store: MemoryStore, rollout_id: str) -> tuple[str, int]:
    store.enqueue([NewRollout(id=rollout_id)])
    claim = store.claim("worker")
    assert claim is not None and claim.rollout.id == rollout_id
    return rollout_id, claim.attempt.number


@pytest.fixture()
def user() -> InMemorySpanExporter:
    """An exporter the application installed itself (stands for Jaeger/Phoenix/Langfuse)."""
    return InMemorySpanExporter()


@pytest.fixture()
def provider(user: InMemorySpanExporter) -> Iterator[TracerProvider]:
    tp = TracerProvider(resource=Resource.create({"service.name": "my-agent"}))
    tp.add_span_processor(SimpleSpanProcessor(user))
    yield tp
    tracing.reset_tracing()
    tp.shutdown()


def _tracer() -> trace.Tracer:
    return tracing.get_tracer("tests")


# ---------------------------------------------------------------------------------- rollout context


def test_rollout_context_stamps_spans_and_opens_root(provider, user, store) -> None:
    rid, n = _claim(store, "ro-1")
    tracing.setup_tracing(store, provider)
    assert current_rollout() is None
    with rollout_context(rid, n) as ctx:
        assert current_rollout() == (rid, n)
        with _tracer().start_as_current_span("agent"):
            _tracer().start_span("llm").end()
    assert current_rollout() is None
    _tracer().start_span("outside").end()
    assert tracing.flush(10)
    spans = {s.name: s for s in store.query_spans(rollout_id=rid)}
    assert set(spans) == {semconv.SPAN_ROLLOUT, "agent", "llm"}
    root = spans[semconv.SPAN_ROLLOUT]
    assert root.parent_id is None
    assert spans["agent"].parent_id == root.span_id and spans["llm"].parent_id == spans["agent"].span_id
    assert {s.trace_id for s in spans.values()} == {root.trace_id}
    assert all(
        s.attributes[semconv.AGL_ROLLOUT_ID] == rid and s.attributes[semconv.AGL_ATTEMPT] == n
        for s in spans.values()
    )
    assert ctx.span is not None
    # the span outside any rollout went only to the user's exporter
    assert "outside" in [s.name for s in user.get_finished_spans()]
    assert tracing.stats()["skipped"] >= 1


def test_rollout_context_under_existing_parent_is_a_child(provider, store) -> None:
    rid, n = _claim(store, "ro-2")
    tracing.setup_tracing(store, provider)
    with _tracer().start_as_current_span("request") as outer:
        with rollout_context(rid, n):
            pass
    tracing.flush(10)
    (root,) = store.query_spans(rollout_id=rid)
    assert root.parent_id == format(outer.get_span_context().span_id, "016x")


def test_rollout_context_records_agent_failure(provider, store) -> None:
    rid, n = _claim(store, "ro-3")
    tracing.setup_tracing(store, provider)
    with pytest.raises(KeyError):
        with rollout_context(rid, n):
            raise KeyError("boom")
    tracing.flush(10)
    (root,) = store.query_spans(rollout_id=rid)
    assert root.status.code == "ERROR"
    assert root.events[0].name == "exception"
    assert root.events[0].attributes["exception.type"] == "KeyError"


def test_rollout_context_sets_baggage(provider) -> None:
    tracing.setup_tracing(tracer_provider=provider)
    with rollout_context("ro-b", 3):
        assert baggage.get_baggage(semconv.BAGGAGE_ROLLOUT_ID) == "ro-b"
        assert baggage.get_baggage(semconv.BAGGAGE_ATTEMPT) == "3"
        carrier: dict[str, str] = {}
        W3CBaggagePropagator().inject(carrier)
        assert "agl.rollout.id=ro-b" in carrier["baggage"] and "agl.attempt=3" in carrier["baggage"]
    assert baggage.get_baggage(semconv.BAGGAGE_ROLLOUT_ID) is None


@pytest.mark.parametrize("args", [("", 1), ("bad id!", 1), ("ro", 0), ("ro", True), ("ro", "1"), (None, 1)])
def test_rollout_context_rejects_bad_ids(args) -> None:
    with pytest.raises(ValueError):
        rollout_context(*args)
    assert current_rollout() is None


def test_rollout_context_cannot_be_entered_twice(provider) -> None:
    tracing.setup_tracing(tracer_provider=provider)
    ctx = rollout_context("ro-x", 1)
    with ctx:
        with pytest.raises(RuntimeError, match="already entered"):
            ctx.__enter__()
    assert current_rollout() is None


def test_baggage_from_a_remote_caller_stamps_spans(provider, user) -> None:
    tracing.setup_tracing(tracer_provider=provider)
    remote = W3CBaggagePropagator().extract({"baggage": "agl.rollout.id=ro-remote,agl.attempt=2"})
    _tracer().start_span("server-side", context=remote).end()
    token = __import__("opentelemetry.context", fromlist=["attach"]).attach(remote)
    try:
        assert current_rollout() == ("ro-remote", 2)
        _tracer().start_span("current-baggage").end()
    finally:
        __import__("opentelemetry.context", fromlist=["detach"]).detach(token)
    spans = {s.name: s for s in user.get_finished_spans()}
    for name in ("server-side", "current-baggage"):
        assert spans[name].attributes[semconv.AGL_ROLLOUT_ID] == "ro-remote"
        assert spans[name].attributes[semconv.AGL_ATTEMPT] == 2


def test_context_survives_copy_context_threads(provider, user) -> None:
    tracing.setup_tracing(tracer_provider=provider)
    seen: dict[str, object] = {}

    def work(tag: str) -> None:
        seen[tag] = current_rollout()
        _tracer().start_span(f"thread-{tag}").end()

    threads = []
    for rid in ("ro-t1", "ro-t2"):
        with rollout_context(rid, 1):
            threads.append(threading.Thread(target=contextvars.copy_context().run, args=(work, rid)))
    plain = threading.Thread(target=work, args=("plain",))  # no copied context: no rollout
    for t in [*threads, plain]:
        t.start()
        t.join()
    assert seen == {"ro-t1": ("ro-t1", 1), "ro-t2": ("ro-t2", 1), "plain": None}
    spans = {s.name: s for s in user.get_finished_spans()}
    assert spans["thread-ro-t1"].attributes[semconv.AGL_ROLLOUT_ID] == "ro-t1"
    assert spans["thread-ro-t2"].attributes[semconv.AGL_ROLLOUT_ID] == "ro-t2"
    assert semconv.AGL_ROLLOUT_ID not in spans["thread-plain"].attributes


async def test_context_is_per_asyncio_task(provider, user) -> None:
    tracing.setup_tracing(tracer_provider=provider)

    async def child(tag: str) -> tuple[str, int] | None:
        await asyncio.sleep(0)
        _tracer().start_span(f"child-{tag}").end()
        return current_rollout()

    async def run(rid: str, attempt: int) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
        async with rollout_context(rid, attempt):
            await asyncio.sleep(0)
            task = asyncio.create_task(child(rid))
            inner = current_rollout()
            return inner, await task

    results = await asyncio.gather(run("ro-a", 1), run("ro-b", 2))
    assert results == [(("ro-a", 1), ("ro-a", 1)), (("ro-b", 2), ("ro-b", 2))]
    assert current_rollout() is None
    spans = {s.name: s for s in user.get_finished_spans()}
    assert spans["child-ro-a"].attributes[semconv.AGL_ATTEMPT] == 1
    assert spans["child-ro-b"].attributes[semconv.AGL_ATTEMPT] == 2
    # each child span sits in its own rollout's trace
    roots = {
        s.attributes[semconv.AGL_ROLLOUT_ID]: s
        for s in user.get_finished_spans()
        if s.name == semconv.SPAN_ROLLOUT
    }
    assert spans["child-ro-a"].context.trace_id == roots["ro-a"].context.trace_id
    assert spans["child-ro-b"].context.trace_id == roots["ro-b"].context.trace_id


# ------------------------------------------------------------------------------------ store export


def test_setup_tracing_is_idempotent(provider, store) -> None:
    rid, n = _claim(store, "ro-idem")
    assert tracing.setup_tracing(store, provider) is provider
    assert tracing.setup_tracing(store, provider) is provider
    assert tracing.setup_tracing(tracer_provider=provider) is provider
    with rollout_context(rid, n, span=False):
        _tracer().start_span("once").end()
    tracing.flush(10)
    assert [s.name for s in store.query_spans(rollout_id=rid)] == ["once"]


def test_setup_tracing_rejects_non_sdk_provider() -> None:
    with pytest.raises(TypeError, match="SDK TracerProvider"):
        tracing.setup_tracing(tracer_provider=trace.NoOpTracerProvider())  # type: ignore[arg-type]


def test_flush_guarantees_every_ended_span_is_stored(user, store) -> None:
    provider = TracerProvider()
    # a worker that would otherwise wait 60 s before writing a partial batch
    tracing.setup_tracing(store, provider, schedule_delay_s=60, max_batch_size=10_000)
    try:
        rid, n = _claim(store, "ro-flush")
        with rollout_context(rid, n):
            for i in range(500):
                _tracer().start_span(f"s{i}").end()
        assert tracing.flush(10) is True
        assert len(store.query_spans(rollout_id=rid)) == 501
        assert tracing.stats()["queued"] == 0
    finally:
        tracing.reset_tracing()
        provider.shutdown()


def test_bounded_queue_drops_are_counted_and_logged_once(store, caplog) -> None:
    provider = TracerProvider()
    tracing.setup_tracing(store, provider, max_queue_size=10, schedule_delay_s=60, max_batch_size=10_000)
    tracing._logged.discard("queue-full")
    try:
        rid, n = _claim(store, "ro-drop")
        before = tracing.stats()["dropped"]
        with caplog.at_level(logging.WARNING, logger="agl.tracing.provider"):
            with rollout_context(rid, n, span=False):
                for i in range(50):
                    _tracer().start_span(f"s{i}").end()
        assert tracing.stats()["dropped"] - before == 40
        assert len([r for r in caplog.records if "queue full" in r.getMessage()]) == 1
        tracing.flush(10)
        assert len(store.query_spans(rollout_id=rid)) == 10
    finally:
        tracing.reset_tracing()
        provider.shutdown()


def test_batches_are_written_without_flush(provider, store) -> None:
    tracing.setup_tracing(store, provider)
    rid, n = _claim(store, "ro-batch")
    processor = tracing._pipelines[provider].export
    assert processor is not None
    processor.schedule_delay_s = 0.01
    with rollout_context(rid, n, span=False):
        _tracer().start_span("a").end()
    with processor._cond:  # the worker writes on its own within a few schedule delays
        assert processor._cond.wait_for(lambda: processor._done >= 1, timeout=10)
    assert [s.name for s in store.query_spans(rollout_id=rid)] == ["a"]


def test_user_exporter_still_receives_every_span(provider, user, store) -> None:
    rid, n = _claim(store, "ro-user")
    tracing.setup_tracing(store, provider)
    with rollout_context(rid, n):
        agl.emit_reward(1.0)
    tracing.flush(10)
    assert sorted(s.name for s in user.get_finished_spans()) == sorted(
        [semconv.SPAN_ROLLOUT, semconv.SPAN_REWARD]
    )
    assert len(store.query_spans(rollout_id=rid)) == 2


def test_changing_store_flushes_to_the_old_one_first(provider) -> None:
    first, second = MemoryStore(), MemoryStore()
    for s in (first, second):
        s.enqueue([NewRollout(id="ro-move")])
        s.claim("w")
    tracing.setup_tracing(first, provider, schedule_delay_s=60)
    with rollout_context("ro-move", 1, span=False):
        _tracer().start_span("before").end()
    tracing.setup_tracing(second, provider)
    with rollout_context("ro-move", 1, span=False):
        _tracer().start_span("after").end()
    tracing.flush(10)
    assert [s.name for s in first.query_spans()] == ["before"]
    assert [s.name for s in second.query_spans()] == ["after"]


def test_store_refusal_loses_only_the_refused_rollout(provider, store) -> None:
    rid, n = _claim(store, "ro-known")
    tracing.setup_tracing(store, provider, schedule_delay_s=60)
    before = tracing.stats()["failed"]
    for r in (rid, "ro-unknown"):
        with rollout_context(r, 1, span=False):
            _tracer().start_span(f"span-{r}").end()
    tracing.flush(10)
    assert [s.name for s in store.query_spans()] == ["span-ro-known"]
    assert tracing.stats()["failed"] - before == 1


# ---------------------------------------------------------------------------------- span_from_otel


def test_span_from_otel_keeps_status_events_resource_and_kind(provider, user) -> None:
    tracing.setup_tracing(tracer_provider=provider)
    with rollout_context("ro-conv", 2, span=False):
        with _tracer().start_as_current_span("parent"):
            span = _tracer().start_span(
                "child",
                kind=trace.SpanKind.CLIENT,
                attributes={"tags": ("a", "b"), "nan": float("nan"), "n": 3},
            )
            span.add_event("note", {"k": "v"})
            span.record_exception(RuntimeError("bad"))
            span.set_status(Status(StatusCode.ERROR, "it broke"))
            span.end()
    otel = {s.name: s for s in user.get_finished_spans()}
    converted = span_from_otel(otel["child"])
    assert converted.rollout_id == "ro-conv" and converted.attempt == 2
    assert converted.kind == "CLIENT"
    assert converted.status.code == "ERROR" and converted.status.message == "it broke"
    assert [e.name for e in converted.events] == ["note", "exception"]
    assert converted.events[1].attributes["exception.type"] == "RuntimeError"
    assert converted.resource["service.name"] == "my-agent"
    assert converted.attributes["tags"] == ["a", "b"] and converted.attributes["n"] == 3
    assert converted.attributes["nan"] == "nan"
    ctx = otel["child"].get_span_context()
    assert converted.trace_id == format(ctx.trace_id, "032x") and converted.trace_id.islower()
    assert converted.span_id == format(ctx.span_id, "016x")
    assert converted.parent_id == format(otel["parent"].get_span_context().span_id, "016x")
    assert converted.start_ns == otel["child"].start_time and converted.end_ns == otel["child"].end_time
    # built without per-field validation, yet exactly what validation accepts and keeps
    assert Span.model_validate(converted.model_dump()) == converted


def test_span_from_otel_checks_what_the_sdk_does_not(provider, user) -> None:
    """Conversion skips pydantic validation, so it checks rollout ids, attempts and odd values itself."""
    tracing.setup_tracing(tracer_provider=provider)
    span = _tracer().start_span(
        "s", attributes={"lps": (0.5, float("inf")), "big": 2**70, semconv.AGL_ROLLOUT_ID: "bad id!"}
    )
    span.set_attribute(semconv.AGL_ATTEMPT, 1)
    span.end()
    (otel,) = user.get_finished_spans()
    with pytest.raises(ValueError, match="invalid rollout id"):
        span_from_otel(otel)
    with pytest.raises(ValueError, match="invalid attempt"):
        span_from_otel(otel, rollout_id="ro-ok", attempt=0)
    ok = span_from_otel(otel, rollout_id="ro-ok", attempt=1)
    assert ok.attributes["lps"] == ["0.5", "inf"] and ok.attributes["big"] == str(2**70)
    assert Span.model_validate(ok.model_dump()) == ok  # one type per list, 64-bit ints: storable


def test_span_from_otel_turns_what_the_store_refuses_into_text(provider, user) -> None:
    """Newer OTel SDKs keep bytes and mappings as attribute values; the store takes only scalars and
    lists of them, so the trusted (unvalidated) conversion must not let them through as they are."""
    tracing.setup_tracing(tracer_provider=provider)
    with rollout_context("ro-odd", 1, span=False):
        span = _tracer().start_span(
            "s", attributes={"raw": b"caf\xc3\xa9", "obj": {"a": 1, "b": [1, 2]}, "mixed": ("x", 2, True)}
        )
        span.set_attribute("items", ({"k": 1}, "v"))  # type: ignore[arg-type]
        span.end()
    (otel,) = user.get_finished_spans()
    converted = span_from_otel(otel)
    attrs = converted.attributes
    assert attrs["raw"] == "café"
    assert attrs["obj"] == '{"a":1,"b":[1,2]}'
    assert attrs["mixed"] == ["x", 2, True]
    assert attrs["items"] == ['{"k":1}', "v"]
    assert Span.model_validate(converted.model_dump()) == converted


_SHUTDOWN_SCRIPT = textwrap.dedent(
    """
    import sys
    import agl
    from agl.tracing import provider as tracing
    from agl.store.sqlite import SQLiteStore
    from agl.types import NewRollout

    store = SQLiteStore(sys.argv[1])
    store.enqueue([NewRollout(id="ro-exit")])
    store.claim("w")
    # a long delay and large batches: nothing is written before the interpreter exits
    tracing.setup_tracing(store, max_batch_size=100_000, schedule_delay_s=3600)
    tracer = tracing.get_tracer("exit-test")
    with agl.rollout_context("ro-exit", 1):
        for i in range(int(sys.argv[2])):
            tracer.start_span(f"s{i}").end()
    assert tracing.stats()["exported"] == 0, tracing.stats()
    print("EXITING", flush=True)
    # no flush(), no reset_tracing(): the provider's shutdown at exit must drain the queue
    """
)


def test_no_span_lost_at_clean_shutdown(tmp_path) -> None:
    """Batched export keeps spans in memory; a process that exits normally still stores every one."""
    from agl.store.sqlite import SQLiteStore

    db = tmp_path / "exit.db"
    n = 2500
    result = subprocess.run(
        [sys.executable, "-c", _SHUTDOWN_SCRIPT, str(db), str(n)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "EXITING" in result.stdout
    store = SQLiteStore(db)
    try:
        names = {s.name for s in store.query_spans(rollout_id="ro-exit")}
    finally:
        store.close()
    assert names == {f"s{i}" for i in range(n)} | {semconv.SPAN_ROLLOUT}


def test_span_without_rollout_is_skipped_by_the_exporter(provider, user, store) -> None:
    tracing.setup_tracing(tracer_provider=provider)
    _tracer().start_span("lonely").end()
    (lonely,) = user.get_finished_spans()
    with pytest.raises(MissingRolloutError):
        span_from_otel(lonely)
    assert span_from_otel(lonely, rollout_id="ro-given", attempt=1).rollout_id == "ro-given"
    exporter = StoreSpanExporter(store)
    assert exporter.export([lonely]) is SpanExportResult.SUCCESS
    assert exporter.skipped == 1 and exporter.exported == 0


def test_store_span_exporter_with_otel_processor(store) -> None:
    """The gateway's way: its own provider + SimpleSpanProcessor(StoreSpanExporter(store))."""
    rid, n = _claim(store, "ro-gw")
    exporter = StoreSpanExporter(store)
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    tp.get_tracer("gw").start_span(
        semconv.SPAN_CHAT, attributes={semconv.AGL_ROLLOUT_ID: rid, semconv.AGL_ATTEMPT: str(n)}
    ).end()
    (stored,) = store.query_spans(rollout_id=rid)
    assert stored.attempt == n and exporter.exported == 1
    tp.shutdown()


# ------------------------------------------------------------------------- the application's global


_GLOBAL_SCRIPT = textwrap.dedent(
    """
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    import agl
    from agl.tracing import provider as tracing
    from agl.store.memory import MemoryStore
    from agl.types import NewRollout, Span

    store = MemoryStore()
    store.enqueue([NewRollout(id="ro-g")]); store.claim("w")
    user = InMemorySpanExporter()
    if MODE == "app-provider":
        app = TracerProvider()
        app.add_span_processor(SimpleSpanProcessor(user))
        trace.set_tracer_provider(app)
    provider = agl.setup_tracing(store)
    assert trace.get_tracer_provider() is provider
    if MODE == "app-provider":
        assert provider is app, "agl replaced the application's provider"
    with agl.rollout_context("ro-g", 1):
        trace.get_tracer("app").start_span("framework-span").end()
    assert tracing.flush(10)
    stored = sorted(s.name for s in store.query_spans(rollout_id="ro-g"))
    assert stored == ["agl.rollout", "framework-span"], stored
    if MODE == "app-provider":
        assert sorted(s.name for s in user.get_finished_spans()) == stored
    print("OK", MODE)
    """
)


@pytest.mark.parametrize("mode", ["app-provider", "no-provider"])
def test_global_provider_is_used_or_created(mode: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", f"MODE = {mode!r}\n" + _GLOBAL_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"OK {mode}" in result.stdout


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_export_works_in_a_forked_child(provider, store) -> None:
    import os

    rid, n = _claim(store, "ro-fork")
    tracing.setup_tracing(store, provider)
    with rollout_context(rid, n, span=False):
        _tracer().start_span("parent-side").end()
    assert tracing.flush(10)  # the worker thread now exists in the parent
    pid = os.fork()
    if pid == 0:  # child: its copy of the store must receive the child's spans through a new worker
        code = 1
        try:
            with rollout_context(rid, n, span=False):
                _tracer().start_span("child-side").end()
            ok = tracing.flush(10)
            names = [s.name for s in store.query_spans(rollout_id=rid)]
            code = 0 if ok and names == ["parent-side", "child-side"] else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [s.name for s in store.query_spans(rollout_id=rid)] == ["parent-side"]


class _StuckStore(MemoryStore):
    """A real MemoryStore whose span writes for one rollout hang until released: a store (or the
    network to it) stuck for that rollout only."""

    def __init__(self, stuck_id: str) -> None:
        super().__init__()
        self.stuck_id = stuck_id
        self.entered = threading.Event()
        self.release = threading.Event()

    def add_spans(self, spans, *, idempotency_key=None):  # type: ignore[no-untyped-def]
        if any(s.rollout_id == self.stuck_id for s in spans):
            self.entered.set()
            assert self.release.wait(30)
        return super().add_spans(spans, idempotency_key=idempotency_key)


def test_an_attempts_flush_does_not_wait_for_another_rollouts_stuck_write() -> None:
    store = _StuckStore("ro-stuck")
    provider = TracerProvider()
    tracing.setup_tracing(store, provider, schedule_delay_s=0.01)
    try:
        stuck, n_stuck = _claim(store, "ro-stuck")
        fast, n_fast = _claim(store, "ro-fast")
        with rollout_context(stuck, n_stuck, span=False):
            _tracer().start_span("stuck-1").end()
        assert store.entered.wait(10)  # the export worker is inside the stuck write now
        with rollout_context(stuck, n_stuck, span=False):
            _tracer().start_span("stuck-2").end()  # queued behind it
        with rollout_context(fast, n_fast):
            for i in range(3):
                _tracer().start_span(f"fast-{i}").end()
        t0 = time.monotonic()
        assert tracing.flush(10, rollout_id=fast, attempt=n_fast) is True
        assert time.monotonic() - t0 < 5
        assert sorted(s.name for s in store.query_spans(rollout_id=fast)) == [
            "agl.rollout",
            "fast-0",
            "fast-1",
            "fast-2",
        ]
        # the stuck rollout's own flush (and a global one) do wait, and say so when time runs out
        assert tracing.flush(0.2, rollout_id=stuck, attempt=n_stuck) is False
        assert tracing.flush(0.2) is False
        assert store.query_spans(rollout_id=stuck) == []
        store.release.set()
        assert tracing.flush(10, rollout_id=stuck, attempt=n_stuck) is True
        # one writer per attempt at a time: its spans are stored in the order they ended
        assert [s.name for s in store.query_spans(rollout_id=stuck)] == ["stuck-1", "stuck-2"]
        assert tracing.stats()["queued"] == 0
    finally:
        store.release.set()
        tracing.reset_tracing()
        provider.shutdown()
        store.close()


def test_flush_of_one_attempt_needs_both_ids(store) -> None:
    with pytest.raises(ValueError, match="attempt"):
        tracing.flush(1, rollout_id="ro-x")
    with pytest.raises(ValueError, match="rollout id"):
        tracing.flush(1, attempt=1)
