"""The store server's HTTP contract: JSON errors, auth, body limits, idempotency, long-poll.

Real uvicorn servers on 127.0.0.1 (in a thread, over a MemoryStore we can inspect directly) and the
real ``HttpStore`` client; the conformance suite covers the Store semantics over HTTP separately.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agl.cli import main as agl_main
from agl.store.base import NotFoundError
from agl.store.http import HttpStore, StoreAuthError
from agl.store.memory import MemoryStore
from agl.store.server import create_app, serve_in_thread
from agl.types import NewRollout, RolloutConfig, Span


def wait_until(pred: Any, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())


def error_of(resp: httpx.Response) -> dict[str, str]:
    assert resp.headers["content-type"].startswith("application/json"), resp.text
    err = resp.json()["error"]
    assert isinstance(err["code"], str) and isinstance(err["message"], str) and err["message"]
    return err


def snapshot(store: MemoryStore) -> Any:
    res = store.get_resources()
    return (
        [r.model_dump() for r in store.query_rollouts()],
        [s.model_dump() for s in store.query_spans()],
        [t.model_dump() for t in store.query_tasks()],
        None if res is None else res.model_dump(),
    )


@pytest.fixture
def served() -> Iterator[tuple[MemoryStore, str]]:
    store = MemoryStore()
    with serve_in_thread(store, max_body_bytes=64 * 1024) as url:
        yield store, url


def make_span(rollout_id: str, attempt: int = 1) -> Span:
    return Span(
        trace_id="a" * 32,
        span_id="b" * 16,
        name="step",
        start_ns=1,
        end_ns=2,
        rollout_id=rollout_id,
        attempt=attempt,
    )


# ------------------------------------------------------------------------------------ errors


def test_health_and_json_errors(served: tuple[MemoryStore, str]) -> None:
    store, url = served
    rid = store.enqueue([NewRollout()])[0].id
    before = snapshot(store)
    with httpx.Client(base_url=url) as c:
        assert c.get("/health").json() == {"status": "ok"}

        r = c.get("/nope")
        assert (
            r.status_code == 404 and error_of(r)["code"] == "no_route" and "/nope" in error_of(r)["message"]
        )

        r = c.get("/claim")
        assert r.status_code == 405 and "POST" in error_of(r)["message"] and r.headers["allow"] == "POST"

        r = c.post("/claim", content=b'{"worker_id": "w", ')
        assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"

        r = c.post("/claim", json={"worker_id": "w", "timeout_s": "soon"})
        assert r.status_code == 400 and "timeout_s" in error_of(r)["message"]

        r = c.post("/claim", json={"worker_id": "w", "bogus": 1})
        assert r.status_code == 400 and "bogus" in error_of(r)["message"]

        r = c.post("/claim", json=[1, 2])
        assert r.status_code == 400

        r = c.get("/rollouts/ro-missing")
        assert r.status_code == 404 and error_of(r)["code"] == "not_found"
        assert "ro-missing" in error_of(r)["message"]

        r = c.post(f"/rollouts/{rid}/attempts/1/finish", json={"status": "succeeded"})
        assert r.status_code == 404 and "attempt 1" in error_of(r)["message"]

        r = c.post(f"/rollouts/{rid}/attempts/1/finish", json={"status": "lost"})
        assert r.status_code == 400 and error_of(r)["code"] == "invalid_input"

        r = c.post("/spans", json={"spans": [{"trace_id": "xyz"}]})
        assert r.status_code == 400 and "trace_id" in error_of(r)["message"]

        r = c.get("/resources/7")
        assert r.status_code == 404 and "7" in error_of(r)["message"]
    assert snapshot(store) == before


def test_conflict_maps_to_409(served: tuple[MemoryStore, str]) -> None:
    store, url = served
    rid = store.enqueue([NewRollout()])[0].id
    store.claim("w")
    store.finish_attempt(rid, 1, "succeeded")
    r = httpx.post(f"{url}/rollouts/{rid}/cancel")
    assert (
        r.status_code == 409 and error_of(r)["code"] == "conflict" and "succeeded" in error_of(r)["message"]
    )


def test_body_limit_by_content_length_and_by_streamed_size(served: tuple[MemoryStore, str]) -> None:
    store, url = served
    rid = store.enqueue([NewRollout()])[0].id
    store.claim("w")
    before = snapshot(store)
    big = json.dumps({"spans": [make_span(rid).model_dump(mode="json")] * 2000}).encode()
    assert len(big) > 64 * 1024
    r = httpx.post(f"{url}/spans", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large" and str(64 * 1024) in r.text

    def chunks() -> Iterator[bytes]:  # no Content-Length: the server must count what streams in
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    r = httpx.post(f"{url}/spans", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"
    assert "transfer-encoding" not in r.request.headers or r.request.headers["transfer-encoding"] == "chunked"
    assert snapshot(store) == before


# -------------------------------------------------------------------------------------- auth


def test_bearer_token_on_every_route_but_health(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    with serve_in_thread(store, token="s3cret") as url:
        assert httpx.get(f"{url}/health").status_code == 200
        for method, path in [
            ("GET", "/rollouts/x"),
            ("POST", "/claim"),
            ("POST", "/v1/traces"),
            ("GET", "/nope"),
        ]:
            r = httpx.request(method, url + path)
            assert r.status_code == 401 and error_of(r)["message"] == "missing bearer token"
            assert r.headers["www-authenticate"] == "Bearer"
            r = httpx.request(method, url + path, headers={"authorization": "Bearer s3cre"})
            assert r.status_code == 401 and error_of(r)["message"] == "invalid bearer token"
        ok = httpx.post(f"{url}/claim", json={"worker_id": "w"}, headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json() == {"claim": None}

        with pytest.raises(StoreAuthError, match="invalid bearer token"):
            HttpStore(url, token="wrong").query_rollouts()
        monkeypatch.delenv("AGL_STORE_TOKEN", raising=False)
        with pytest.raises(StoreAuthError, match="missing"):
            HttpStore(url).query_rollouts()
        monkeypatch.setenv("AGL_STORE_TOKEN", "s3cret")
        client = HttpStore(url)
        assert client.enqueue([NewRollout(id="ro-1")])[0].id == "ro-1"
        client.close()
    assert [r.id for r in store.query_rollouts()] == ["ro-1"]


def test_cli_refuses_public_address_without_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("AGL_STORE_TOKEN", raising=False)
    rc = agl_main(["store", "serve", "--store", "memory://", "--host", "0.0.0.0", "--port", "0"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "0.0.0.0" in err and "token" in err and "AGL_STORE_TOKEN" in err
    rc = agl_main(["store", "serve", "--store", "memory://", "--port", "0", "--max-body-bytes", "0"])
    assert rc == 2 and "max-body-bytes" in capsys.readouterr().err


# ------------------------------------------------------------------------------- idempotency


def test_idempotency_key_applies_a_write_once(served: tuple[MemoryStore, str]) -> None:
    store, url = served
    rid = store.enqueue([NewRollout()])[0].id
    store.claim("w")
    with httpx.Client(base_url=url) as c:
        first = c.post(
            f"/rollouts/{rid}/attempts/1/finish",
            json={"status": "succeeded"},
            headers={"idempotency-key": "k1"},
        )
        again = c.post(
            f"/rollouts/{rid}/attempts/1/finish",
            json={"status": "succeeded"},
            headers={"idempotency-key": "k1"},
        )
        assert first.status_code == again.status_code == 200 and first.content == again.content
        other = c.post(
            f"/rollouts/{rid}/attempts/1/finish",
            json={"status": "succeeded"},
            headers={"idempotency-key": "k2"},
        )
        assert other.status_code == 409
        reused = c.post(
            f"/rollouts/{rid}/attempts/1/finish", json={"status": "failed"}, headers={"idempotency-key": "k1"}
        )
        assert reused.status_code == 422 and error_of(reused)["code"] == "idempotency_key_reused"

        item = {"items": {"main": {"type": "llm", "base_url": "http://x/v1", "model": "m"}}}
        r1 = c.post("/resources", json=item, headers={"idempotency-key": "res-1"})
        r2 = c.post("/resources", json=item, headers={"idempotency-key": "res-1"})
        assert r1.json() == r2.json() and r1.json()["version"] == 1
        assert store.get_resources() is not None and store.get_resources().version == 1  # type: ignore[union-attr]

        body = {"rollouts": [{"input": 1}], "idempotency_key": "enq-1"}
        e1, e2 = c.post("/rollouts", json=body), c.post("/rollouts", json=body)
        assert e1.json() == e2.json()
    assert len(store.query_rollouts()) == 2


def test_prefer_return_minimal_for_span_batches(served: tuple[MemoryStore, str]) -> None:
    store, url = served
    rid = store.enqueue([NewRollout()])[0].id
    store.claim("w")
    body = {"spans": [make_span(rid).model_dump(mode="json")] * 3}
    r = httpx.post(f"{url}/spans", json=body, headers={"prefer": "return=minimal"})
    assert r.json() == {"seq": [1, 2, 3], "stale": [False, False, False]}
    full = httpx.post(f"{url}/spans", json=body).json()
    assert [s["seq"] for s in full["spans"]] == [4, 5, 6] and full["spans"][0]["rollout_id"] == rid


# --------------------------------------------------------------------------------- long-poll


class CountingTransport(httpx.BaseTransport):
    """Counts the requests an HttpStore makes, forwarding them to a real transport."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self.paths: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_claim_is_one_held_request_woken_by_enqueue(served: tuple[MemoryStore, str]) -> None:
    store, url = served
    client = HttpStore(url)
    counting = CountingTransport(client._transport)
    client._transport = counting
    got: list[Any] = []
    th = threading.Thread(target=lambda: got.append(client.claim("w", timeout_s=20)))
    th.start()
    time.sleep(0.3)
    rid = store.enqueue([NewRollout()])[0].id
    t0 = time.monotonic()
    th.join(20)
    assert got and got[0] is not None and got[0].rollout.id == rid
    assert time.monotonic() - t0 < 3
    assert counting.paths == ["/claim"]  # held server-side: no client polling
    client.close()


def test_waits_longer_than_the_server_cap_are_consecutive_long_polls() -> None:
    store = MemoryStore()
    app = create_app(store, long_poll_cap_s=0.3)
    with serve_in_thread(app) as url:
        client = HttpStore(url)
        counting = CountingTransport(client._transport)
        client._transport = counting
        t0 = time.monotonic()
        assert client.claim("w", timeout_s=1.0) is None
        elapsed = time.monotonic() - t0
        assert 0.9 <= elapsed < 5
        assert 2 <= len(counting.paths) <= 8  # ~1.0 / 0.3 held requests, not a busy loop
        rid = store.enqueue([NewRollout()])[0].id
        store.claim("w")
        assert client.wait_for_rollouts([rid], timeout_s=0.7) == []
        store.finish_attempt(rid, 1, "succeeded")
        assert [r.id for r in client.wait_for_rollouts([rid], timeout_s=5)] == [rid]
        client.close()


def test_long_poll_of_a_vanished_client_claims_nothing() -> None:
    store = MemoryStore()
    app = create_app(store)
    with serve_in_thread(app) as url:
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({"worker_id": "ghost", "timeout_s": 20}).encode()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(
            b"POST /claim HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert wait_until(lambda: app.server.active_polls == 1)
        sock.close()
        # work arriving now may still be taken by the held claim: it is given straight back
        rid = store.enqueue([NewRollout(config=RolloutConfig(max_attempts=2))])[0].id
        assert wait_until(lambda: app.server.active_polls == 0)  # noticed within a poll slice
        rollout = store.get_rollout(rid)
        assert rollout.status == "queued"
        assert all(a.status == "failed" and a.error.type == "client_disconnected" for a in rollout.attempts)  # type: ignore[union-attr]
        claim = store.claim("real-worker")
        assert claim is not None and claim.rollout.id == rid


def test_the_production_app_has_no_test_routes(served: tuple[MemoryStore, str]) -> None:
    _, url = served
    r = httpx.post(f"{url}/_test/stores")  # only agl.testing.store_server serves these
    assert r.status_code == 404 and error_of(r)["code"] == "no_route"


def test_the_test_server_gives_each_test_a_fresh_store() -> None:
    from agl.store.http import HttpStore
    from agl.testing.store_server import shared_test_server

    server = shared_test_server()
    first, second = server.new_namespace(), server.new_namespace()
    a, b = HttpStore(first), HttpStore(second)
    try:
        a.enqueue([NewRollout(id="only-in-a")])
        assert [r.id for r in a.query_rollouts()] == ["only-in-a"] and b.query_rollouts() == []
        assert httpx.get(f"{server.url}/rollouts/only-in-a").status_code == 404  # nor in the main store
    finally:
        a.close()
        b.close()
        server.drop_namespace(first)
        server.drop_namespace(second)
    r = httpx.get(f"{first}/rollouts/only-in-a")
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/json")


def test_unknown_ids_in_paths_are_not_found_on_both_sides(served: tuple[MemoryStore, str]) -> None:
    _, url = served
    client = HttpStore(url)
    for bad in ["a/b", "", "x" * 300, 5]:
        with pytest.raises(NotFoundError):
            client.get_rollout(bad)  # type: ignore[arg-type]
    r = httpx.get(f"{url}/rollouts/a%2Fb")
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/json")
    client.close()


def test_mounts_are_served_behind_the_guard_and_the_store_layer_has_no_ui() -> None:
    """``mounts=`` adds ASGI apps by prefix; without one, ``/ui`` is an unknown route (the store layer
    does not import the dashboard); a mount's ``is_public`` paths skip the token, the rest need it."""
    import subprocess
    import sys

    code = "import sys, agl.store.server; print(any(m.startswith('agl.dashboard') for m in sys.modules))"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        == "False\n"
    )

    closed: list[bool] = []

    class Echo:
        @staticmethod
        def is_public(path: str) -> bool:
            return path == "/open"

        async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
            body = f"echo {scope['path']}".encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-length", b"%d" % len(body))],
                }
            )
            await send({"type": "http.response.body", "body": body})

        def close(self) -> None:
            closed.append(True)

    store = MemoryStore()
    with serve_in_thread(store, token="t0") as url:
        r = httpx.get(f"{url}/ui/", headers={"Authorization": "Bearer t0"})
        assert r.status_code == 404 and r.json()["error"]["code"]
    with serve_in_thread(store, token="t0", mounts={"/x": Echo()}) as url:
        assert httpx.get(f"{url}/x/open").text.startswith("echo ")
        assert httpx.get(f"{url}/x/secret").status_code == 401
        assert httpx.get(f"{url}/x/secret", headers={"Authorization": "Bearer t0"}).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200
    assert closed == [True]
    for bad in ({"ui": Echo()}, {"/ui/": Echo()}, {"/ui": 3}, [("/ui", Echo())]):
        with pytest.raises(ValueError, match="mount"):
            create_app(store, mounts=bad)  # type: ignore[arg-type]
