"""Hardening of the store server: strict request types; slow or greedy clients cannot hold it.

Real uvicorn servers on 127.0.0.1; the stalled requests are written on raw sockets, as an attacker
(or a wedged client) would.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

import agl.store
from agl.http_limits import HttpLimits
from agl.store.server import serve_in_thread
from agl.types import NewRollout

SPAN = {
    "trace_id": "a" * 32,
    "span_id": "b" * 16,
    "name": "step",
    "start_ns": 1,
    "end_ns": 2,
    "rollout_id": "ro-1",
    "attempt": 1,
}


@pytest.fixture
def store() -> Iterator[Any]:
    s = agl.store.open("memory://")
    yield s
    s.close()


# ------------------------------------------------------------------------------------ strict types


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/tasks/query", {"limit": "10"}, "limit"),
        ("/tasks/query", {"limit": True}, "limit"),
        ("/rollouts/query", {"limit": 1.0}, "limit"),
        ("/rollouts/query", {"offset": "0"}, "offset"),
        ("/claim", {"timeout_s": "0"}, "timeout_s"),
        ("/rollouts/wait", {"ids": ["ro-1"], "timeout_s": "0"}, "timeout_s"),
        ("/spans", {"spans": [{**SPAN, "attempt": "1"}]}, "spans.0.attempt"),
        ("/spans", {"spans": [{**SPAN, "start_ns": "1"}]}, "spans.0.start_ns"),
        ("/spans/query", {"include_stale": 0}, "include_stale"),
        ("/rollouts", {"rollouts": [{"id": "r", "config": {"max_attempts": "2"}}]}, "max_attempts"),
    ],
)
def test_wrong_types_are_refused_naming_the_field(
    store: Any, path: str, body: dict[str, Any], field: str
) -> None:
    store.enqueue([NewRollout(id="ro-1")])
    store.claim("w")
    before = (store.query_rollouts(), store.query_spans())
    with serve_in_thread(store) as url:
        resp = httpx.post(url + path, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "invalid_input"
    assert field in err["message"], err["message"]
    assert (store.query_rollouts(), store.query_spans()) == before  # nothing changed


def test_right_types_still_pass(store: Any) -> None:
    """Strictness refuses coercion only: ints where floats are expected, ISO timestamps, enums are fine."""
    with serve_in_thread(store) as url:
        ok = httpx.post(url + "/rollouts", json={"rollouts": [{"id": "ro-1", "config": {"timeout_s": 5}}]})
        assert ok.status_code == 200, ok.text
        claim = httpx.post(url + "/claim", json={"worker_id": "w", "timeout_s": 0, "modes": ["train"]})
        assert claim.status_code == 200 and claim.json()["claim"]["attempt"]["number"] == 1
        spans = httpx.post(url + "/spans", json={"spans": [SPAN]})
        assert spans.status_code == 200, spans.text
        assert httpx.post(url + "/tasks/query", json={"limit": 10}).status_code == 200


# -------------------------------------------------------------------------------- read timeouts


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    return sock


def _read_all(sock: socket.socket, within_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed it."""
    t0 = time.monotonic()
    sock.settimeout(within_s)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk


def _request_head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_a_stalled_body_is_answered_408_and_closed_after_the_timeout(store: Any) -> None:
    limits = HttpLimits(header_timeout_s=5, body_timeout_s=1)
    with serve_in_thread(store, limits=limits) as url:
        body = json.dumps({"rollouts": [{"id": "ro-stall"}]}).encode()
        stalled = [_connect(url) for _ in range(20)]
        for sock in stalled:
            sock.sendall(_request_head("/rollouts", len(body)) + body[:10])  # then nothing more
        t0 = time.monotonic()
        for sock in stalled:
            data, _ = _read_all(sock, within_s=30)
            assert data.startswith(b"HTTP/1.1 408 "), data[:200]
            assert b"connection: close" in data.lower()
            assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
            sock.close()
        assert time.monotonic() - t0 < 15  # all closed after about the 1 s timeout, not held
        # the server is fine, and nothing of the stalled requests was applied
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.post(url + "/rollouts", json={"rollouts": [{"id": "ro-ok"}]}).status_code == 200
    assert [r.id for r in store.query_rollouts()] == ["ro-ok"]


def test_stalled_headers_and_idle_connections_are_closed(store: Any) -> None:
    limits = HttpLimits(header_timeout_s=1, body_timeout_s=5)
    with serve_in_thread(store, limits=limits) as url:
        half = _connect(url)
        half.sendall(b"POST /rollouts HTTP/1.1\r\nHost: x\r\n")  # headers never finish
        idle = _connect(url)  # sends nothing at all
        data, _ = _read_all(half, within_s=30)
        assert data.startswith(b"HTTP/1.1 408 "), data[:200]
        data, _ = _read_all(idle, within_s=30)
        assert data.startswith(b"HTTP/1.1 408 ")
        half.close()
        idle.close()
        # a kept-alive connection is not cut by the header timer between its requests
        with httpx.Client() as client:
            for _ in range(3):
                assert client.get(url + "/health").status_code == 200
                time.sleep(0.6)


def test_connections_per_client_are_capped(store: Any) -> None:
    limits = HttpLimits(max_connections_per_client=3, exempt_loopback=False)
    with serve_in_thread(store, limits=limits) as url:
        held = [_connect(url) for _ in range(3)]
        time.sleep(0.2)  # the server has counted them
        extra = _connect(url)
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, _ = _read_all(extra, within_s=30)
        assert data.startswith(b"HTTP/1.1 429 "), data[:200]
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
        extra.close()
        held[0].close()  # one given back: a new connection is served again
        deadline = time.monotonic() + 10
        while True:
            resp = httpx.get(url + "/health")
            if resp.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert resp.status_code == 200
        for sock in held[1:]:
            sock.close()


def test_loopback_clients_are_not_capped_by_default(store: Any) -> None:
    with serve_in_thread(store, limits=HttpLimits(max_connections_per_client=2)) as url:
        socks = [_connect(url) for _ in range(4)]
        for sock in socks:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        for sock in socks:
            data, _ = _read_all(sock, within_s=30)
            assert data.startswith(b"HTTP/1.1 200 "), data[:200]
            sock.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"header_timeout_s": 0},
        {"body_timeout_s": -1},
        {"body_timeout_s": float("inf")},
        {"max_connections_per_client": 0},
        {"max_connections_per_client": True},
    ],
)
def test_bad_limits_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        HttpLimits(**kwargs)
