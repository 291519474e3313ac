"""Property-based: malformed and hostile requests to every route get a 4xx JSON error, never a 500;
the server stays up and the store is unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl.dashboard.mount import ui_mounts
from agl.store.server import serve_in_thread
from agl.store.sqlite import SQLiteStore
from agl.types import NewRollout, Span

SETTINGS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

#: routes that change state when given a valid body: every body we send them must be invalid
WRITE_ROUTES = [
    ("POST", "/tasks"),
    ("POST", "/rollouts"),
    ("POST", "/claim"),
    ("POST", "/spans"),
    ("POST", "/resources"),
    ("POST", "/rollouts/{rid}/attempts/1/finish"),
]
#: routes that only read (or refuse unknown ids): any body goes
READ_ROUTES = [
    ("POST", "/tasks/query"),
    ("POST", "/rollouts/query"),
    ("POST", "/spans/query"),
    ("POST", "/rollouts/wait"),
]
ID_ROUTES = [
    ("GET", "/tasks/{id}"),
    ("GET", "/rollouts/{id}"),
    ("GET", "/rollouts/{id}/attempts"),
    ("POST", "/rollouts/{id}/cancel"),
    ("POST", "/rollouts/{id}/attempts/1/heartbeat"),
    ("POST", "/rollouts/{id}/attempts/1/finish"),
    ("GET", "/resources/{id}"),
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=25,
)
FIELDS = [
    "tasks", "rollouts", "spans", "items", "worker_id", "timeout_s", "modes", "status", "error", "mode",
    "limit", "ids", "idempotency_key", "rollout_id", "attempt", "name", "trace_id", "include_stale",
]  # fmt: skip
near_valid = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=4)
hostile_literals = st.sampled_from(
    [
        b"[" * 5000 + b"]" * 5000,
        b'{"a":' * 3000 + b"1" + b"}" * 3000,
        b'{"timeout_s": 1e999999}',
        b'{"limit": 100000000000000000000000000000000000000000}',
        b'{"spans": [{"trace_id": "\\ud800"}]}',
        b"\xff\xfe\x00\x00",
        b'{"spans": NaN}',
        b'{"worker_id": "w", "worker_id": "w2", "bogus": 1}',
        b"\x00" * 100,
        b'{"items": {"main": {"type": "llm", "base_url": "' + b"x" * 10000 + b'"}}, "x": 1}',
        b"null",
        b'"just a string"',
    ]
)


def as_invalid(value: Any) -> bytes:
    """Any JSON value made certainly invalid for a write route: non-objects are, objects get a stray key."""
    if isinstance(value, dict):
        value = {**value, "\u2603 not a field": True}
    return json.dumps(value).encode()


write_bodies = (
    st.binary(max_size=300) | hostile_literals | json_values.map(as_invalid) | near_valid.map(as_invalid)
)
any_bodies = (
    st.binary(max_size=300)
    | hostile_literals
    | json_values.map(lambda v: json.dumps(v).encode())
    | near_valid.map(lambda v: json.dumps(v).encode())
)
content_types = st.sampled_from(
    ["application/json", "text/plain", "application/x-protobuf", "", "application/json; charset=evil;;;"]
)
bad_ids = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="/?#%"), min_size=1, max_size=60
).filter(lambda s: not s.startswith("ro-0") and s.strip() == s)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SQLiteStore, str, str]]:
    store = SQLiteStore(Path(tmp_path_factory.mktemp("hostile")) / "s.db")
    store.add_tasks([{"id": "t1", "input": {"q": 1}}])  # type: ignore[list-item]
    rid = store.enqueue([NewRollout(id="ro-0live", input={"x": 1}), NewRollout(id="ro-0queued")])[0].id
    store.claim("w")
    store.add_spans(
        [Span(trace_id="a" * 32, span_id="b" * 16, name="s", start_ns=1, end_ns=2, rollout_id=rid, attempt=1)]
    )
    store.add_resources({"main": {"type": "llm", "base_url": "http://x/v1", "model": "m"}})
    with serve_in_thread(store, max_body_bytes=16 * 1024, mounts=ui_mounts(store)) as url:
        yield store, url, rid
    store.close()


@pytest.fixture(scope="module")
def client(world: tuple[SQLiteStore, str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=world[1], timeout=60) as c:
        yield c


def snapshot(store: SQLiteStore) -> Any:
    res = store.get_resources()
    return (
        [r.model_dump(exclude={"attempts"}) for r in store.query_rollouts()],
        [[a.model_dump() for a in store.get_attempts(r.id)] for r in store.query_rollouts()],
        [s.model_dump() for s in store.query_spans()],
        [t.model_dump() for t in store.query_tasks()],
        None if res is None else res.model_dump(),
    )


def check_error(resp: httpx.Response) -> None:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:500])
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    err = resp.json()["error"]
    assert isinstance(err["code"], str) and err["code"] and isinstance(err["message"], str) and err["message"]


@pytest.fixture(scope="module")
def baseline(world: tuple[SQLiteStore, str, str]) -> Any:
    return snapshot(world[0])


@SETTINGS
@given(route=st.sampled_from(WRITE_ROUTES), body=write_bodies, ctype=content_types)
def test_invalid_writes_are_refused_without_change(
    world: tuple[SQLiteStore, str, str],
    client: httpx.Client,
    baseline: Any,
    route: tuple[str, str],
    body: bytes,
    ctype: str,
) -> None:
    store, _, rid = world
    method, path = route
    resp = client.request(method, path.format(rid=rid), content=body, headers={"content-type": ctype})
    check_error(resp)
    assert snapshot(store) == baseline


@SETTINGS
@given(route=st.sampled_from(READ_ROUTES), body=any_bodies, ctype=content_types)
def test_reads_with_any_body_answer_json(
    world: tuple[SQLiteStore, str, str],
    client: httpx.Client,
    baseline: Any,
    route: tuple[str, str],
    body: bytes,
    ctype: str,
) -> None:
    method, path = route
    resp = client.request(method, path, content=body, headers={"content-type": ctype})
    if resp.status_code != 200:
        check_error(resp)
    else:
        assert isinstance(resp.json(), dict)
    assert snapshot(world[0]) == baseline


@SETTINGS
@given(route=st.sampled_from(ID_ROUTES), ident=bad_ids, body=any_bodies)
def test_unknown_ids_in_paths(
    world: tuple[SQLiteStore, str, str],
    client: httpx.Client,
    baseline: Any,
    route: tuple[str, str],
    ident: str,
    body: bytes,
) -> None:
    method, path = route
    resp = client.request(method, path.replace("{id}", quote(ident, safe="")), content=body)
    check_error(resp)
    assert snapshot(world[0]) == baseline


@SETTINGS
@given(
    path=st.text(max_size=80),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    body=any_bodies,
)
def test_random_paths_and_methods(
    world: tuple[SQLiteStore, str, str],
    client: httpx.Client,
    baseline: Any,
    path: str,
    method: str,
    body: bytes,
) -> None:
    url = "/" + "".join(
        ch if (ch.isascii() and ch.isalnum()) or ch in "/-_." else f"%{ord(ch) % 256:02X}" for ch in path
    )
    if method == "GET" and url in ("/health", "/resources/latest"):
        return
    resp = client.request(method, url, content=body if method != "GET" else None)
    if resp.status_code in (307, 308) and url.rstrip("/") == "/ui":
        assert resp.headers["location"].endswith("/ui/")  # the dashboard page lives at /ui/
    elif resp.status_code != 200:
        check_error(resp)
    assert snapshot(world[0]) == baseline


@SETTINGS
@given(
    body=st.binary(max_size=400) | hostile_literals,
    ctype=content_types,
    encoding=st.sampled_from(["", "gzip", "zstd"]),
)
def test_otlp_garbage(
    world: tuple[SQLiteStore, str, str],
    client: httpx.Client,
    baseline: Any,
    body: bytes,
    ctype: str,
    encoding: str,
) -> None:
    headers = {"content-type": ctype}
    if encoding:
        headers["content-encoding"] = encoding
    resp = client.post("/v1/traces", content=body, headers=headers)
    if resp.status_code != 200:  # random bytes can be a valid (empty) protobuf message
        check_error(resp)
    assert snapshot(world[0]) == baseline


def test_server_still_up_after_all_that(
    world: tuple[SQLiteStore, str, str], client: httpx.Client, baseline: Any
) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get(f"/rollouts/{world[2]}").json()["status"] == "running"
    assert snapshot(world[0]) == baseline
