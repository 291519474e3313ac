"""The dashboard's JSON API without a browser: token rules, bad input, paging and filters, live
changes, cancel, and the ``/ui`` mount of the store server."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from agl import semconv as sc
from agl.dashboard import create_dashboard_app
from agl.dashboard.index import Filters, RolloutIndex
from agl.dashboard.mount import ui_mounts
from agl.store.memory import MemoryStore
from agl.store.server import serve_in_thread
from agl.types import NewRollout, Span


def _reward_span(rid: str, value: float, i: int, primary: bool = True) -> Span:
    return Span(
        trace_id="cd" * 16,
        span_id=f"{i + 1:016x}",
        name=sc.SPAN_REWARD,
        start_ns=i,
        end_ns=i + 1,
        rollout_id=rid,
        attempt=1,
        attributes={sc.AGL_REWARD_VALUE: value, sc.AGL_REWARD_PRIMARY: primary},
    )


@pytest.fixture
def store() -> Any:
    """30 rollouts: 20 finished train ones (reward i/10 at version 1 or 2), 5 val, 5 still queued."""
    s = MemoryStore()
    s.add_resources({"main": {"type": "llm", "base_url": "http://x", "model": "m"}})
    s.add_resources({"main": {"type": "llm", "base_url": "http://x", "model": "m"}})
    for i in range(25):
        mode = "train" if i < 20 else "val"
        s.enqueue([NewRollout(id=f"ro-{i:02d}", mode=mode, resources_version=1 + i % 2)])
        s.claim("w1")
        s.add_spans(
            [_reward_span(f"ro-{i:02d}", i / 10, 2 * i), _reward_span(f"ro-{i:02d}", 99.0, 2 * i + 1, False)]
        )
        s.finish_attempt(f"ro-{i:02d}", 1, "succeeded")
    s.enqueue([NewRollout(id=f"ro-q{i}") for i in range(5)])
    yield s
    s.close()


def test_index_pages_newest_first_and_filters_server_side(store: MemoryStore) -> None:
    index = RolloutIndex(store)
    try:
        page = index.page(Filters(), offset=0, limit=10)
        assert page["total"] == 30 and [r["id"] for r in page["rollouts"]][:6] == [
            "ro-q4", "ro-q3", "ro-q2", "ro-q1", "ro-q0", "ro-24",
        ]  # fmt: skip
        last = index.page(Filters(), offset=25, limit=10)
        assert [r["id"] for r in last["rollouts"]] == ["ro-04", "ro-03", "ro-02", "ro-01", "ro-00"]
        train = index.page(Filters(mode="train", resources_version=2), limit=100)
        assert [r["id"] for r in train["rollouts"]] == [f"ro-{i:02d}" for i in range(19, 0, -2)]
        # the final primary reward, not the non-primary 99
        by_reward = index.page(Filters(reward_min=0.5, reward_max=1.0), limit=100)
        assert sorted(r["id"] for r in by_reward["rollouts"]) == [f"ro-{i:02d}" for i in range(5, 11)]
        assert all(r["reward"] == int(r["id"][3:]) / 10 for r in by_reward["rollouts"])
        queued = index.page(Filters(status=frozenset({"queued"})), limit=100)
        assert queued["total"] == 5 and all(r["reward"] is None for r in queued["rollouts"])
        curve, pending = index.reward_curve()
        assert pending == 0
        assert [(c["step"], c["rollouts"], c["val_rollouts"]) for c in curve] == [(1, 10, 3), (2, 10, 2)]
        assert [c["version"] for c in curve] == [1, 2]  # no step recorded on these rollouts: the version
        assert curve[0]["train_reward"] == pytest.approx(sum(i / 10 for i in range(0, 20, 2)) / 10)
    finally:
        index.close()


def test_long_poll_wakes_on_a_change_and_times_out_without_one(store: MemoryStore) -> None:
    index = RolloutIndex(store, min_interval_s=0.05)
    try:
        v = index.page(Filters())["version"]
        t0 = time.monotonic()
        assert index.wait_for_change(v, 0.3) == v  # nothing changed: held until the timeout
        assert time.monotonic() - t0 >= 0.25
        threading.Timer(0.3, lambda: store.enqueue([NewRollout(id="ro-new")])).start()
        t0 = time.monotonic()
        assert index.wait_for_change(v, 10.0) > v
        assert time.monotonic() - t0 < 5.0
        assert index.page(Filters(search="ro-new"))["total"] == 1
    finally:
        index.close()


def test_api_token_rules_bad_input_and_cancel(store: MemoryStore) -> None:
    app = create_dashboard_app(store, token="t0k")
    with TestClient(app) as client:
        assert client.get("/").status_code == 200  # the page loads and then asks for the token
        assert "importmap" in client.get("/").text
        assert client.get("/static/vendor/preact.mjs").status_code == 200
        r = client.get("/api/rollouts")
        assert r.status_code == 401 and r.json()["error"]["message"] == "missing bearer token"
        r = client.get("/api/rollouts", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["message"] == "invalid bearer token"
        assert client.get("/api/nope", headers={"Authorization": "Bearer nope"}).status_code == 401
        h = {"Authorization": "Bearer t0k"}
        data = client.get("/api/rollouts?limit=5&status=queued", headers=h).json()
        assert data["total"] == 5 and data["facets"]["status"] == {"succeeded": 25, "queued": 5}
        for bad, word in [
            ("status=done", "unknown status"),
            ("mode=prod", "unknown mode"),
            ("limit=0", "limit"),
            ("reward_min=abc", "reward_min"),
            ("reward_min=nan", "finite"),
            ("reward_min=2&reward_max=1", "above"),
            ("offset=-1", "offset"),
        ]:
            r = client.get(f"/api/rollouts?{bad}", headers=h)
            assert r.status_code == 400 and word in r.json()["error"]["message"], bad
        assert client.get("/api/rollouts/ro-nope", headers=h).status_code == 404
        assert client.get("/api/rollouts/ro-00/attempts/7/spans", headers=h).status_code == 404
        r = client.get("/api/rollouts/ro-00/attempts/1/transitions?air_tool_error=x", headers=h)
        assert r.status_code == 400
        assert client.get("/api/nope", headers=h).status_code == 404
        # cancel: the one write; a finished rollout cannot be cancelled (409, unchanged)
        r = client.post("/api/rollouts/ro-q0/cancel", headers=h)
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        assert store.get_rollout("ro-q0").status == "cancelled"
        r = client.post("/api/rollouts/ro-00/cancel", headers=h)
        assert r.status_code == 409 and store.get_rollout("ro-00").status == "succeeded"
        assert (
            client.post("/api/rollouts/ro-q1/cancel", headers={"Authorization": "Bearer x"}).status_code
            == 401
        )
        assert store.get_rollout("ro-q1").status == "queued"


def _is_icon(r: httpx.Response) -> bool:
    return (
        r.status_code == 200 and r.content[:4] == b"\x00\x00\x01\x00" and "icon" in r.headers["content-type"]
    )


def test_favicon_is_served_standalone_and_under_the_ui_mount(store: MemoryStore) -> None:
    """No 404 (a console error on every page load): the page names its icon, the app serves it."""
    with TestClient(create_dashboard_app(store, token="t")) as client:
        assert _is_icon(client.get("/favicon.ico"))  # no token needed: it holds no data
        page = client.get("/").text
        assert '<link rel="icon" href="static/favicon.ico">' in page
        assert _is_icon(client.get("/static/favicon.ico"))
    with serve_in_thread(store, token="s3", mounts=ui_mounts(store)) as url:
        page = httpx.get(f"{url}/ui/", follow_redirects=True).text
        assert 'rel="icon" href="static/favicon.ico"' in page  # relative: /ui/static/favicon.ico
        assert _is_icon(httpx.get(f"{url}/ui/static/favicon.ico"))
        assert _is_icon(httpx.get(f"{url}/ui/favicon.ico"))


def test_ui_mount_of_the_store_server_uses_the_server_token(store: MemoryStore) -> None:
    with serve_in_thread(store, token="s3", mounts=ui_mounts(store)) as url:
        page = httpx.get(f"{url}/ui", follow_redirects=True)
        assert page.status_code == 200 and str(page.url).endswith("/ui/") and "agl dashboard" in page.text
        assert httpx.get(f"{url}/ui/static/app.js").status_code == 200
        r = httpx.get(f"{url}/ui/api/rollouts")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert httpx.get(f"{url}/ui/api/rollouts", headers={"Authorization": "Bearer no"}).status_code == 401
        assert httpx.get(f"{url}/rollouts/ro-00").status_code == 401  # the store API stays guarded
        r = httpx.get(f"{url}/ui/api/rollouts?limit=3", headers={"Authorization": "Bearer s3"})
        assert r.status_code == 200 and r.json()["store_total"] == 30
        r = httpx.get(f"{url}/ui/api/rollouts/ro-03/attempts/1/spans", headers={"Authorization": "Bearer s3"})
        assert [row["tag"] for row in r.json()["rows"]] == ["reward", "reward"]


class _NoOffset:
    """A Store implementation from before ``query_rollouts(offset=)``: the index re-reads it whole."""

    def __init__(self, store: MemoryStore) -> None:
        self._s = store

    def query_rollouts(self, **kw: Any) -> list[Any]:
        if "offset" in kw:
            raise TypeError("query_rollouts() got an unexpected keyword argument 'offset'")
        return self._s.query_rollouts(**kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s, name)


@pytest.mark.parametrize("wrap", [False, True], ids=["incremental", "whole"])
def test_refresh_follows_new_and_changing_rollouts(store: MemoryStore, wrap: bool) -> None:
    index = RolloutIndex(_NoOffset(store) if wrap else store)
    try:
        assert index.page(Filters(status=frozenset({"queued"})))["total"] == 5
        v = index.version
        assert index.refresh() is False and index.version == v  # nothing changed, nothing announced
        c = store.claim("w9")
        assert c is not None and c.rollout.id == "ro-q0"
        store.enqueue([NewRollout(id="ro-late", mode="test")])
        assert index.refresh() is True and index.version == v + 1
        page = index.page(Filters(status=frozenset({"running"})))
        assert [(r["id"], r["worker_id"]) for r in page["rollouts"]] == [("ro-q0", "w9")]
        assert index.page(Filters(mode="test"))["rollouts"][0]["id"] == "ro-late"
        assert index.facets()["status"] == {"succeeded": 25, "queued": 5, "running": 1}
        store.finish_attempt("ro-q0", 1, "failed", error={"type": "Boom", "message": "no"})
        assert index.refresh() is True
        (row,) = index.page(Filters(search="ro-q0"))["rollouts"]
        assert row["status"] == "failed" and row["error"] == "Boom: no" and row["reward"] is None
    finally:
        index.close()


def test_stale_attempts_and_their_spans_are_marked() -> None:
    """An attempt whose lease expired ends ``lost``: it and its spans show as stale, the retry counts."""
    s = MemoryStore()
    s.enqueue([NewRollout(id="ro-lost", config={"lease_s": 0.05, "max_attempts": 2})])
    s.claim("w-dead")
    s.add_spans([_reward_span("ro-lost", 1.0, 0)])
    time.sleep(0.2)
    c = s.claim("w-alive")
    assert c is not None and c.attempt.number == 2
    s.finish_attempt("ro-lost", 2, "succeeded")
    with TestClient(create_dashboard_app(s)) as client:
        r = client.get("/api/rollouts/ro-lost").json()
        assert [(a["status"], a["stale"], a["finishing"]) for a in r["attempts"]] == [
            ("lost", True, False),
            ("succeeded", False, True),
        ]
        tree = client.get("/api/rollouts/ro-lost/attempts/1/spans").json()
        assert tree["stale"] == 1 and tree["rows"][0]["stale"] is True
        # the reward of a rollout is its finishing attempt's: attempt 2 reported none
        assert client.get("/api/rollouts?q=ro-lost").json()["rollouts"][0]["reward"] is None
    s.close()


def test_cli_errors_are_one_line(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from agl.cli import main

    assert main(["dashboard", "--store", f"sqlite:///{tmp_path / 'nope.db'}"]) == 2
    assert "no store at" in capsys.readouterr().err
    assert main(["dashboard", "--store", "memory://", "--run-dir", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["dashboard", "--store", "memory://", "--host", "0.0.0.0", "--tokenizer", "none"]) == 2
    assert "without a token" in capsys.readouterr().err
    assert main(["dashboard", "--store", "memory://", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err


def test_version_metrics_through_the_adapter(store: MemoryStore) -> None:
    with TestClient(create_dashboard_app(store)) as client:
        m = client.get("/api/metrics?version=2").json()
        # 10 train rollouts at version 2, each its own group, with reward spans but no LLM calls
        assert (m["rollouts"], m["transitions"], m["groups"]) == (10, 0, 0)
        assert m["exact_token_ratio"] is None and m["adapter"]["reward_spans"] == 20
        assert m["exact_by_api"] == {} and m["exact_by_backend"] == {}  # no LLM calls: no rows
        assert client.get("/api/metrics?version=2&mode=prod").status_code == 400


def test_first_load_is_the_newest_chunk_then_older_ones_fill_in(store: MemoryStore) -> None:
    index = RolloutIndex(store, chunk=7, background=False)
    try:
        first = index.page(Filters(), limit=5)
        assert [r["id"] for r in first["rollouts"]] == ["ro-q4", "ro-q3", "ro-q2", "ro-q1", "ro-q0"]
        assert first["total"] == 7 and first["indexing"] == {"loaded": 7, "total": 30}
        store.enqueue([NewRollout(id="ro-newer")])
        assert index.refresh() is True  # new rollouts are caught up while older ones still load
        while index.backfill():
            pass
        assert index.complete
        page = index.page(Filters(), limit=100)
        assert page["indexing"] is None and page["total"] == 31
        assert [r["id"] for r in page["rollouts"]][::-1] == [f"ro-{i:02d}" for i in range(25)] + [
            f"ro-q{i}" for i in range(5)
        ] + ["ro-newer"]
        assert index.facets()["status"] == {"succeeded": 25, "queued": 6}
    finally:
        index.close()


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 17])
def test_count_by_offset_probes(n: int) -> None:
    s = MemoryStore()
    if n:
        s.enqueue([NewRollout() for _ in range(n)])
    index = RolloutIndex(s)
    assert index._count() == n
    index.close()


def test_runs_page_carries_the_monitors_warnings_and_metrics(store: MemoryStore, tmp_path: Any) -> None:
    import json

    warning = {
        "monitor": "heldout_trend",
        "step": 4,
        "message": "train up, held-out down",
        "rollouts": ["v1"],
    }
    lines = [
        {"step": 0, "train_reward": 0.2, "monitor_length_drift": None, "monitor_warnings": []},
        {"step": 4, "train_reward": 0.8, "monitor_length_drift": 0.7, "monitor_warnings": [warning, "junk"]},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with TestClient(create_dashboard_app(store, run_dirs=[tmp_path])) as client:
        body = client.get("/api/runs").json()
    (run,) = body["runs"]
    assert run["warnings"] == [warning]  # the malformed entry is dropped, the step and evidence kept
    assert run["records"][1]["monitor_length_drift"] == 0.7
    assert ["response-length drift", "monitor_length_drift"] in body["key_metrics"]


def test_rows_and_attempts_show_the_failure_kind() -> None:
    """Rollouts ended each way by a real run (agl's gateway with the scripted engine answering a 502 on
    chosen calls, the openai client, the Runner): each table row and the rollout's page say its failure
    kind — what the trainer does with it — and so does the attempt that decided it; a queued or
    cancelled rollout has none."""
    pytest.importorskip("openai")
    from agl.gateway.testing import ScriptedBackend, serve_gateway
    from agl.runner.runner import Runner
    from agl.tracing import provider as tracing
    from agl.types import LLM, RolloutConfig
    from tests.test_failures import agent, script

    cases = {"raised_502": "infra", "bug": "agent", "wrong": "task", "no_reward": "no_reward"}
    s = MemoryStore()
    try:
        with serve_gateway(ScriptedBackend(script), s) as url:
            s.add_resources({"main": LLM(base_url=str(url), model="scripted")})
            cfg = RolloutConfig(max_attempts=1)
            s.enqueue([NewRollout(id=f"ro-{do}", input={"do": do}, config=cfg) for do in cases])
            Runner(agent, s, concurrency=2, claim_timeout_s=0.05).run(until_idle=True)
        s.enqueue([NewRollout(id="ro-queued"), NewRollout(id="ro-cancelled")])
        s.cancel("ro-cancelled")
        with TestClient(create_dashboard_app(s)) as client:
            rows = client.get("/api/rollouts?limit=50").json()["rollouts"]
            kinds = {r["id"]: r["failure_kind"] for r in rows}
            assert kinds == {
                **{f"ro-{do}": k for do, k in cases.items()},
                "ro-queued": None,
                "ro-cancelled": None,
            }
            for do, kind in cases.items():
                page = client.get(f"/api/rollouts/ro-{do}").json()
                assert page["failure_kind"] == kind
                assert [a["failure_kind"] for a in page["attempts"]] == [kind]
            assert client.get("/api/rollouts/ro-queued").json()["failure_kind"] is None
    finally:
        tracing.reset_tracing()
        s.close()
