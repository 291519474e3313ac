"""agl.tracing.emit: reward/message/object/exception spans, validation, and the outside-a-rollout warning."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel

import agl
from agl import semconv
from agl.store.memory import MemoryStore
from agl.tracing import emit
from agl.tracing import provider as tracing
from agl.types import NewRollout


@pytest.fixture()
def user() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.setup_tracing(tracer_provider=provider)
    yield exporter
    tracing.reset_tracing()
    provider.shutdown()


@pytest.fixture()
def in_rollout(user) -> Iterator[None]:
    with agl.rollout_context("ro-emit", 1, span=False):
        yield


def _spans(user: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in user.get_finished_spans() if s.name == name]


def _rewards(user: InMemorySpanExporter) -> list[tuple[str, float, bool]]:
    return [
        (
            s.attributes[semconv.AGL_REWARD_NAME],
            s.attributes[semconv.AGL_REWARD_VALUE],
            s.attributes[semconv.AGL_REWARD_PRIMARY],
        )
        for s in _spans(user, semconv.SPAN_REWARD)
    ]


def test_scalar_reward(user, in_rollout) -> None:
    agl.emit_reward(0.5)
    agl.emit_reward(2, name="accuracy", primary=False)
    assert _rewards(user) == [("reward", 0.5, True), ("accuracy", 2.0, False)]
    span = _spans(user, semconv.SPAN_REWARD)[0]
    assert span.attributes[semconv.AGL_REWARD_SOURCE] == "emit"
    assert span.attributes[semconv.AGL_ROLLOUT_ID] == "ro-emit" and span.attributes[semconv.AGL_ATTEMPT] == 1


def test_dict_reward_first_key_is_primary(user, in_rollout) -> None:
    agl.emit_reward({"task": 1.0, "format": 0.25})
    assert _rewards(user) == [("task", 1.0, True), ("format", 0.25, False)]


def test_dict_reward_name_selects_primary(user, in_rollout) -> None:
    agl.emit_reward({"task": 1.0, "format": 0.25}, name="format")
    assert _rewards(user) == [("task", 1.0, False), ("format", 0.25, True)]


def test_dict_reward_not_primary(user, in_rollout) -> None:
    agl.emit_reward({"task": 1.0, "format": 0.25}, primary=False)
    assert [p for _, _, p in _rewards(user)] == [False, False]


@pytest.mark.parametrize(
    "value,kwargs,error",
    [
        (float("nan"), {}, ValueError),
        (float("inf"), {}, ValueError),
        ({"a": 1.0, "b": float("-inf")}, {}, ValueError),
        ({"a": 1.0}, {"name": "missing"}, ValueError),
        ({}, {}, ValueError),
        ("1.0", {}, TypeError),
        (True, {}, TypeError),
        (None, {}, TypeError),
        ({"a": "x"}, {}, TypeError),
        ({"": 1.0}, {}, TypeError),
        (1.0, {"name": ""}, TypeError),
    ],
)
def test_bad_rewards_raise_and_emit_nothing(user, in_rollout, value, kwargs, error) -> None:
    with pytest.raises(error):
        agl.emit_reward(value, **kwargs)
    assert _spans(user, semconv.SPAN_REWARD) == []


def test_message_and_object(user, in_rollout) -> None:
    class Model(BaseModel):
        x: int

    @dataclasses.dataclass
    class Data:
        y: list[int]

    agl.emit_message("thinking about it")
    agl.emit_object({"model": Model(x=1), "data": Data(y=[1, 2]), "tags": ("a",)})
    (msg,) = _spans(user, semconv.SPAN_MESSAGE)
    assert msg.attributes[semconv.AGL_MESSAGE_BODY] == "thinking about it"
    (obj,) = _spans(user, semconv.SPAN_OBJECT)
    assert json.loads(obj.attributes[semconv.AGL_OBJECT_JSON]) == {
        "model": {"x": 1},
        "data": {"y": [1, 2]},
        "tags": ["a"],
    }
    with pytest.raises(TypeError):
        agl.emit_message(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="JSON"):
        agl.emit_object({"bad": float("nan")})
    with pytest.raises(ValueError, match="JSON"):
        agl.emit_object(object())
    assert len(_spans(user, semconv.SPAN_OBJECT)) == 1


def test_exception(user, in_rollout) -> None:
    try:
        raise ValueError("the tool broke")
    except ValueError as exc:
        agl.emit_exception(exc)
    (span,) = _spans(user, semconv.SPAN_EXCEPTION)
    assert span.status.status_code.name == "ERROR"
    assert span.status.description == "ValueError: the tool broke"
    assert span.attributes[semconv.AGL_EXCEPTION_TYPE] == "ValueError"
    (event,) = span.events
    assert event.name == "exception"
    assert "the tool broke" in event.attributes["exception.message"]
    assert "raise ValueError" in event.attributes["exception.stacktrace"]
    with pytest.raises(TypeError):
        agl.emit_exception("not an exception")  # type: ignore[arg-type]


def test_outside_rollout_spans_are_made_and_warn_once(user, monkeypatch) -> None:
    monkeypatch.setattr(emit, "_warned", False)
    with pytest.warns(RuntimeWarning, match="outside a rollout context"):
        agl.emit_reward(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        agl.emit_message("again")  # no second warning
    assert len(_spans(user, semconv.SPAN_REWARD)) == 1
    assert semconv.AGL_ROLLOUT_ID not in _spans(user, semconv.SPAN_REWARD)[0].attributes


def test_emitted_spans_reach_the_store_under_the_rollout() -> None:
    store = MemoryStore()
    store.enqueue([NewRollout(id="ro-store")])
    attempt = store.claim("w").attempt.number
    provider = TracerProvider()
    tracing.setup_tracing(store, provider)
    try:
        with agl.rollout_context("ro-store", attempt):
            agl.emit_message("m")
            agl.emit_reward({"a": 1.0, "b": 0.0})
        assert tracing.flush(10)
        spans = store.query_spans(rollout_id="ro-store")
        root = next(s for s in spans if s.name == semconv.SPAN_ROLLOUT)
        assert sorted(s.name for s in spans if s is not root) == [
            semconv.SPAN_MESSAGE,
            semconv.SPAN_REWARD,
            semconv.SPAN_REWARD,
        ]
        assert all(s.parent_id == root.span_id for s in spans if s is not root)
    finally:
        tracing.reset_tracing()
        provider.shutdown()
        store.close()
