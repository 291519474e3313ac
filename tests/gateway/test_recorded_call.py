"""A gateway call is recorded in one place (``agl.gateway.spans.CallRecorder``).

For every wire format (Chat Completions, Completions, Responses, Anthropic Messages), streamed and not,
on a backend that streams for real (transformers, a tiny random Llama) and on one that answers whole
(scripted): one call is counted once in ``stats`` and leaves exactly one stored server span, with the
same attribute keys and the same reply streamed or not, whichever way spans are written.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gw_helpers import server_spans, start_rollout, tiny_lm

from agl import semconv as sc
from agl.gateway.backends.base import Backend
from agl.gateway.testing import ScriptedBackend, serve_gateway

pytest.importorskip("torch")
pytest.importorskip("transformers")

from agl.gateway.backends.transformers import TransformersBackend  # noqa: E402

TEXT = "Say something."
ROUTES = {"chat": "/chat/completions", "completions": "/completions", "responses": "/responses"}
ROUTES["messages"] = "/messages"


def _body(route: str, model: str, stream: bool, text: str = TEXT) -> dict[str, Any]:
    """A request of ``route`` asking ``model`` to continue ``text`` (greedy, 8 tokens at most)."""
    body: dict[str, Any] = {"model": model, "stream": stream, "temperature": 0}
    if route == "completions":
        return {**body, "prompt": text, "max_tokens": 8}
    if route == "responses":
        return {**body, "input": text, "max_output_tokens": 8}
    return {**body, "messages": [{"role": "user", "content": text}], "max_tokens": 8}


def _backend(kind: str) -> Backend:
    if kind == "scripted":
        return ScriptedBackend(["Hello there, friend."], on_exhausted="repeat")
    return TransformersBackend(tiny_lm(), model_name="tiny", default_max_tokens=8)


@pytest.fixture(params=["scripted", "transformers"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    be = _backend(request.param)
    yield be
    executor = getattr(be, "_executor", None)
    if executor is not None:
        executor.shutdown(wait=False)


def _call(base: str, route: str, model: str, stream: bool) -> None:
    r = httpx.post(base + ROUTES[route], json=_body(route, model, stream), timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert '"type":"error"' not in r.text and "event: error" not in r.text, r.text


@pytest.mark.parametrize("span_writes", ["before_reply", "after_reply"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_one_call_one_span_streamed_or_not(
    store: Any, backend: Backend, route: str, span_writes: str
) -> None:
    model = backend.models()[0]
    spans: dict[bool, Any] = {}
    with serve_gateway(backend, store, span_writes=span_writes) as url:
        gw = url.gateway
        for stream in (False, True):
            rollout = start_rollout(store, f"ro-{route}-{span_writes}-{int(stream)}")
            before = dict(gw.stats)
            _call(url.for_rollout(*rollout), route, model, stream)
            assert httpx.post(url.root + "/agl/v1/flush", timeout=30).status_code == 200
            assert gw.stats["calls"] == before.get("calls", 0) + 1, "each call counted once"
            assert gw.stats["unattributed_calls"] == before.get("unattributed_calls", 0)
            assert gw.stats["spans_stored"] == before.get("spans_stored", 0) + 1
            found = server_spans(store, rollout[0])
            assert len(found) == 1, f"{route} stream={stream}: {len(found)} spans"
            spans[stream] = found[0]
    whole, streamed = spans[False], spans[True]
    assert set(streamed.attributes) == set(whole.attributes), route
    assert streamed.status.code == whole.status.code == "UNSET"
    for key in (sc.AGL_LLM_API, sc.GEN_AI_OUTPUT_MESSAGES, sc.AGL_LLM_RESPONSE_TOKEN_IDS):
        assert streamed.attributes[key] == whole.attributes[key], key


def test_an_unattributed_call_is_counted_once_and_stores_nothing(store: Any) -> None:
    backend = _backend("scripted")
    with serve_gateway(backend, store) as url:
        gw = url.gateway
        for route in ROUTES:
            for stream in (False, True):
                before = dict(gw.stats)
                _call(url, route, "scripted", stream)
                assert gw.stats["calls"] == before.get("calls", 0) + 1
                assert gw.stats["unattributed_calls"] == before.get("unattributed_calls", 0) + 1
        assert gw.stats["spans_stored"] == 0


def test_a_refused_call_is_not_counted_streamed_or_not(store: Any, rollout: tuple[str, int]) -> None:
    """A prompt that cannot fit the context window is refused (400) before the call is counted or
    recorded, on both paths and every route."""
    backend = _backend("scripted")
    limit = backend.max_prompt_chars()
    assert limit is not None
    with serve_gateway(backend, store) as url:
        for route, path in ROUTES.items():
            for stream in (False, True):
                body = _body(route, "scripted", stream, text="x" * (limit + 1))
                r = httpx.post(url.for_rollout(*rollout) + path, json=body, timeout=60)
                assert r.status_code == 400, (route, stream, r.text)
                assert "context window" in r.text
        assert url.gateway.stats["calls"] == 0 and backend.calls == 0
    assert server_spans(store, rollout[0]) == []
