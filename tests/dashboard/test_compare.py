"""The dashboard's comparison with a second run (``agl dashboard --compare RUN``): the JSON API over two
stores written span by span (no torch: the core env runs it), ``agl diff``'s answer for the same pair,
4xx on bad input, and the rollout and Runs pages in a real browser. Two real training runs compared
through the API are in tests/test_reproducible.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from dash_helpers import DashboardProcess, artifacts_dir
from recorded_runs import recorded_store
from starlette.testclient import TestClient

from agl.dashboard import create_dashboard_app
from agl.reports.diff import Run, diff_runs

BASE: dict[str, list[dict[str, Any]]] = {
    "train:s0/t0/m0": [{"ids": [5, 6]}, {"ids": [7, 8, 9, 10]}],
    "train:s0/t0/m1": [{"ids": [3]}],
    "train:s1/t0/m0": [{"ids": [4, 4]}],
}
#: run B: the second call of the first rollout parts at its second token (same prompt, seed, weights)
CHANGED = {**BASE, "train:s0/t0/m0": [{"ids": [5, 6]}, {"ids": [7, 11, 12, 10]}]}


class Letters:
    """A tokenizer of the test's own: token id i is the letter chr(96 + i) (the view shows text)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(96 + i) for i in ids)


def _store(calls: dict[str, list[dict[str, Any]]], prefix: str, path: Path | None = None) -> Any:
    """One finished rollout per place (ids differ per run: matching is by place), with its gateway calls."""
    return recorded_store(calls, prefix=prefix, path=path, name="chat m", distinct_seeds=True)


@pytest.fixture
def client() -> Any:
    a, b = _store(BASE, "a"), _store(CHANGED, "b")
    app = create_dashboard_app(a, tokenizer=Letters(), compare=Run("runs/b", b), close_store=True)
    with TestClient(app) as c:
        yield c


def test_a_rollout_that_parts_shows_its_first_call_side_by_side_with_the_reason(client: Any) -> None:
    assert client.get("/api/info").json()["compare"] == "runs/b"
    body = client.get("/api/rollouts/a-0/diff").json()
    assert (body["rollout_id"], body["other_rollout_id"], body["identical"]) == ("a-0", "b-0", False)
    d = body["divergence"]
    assert (d["step"], d["place"], d["call"], d["part"], d["first_token"]) == (
        0,
        "train:s0/t0/m0",
        1,
        "response",
        1,
    )
    assert d["reason"].startswith("same prompt, seed and weights version")
    assert (d["a"]["ids"], d["b"]["ids"]) == ([7, 8, 9, 10], [7, 11, 12, 10])
    assert (d["a"]["pieces"], d["b"]["pieces"]) == (list("ghij"), list("gklj"))
    assert d["a"]["offset"] == 0 and d["a"]["seed"] == 11 and d["b"]["rollout_id"] == "b-0"
    # a window: at most `tokens` from the first difference, with what is left counted
    short = client.get("/api/rollouts/a-0/diff?tokens=1").json()["divergence"]
    assert (short["b"]["ids"], short["b"]["more"]) == ([7, 11], 2)


def test_an_identical_rollout_says_so(client: Any) -> None:
    body = client.get("/api/rollouts/a-1/diff").json()
    assert body["identical"] and body["divergence"] is None
    assert (body["other_rollout_id"], body["calls"]) == ("b-1", 1)


def test_the_whole_run_view_is_agl_diffs_answer(client: Any) -> None:
    body = client.get("/api/diff").json()
    expected = diff_runs(Run("a", _store(BASE, "a")), Run("b", _store(CHANGED, "b"))).first
    assert expected is not None and not body["identical"]
    d = body["divergence"]
    assert (d["place"], d["call"], d["first_token"], d["reason"]) == (
        expected.place,
        expected.call,
        expected.first_token,
        expected.reason,
    )
    assert d["a"]["rollout_id"] == "a-0"


def test_prompts_that_differ_and_a_rollout_only_in_one_run() -> None:
    other = {"train:s0/t0/m0": [{"ids": [5, 6]}, {"ids": [7, 8, 9, 10], "prompt": [1, 2, 3]}]}
    app = create_dashboard_app(
        _store(BASE, "a"), tokenizer=None, compare=Run("b", _store(other, "b")), close_store=True
    )
    with TestClient(app) as c:
        d = c.get("/api/rollouts/a-0/diff").json()["divergence"]
        assert (d["call"], d["part"], d["first_token"]) == (1, "prompt", 2)
        assert d["reason"].startswith("different prompt") and d["a"]["pieces"] is None
        assert (d["a"]["ids"], d["b"]["ids"]) == ([1, 2], [1, 2, 3])
        body = c.get("/api/rollouts/a-2/diff").json()
        assert body["other_rollout_id"] is None and body["divergence"]["part"] is None
        assert "only in A" in body["divergence"]["reason"]


def test_bad_input_is_a_json_4xx() -> None:
    with TestClient(create_dashboard_app(_store(BASE, "a"), close_store=True)) as c:
        r = c.get("/api/rollouts/a-0/diff")  # started without --compare
        assert r.status_code == 404 and "--compare RUN" in r.json()["error"]["message"]
        assert c.get("/api/diff").status_code == 404
        assert c.get("/api/info").json()["compare"] is None
    app = create_dashboard_app(_store(BASE, "a"), compare=Run("b", _store(BASE, "b")), close_store=True)
    with TestClient(app) as c:
        r = c.get("/api/rollouts/nope/diff")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        for bad in ("0", "x", "99999"):
            r = c.get(f"/api/rollouts/a-0/diff?tokens={bad}")
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_input"


def test_the_cli_refuses_a_compare_run_that_is_not_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agl.cli import main

    _store(BASE, "a", tmp_path / "a.db").close()
    assert (
        main(
            [
                "dashboard",
                "--store",
                f"sqlite:///{tmp_path / 'a.db'}",
                "--compare",
                str(tmp_path / "no"),
                "--tokenizer",
                "none",
            ]
        )
        != 0
    )
    err = capsys.readouterr().err
    assert "no such run directory" in err and len(err.strip().splitlines()) == 1


def test_the_pages_show_the_divergence_in_a_browser(tmp_path: Path, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    _store(BASE, "a", tmp_path / "a.db").close()
    run_b = tmp_path / "b"
    run_b.mkdir()
    _store(CHANGED, "b", run_b / "store.db").close()
    (run_b / "metrics.jsonl").write_text(json.dumps({"step": 0, "train_reward": 0.5}) + "\n")
    dash = DashboardProcess(
        f"sqlite:///{tmp_path / 'a.db'}",
        "--compare",
        str(run_b),
        "--tokenizer",
        "none",
        log=tmp_path / "d.log",
    )
    try:

        def wait(css: str, count: int = 1) -> list[Any]:
            return WebDriverWait(browser, 20).until(
                lambda d: (els := d.find_elements(By.CSS_SELECTOR, css)) and len(els) >= count and els,
                message=f"no {css!r}",
            )

        browser.get(f"{dash.url}/#/rollout/a-0")
        reason = wait("#compare .reason")[0]
        assert "same prompt, seed and weights version" in reason.text
        assert (
            "step 0, rollout train:s0/t0/m0, call 1"
            in browser.find_element(By.CSS_SELECTOR, "#compare .where").text
        )
        for side, ids in (("A", ["8", "9", "10"]), ("B", ["11", "12", "10"])):
            toks = browser.find_elements(By.CSS_SELECTOR, f'#compare .side[data-side="{side}"] .tok.differs')
            assert [t.text.strip() for t in toks] == ids
        browser.save_screenshot(str(artifacts_dir() / "compare-rollout.png"))
        browser.get(f"{dash.url}/#/rollout/a-1")
        assert "identical: b-1 made the same 1 LLM call(s)" in wait("#compare .identical")[0].text
        browser.get(f"{dash.url}/#/runs")
        card = wait("#run-compare .reason")[0]
        assert "same prompt, seed and weights version" in card.text
        assert (
            browser.find_element(By.CSS_SELECTOR, "#run-compare .diff-link")
            .get_attribute("href")
            .endswith("#/rollout/a-0")
        )
        browser.save_screenshot(str(artifacts_dir() / "compare-runs.png"))
    finally:
        dash.stop()
