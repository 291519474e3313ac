"""Every bad input gets an OpenAI-style error body with the right status, and changes nothing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gw_helpers import server_spans

from agl import semconv as sc
from agl.gateway.testing import GatewayURL, ScriptedBackend, reply, serve_gateway


def _openai() -> Any:
    """The real client where installed (the core tox env has none: those tests skip there)."""
    return pytest.importorskip("openai")


MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
def gw(store: Any, rollout: tuple[str, int]) -> Iterator[tuple[GatewayURL, str]]:
    with serve_gateway(ScriptedBackend(["ok"], on_exhausted="repeat"), store) as url:
        yield url, url.for_rollout(*rollout)


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"messages": MSG}, "model", "missing required parameter"),
        ({"model": "scripted"}, "messages", "missing required parameter"),
        ({"model": "scripted", "messages": []}, "messages", "at least 1"),
        (
            {"model": "scripted", "messages": [{"role": "wizard", "content": "x"}]},
            "messages[0].role",
            "invalid value",
        ),
        ({"model": "scripted", "messages": MSG, "temperature": 5}, "temperature", "less than or equal to 2"),
        ({"model": "scripted", "messages": MSG, "n": 0}, "n", "greater than or equal to 1"),
        (
            {"model": "scripted", "messages": MSG, "max_tokens": -1},
            "max_tokens",
            "greater than or equal to 1",
        ),
        ({"model": "scripted", "messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        (
            {"model": "scripted", "messages": MSG, "tools": [{"type": "function"}]},
            "tools[0].function",
            "missing",
        ),
        # strict types: nothing is coerced ("10" is not a number, 1 is not a boolean)
        ({"model": "scripted", "messages": MSG, "max_tokens": "10"}, "max_tokens", "valid integer"),
        ({"model": "scripted", "messages": MSG, "max_tokens": 10.0}, "max_tokens", "valid integer"),
        ({"model": "scripted", "messages": MSG, "temperature": "0.5"}, "temperature", "valid number"),
        ({"model": "scripted", "messages": MSG, "stream": 1}, "stream", "valid boolean"),
        ({"model": "scripted", "messages": MSG, "n": True}, "n", "valid integer"),
        ({"model": 7, "messages": MSG}, "model", "valid string"),
    ],
)
def test_schema_errors_are_400_naming_the_parameter(
    gw: tuple[GatewayURL, str],
    store: Any,
    rollout: tuple[str, int],
    body: dict[str, Any],
    param: str,
    needle: str,
) -> None:
    _, base = gw
    err = _error(httpx.post(base + "/chat/completions", json=body), 400)
    assert err["param"] == param
    assert needle in err["message"]
    assert err["type"] == "invalid_request_error"
    assert store.query_spans() == []


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"a string"'])
def test_invalid_json_is_400(gw: tuple[GatewayURL, str], store: Any, raw: bytes) -> None:
    _, base = gw
    for route in ("/chat/completions", "/completions", "/responses"):
        err = _error(httpx.post(base + route, content=raw, headers={"content-type": "application/json"}), 400)
        assert "JSON" in err["message"]
    assert store.query_spans() == []


def test_unknown_model_is_404_in_strict_mode_with_the_real_client(
    store: Any, rollout: tuple[str, int]
) -> None:
    """``only_model_names`` (``--only-model-names``) keeps the 404 for a name not served."""
    openai = _openai()
    backend = ScriptedBackend(["ok"], on_exhausted="repeat")
    with serve_gateway(backend, store, only_model_names=True, model_names=["alias"]) as url:
        base = url.for_rollout(*rollout)
        client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="gpt-nope", messages=MSG)
        assert "gpt-nope" in str(info.value) and "scripted, alias" in str(info.value)
        err = _error(httpx.post(base + "/responses", json={"model": "gpt-nope", "input": "x"}), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert store.query_spans() == []
        assert client.chat.completions.create(model="ALIAS", messages=MSG).choices[0].message.content == "ok"


def test_prompt_over_the_context_window_is_400_naming_the_limit(
    gw: tuple[GatewayURL, str], store: Any
) -> None:
    openai = _openai()
    _, base = gw
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "hello " * 9000}]
        )
    body = info.value.body
    assert isinstance(body, dict)
    assert body["code"] == "context_length_exceeded"
    assert "8192" in body["message"]
    assert store.query_spans() == []


def test_backend_failure_is_502_and_an_error_span(store: Any, rollout: tuple[str, int]) -> None:
    openai = _openai()
    backend = ScriptedBackend([reply(error="CUDA out of memory")])
    with serve_gateway(backend, store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="scripted", messages=MSG)
        assert info.value.status_code == 502
        assert "CUDA out of memory" in str(info.value)
        assert url.gateway.stats["backend_errors"] == 1
    (span,) = server_spans(store, rollout[0])
    assert span.status.code == "ERROR"
    assert "CUDA out of memory" in (span.status.message or "")
    assert span.events[0].name == "exception"
    assert sc.AGL_LLM_RESPONSE_TOKEN_IDS not in span.attributes


def test_client_disconnect_cancels_the_generation(store: Any, rollout: tuple[str, int]) -> None:
    cancelled = threading.Event()
    started: list[bool] = []

    async def slow(request: Any) -> str:
        started.append(True)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "too late"

    backend = ScriptedBackend(slow, cancellable=True)
    with serve_gateway(backend, store) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                url.for_rollout(*rollout) + "/chat/completions",
                json={"model": "scripted", "messages": MSG},
                timeout=0.5,
            )
        stats = url.gateway.stats
        for _ in range(500):  # the server notices the disconnect asynchronously
            if stats["cancelled_calls"]:
                break
            time.sleep(0.01)
        assert started == [True]
        assert stats["cancelled_calls"] == 1
        assert cancelled.is_set()
    (span,) = server_spans(store, rollout[0])  # the cancelled call is on record, as an ERROR
    assert span.status.code == "ERROR" and "disconnected" in (span.status.message or "")


@pytest.mark.parametrize(
    ("path", "status", "param"),
    [
        ("/rollouts/bad id!/attempts/1/v1/chat/completions", 400, "rollout_id"),
        ("/rollouts/ro-gw-1/attempts/0/v1/chat/completions", 400, "attempt"),
        ("/rollouts/ro-gw-1/attempts/x/v1/chat/completions", 404, None),
        ("/v2/chat/completions", 404, None),
    ],
)
def test_bad_paths(gw: tuple[GatewayURL, str], path: str, status: int, param: str | None) -> None:
    url, _ = gw
    err = _error(httpx.post(url.root + path, json={"model": "scripted", "messages": MSG}), status)
    assert err["param"] == param


def test_wrong_method_is_405_json(gw: tuple[GatewayURL, str]) -> None:
    _, base = gw
    _error(httpx.get(base + "/chat/completions"), 405)


def test_baggage_without_attempt_is_400(gw: tuple[GatewayURL, str], store: Any) -> None:
    url, _ = gw
    resp = httpx.post(
        url + "/chat/completions",
        json={"model": "scripted", "messages": MSG},
        headers={"baggage": f"{sc.BAGGAGE_ROLLOUT_ID}=ro-gw-1"},
    )
    err = _error(resp, 400)
    assert sc.BAGGAGE_ATTEMPT in err["message"]
    assert store.query_spans() == []


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"model": "scripted", "input": "x", "previous_response_id": "resp_1"}, "stateless"),
        ({"model": "scripted", "input": [{"type": "web_search_call", "id": "x"}]}, "web_search_call"),
        ({"model": "scripted", "input": "x", "tools": [{"type": "web_search"}]}, "only function tools"),
        ({"model": "scripted", "input": [{"type": "function_call", "name": "f"}]}, "call_id"),
        ({"model": "scripted", "input": [{"role": "robot", "content": "x"}]}, "unknown role"),
        ({"model": "scripted", "input": []}, "empty"),
        ({"model": "scripted"}, "missing required parameter"),
    ],
)
def test_responses_bad_input(
    gw: tuple[GatewayURL, str], store: Any, body: dict[str, Any], needle: str
) -> None:
    _, base = gw
    err = _error(httpx.post(base + "/responses", json=body), 400)
    assert needle in err["message"]
    assert store.query_spans() == []


def test_completions_bad_input(gw: tuple[GatewayURL, str]) -> None:
    _, base = gw
    err = _error(httpx.post(base + "/completions", json={"model": "scripted", "prompt": ["a", "b"]}), 400)
    assert "one prompt" in err["message"]
    _error(httpx.post(base + "/completions", json={"model": "scripted"}), 400)


def test_api_key_is_enforced(store: Any) -> None:
    openai = _openai()
    with serve_gateway(ScriptedBackend(["ok"]), store, api_key="secret") as url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).chat.completions.create(
                model="scripted", messages=MSG
            )
        ok = openai.OpenAI(base_url=url, api_key="secret").chat.completions.create(
            model="scripted", messages=MSG
        )
        assert httpx.get(url + "/models", headers={"Authorization": "Bearer secret"}).status_code == 200
        _error(httpx.get(url + "/models"), 401)
        _error(httpx.get(url.root + "/agl/v1/status"), 401)
        _error(httpx.post(url.root + "/agl/v1/weights", json={"path": "x"}), 401)
    assert ok.choices[0].message.content == "ok"


def test_body_size_limit(store: Any) -> None:
    with serve_gateway(ScriptedBackend(["ok"]), store, max_body_bytes=1000) as url:
        err = _error(
            httpx.post(
                url + "/chat/completions",
                json={"model": "scripted", "messages": [{"role": "user", "content": "x" * 2000}]},
            ),
            413,
        )
    assert "1000" in err["message"]
