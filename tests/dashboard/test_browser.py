"""The dashboard in a real browser (headless Chromium + Selenium) against a store filled by a real
scripted run (examples/calc_agent: AutoGen AgentChat, the gateway's scripted model, the Runner).

Served the two ways users open it: under ``/ui`` of ``agl store serve`` (with a token) and by
``agl dashboard`` (with a run directory). Screenshots go to the test artifacts directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from dash_helpers import DashboardProcess, artifacts_dir

from agl import semconv as sc
from agl.dashboard.index import final_reward
from agl.store.server import ServerProcess

TOKEN = "dash-s3cret"


def _wait(driver: Any, css: str, timeout: float = 20.0, count: int = 1) -> list[Any]:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def found(d: Any) -> Any:
        els = d.find_elements(By.CSS_SELECTOR, css)
        return els if len(els) >= count else False

    return WebDriverWait(driver, timeout).until(found, message=f"no {count}x {css!r} on {driver.current_url}")


def _until(driver: Any, cond: Any, timeout: float = 20.0, message: str = "") -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(lambda d: cond(d), message=message)


def _shot(driver: Any, name: str) -> None:
    driver.save_screenshot(str(artifacts_dir() / f"{name}.png"))


def _metric(driver: Any, key: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, f'#version-metrics tr[data-key="{key}"] td.num').text


def _truth(store_url: str) -> dict[str, Any]:
    """What the pages must show, read straight from the store."""
    import agl.store

    store = agl.store.open(store_url)
    try:
        rollouts = store.query_rollouts()
        rewards, sloppy = {}, None
        for r in rollouts:
            spans = store.query_spans(rollout_id=r.id, attempt=1)
            rewards[r.id] = final_reward(spans)
            if any(s.name == sc.SPAN_EXECUTE_TOOL and s.status.code == "ERROR" for s in spans):
                sloppy = r.id
        from agl.adapter import Adapter

        ts = Adapter().from_store(store, [r.id for r in rollouts])
        air = sum(1 for t in ts if t.intermediate_reward != 0)  # calc_agent emits no rewards of its own
        return {
            "ids": [r.id for r in rollouts],
            "rewards": rewards,
            "sloppy": sloppy,
            "transitions": len(ts),
            "air_share": air / len(ts),
        }
    finally:
        store.close()


@pytest.fixture(scope="module")
def served(scripted_store: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    db = scripted_store.removeprefix("sqlite:///")
    truth = _truth(scripted_store)
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = ServerProcess(db, token=TOKEN, log_path=log)
    server.start()
    try:
        yield server, truth
    finally:
        server.stop()


def test_ui_under_store_serve_token_pages_tree_and_tokens(served: Any, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    server, truth = served
    base = f"{server.url}/ui/"
    browser.get("about:blank")
    browser.get(base + "#/rollouts")
    browser.execute_script("localStorage.clear()")
    browser.refresh()

    # no token: the API answers 401 and the page says so
    banner = _wait(browser, "#auth-banner")[0]
    assert "401" in banner.text and "missing bearer token" in banner.text
    _shot(browser, "01-no-token")
    # a wrong token: still 401, named as invalid
    browser.find_element(By.ID, "token-input").send_keys("wrong")
    browser.find_element(By.ID, "token-save").click()
    _until(browser, lambda d: "invalid bearer token" in d.find_element(By.ID, "auth-banner").text)
    _shot(browser, "02-wrong-token")
    browser.find_element(By.ID, "token-input").send_keys(TOKEN)
    browser.find_element(By.ID, "token-save").click()

    # Rollouts: every rollout of the run, newest first, with its reward
    rows = _wait(browser, "#rollouts-table tbody tr", count=len(truth["ids"]))
    assert [r.get_attribute("data-id") for r in rows] == truth["ids"][::-1]
    assert not browser.find_elements(By.ID, "auth-banner")
    for row in rows:
        reward = truth["rewards"][row.get_attribute("data-id")]
        assert row.find_element(By.CSS_SELECTOR, ".reward").text == f"{reward:g}"
    assert browser.find_element(By.ID, "page-info").text.startswith(
        f"1–{len(truth['ids'])} of {len(truth['ids'])}"
    )
    _shot(browser, "03-rollouts")

    # the reward filter is applied by the server
    zero = sorted(i for i, v in truth["rewards"].items() if v == 0.0)
    assert zero, "the scripted run has wrong answers (reward 0)"
    browser.find_element(By.ID, "f-reward-max").send_keys("0.5\n")
    _until(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#rollouts-table tbody tr")) == len(zero))
    got = sorted(
        r.get_attribute("data-id") for r in browser.find_elements(By.CSS_SELECTOR, "#rollouts-table tbody tr")
    )
    assert got == zero

    # Rollout detail: the agent, the LLM calls, the calculator tool and its ERROR span
    rid = truth["sloppy"]
    assert rid is not None
    browser.get(f"{base}#/rollout/{rid}")
    _wait(browser, "#span-tree .span-row[data-span]", count=5)
    agents = browser.find_elements(By.CSS_SELECTOR, '.span-row[data-tag="agent"]')
    tools = browser.find_elements(By.CSS_SELECTOR, '.span-row[data-tag="tool"]')
    llms = browser.find_elements(By.CSS_SELECTOR, '.span-row[data-tag="llm"]')
    assert agents and all("solver" in a.text for a in agents)
    assert len(tools) == 2 and all("calculator" in t.text for t in tools)
    assert len(llms) >= 3
    failed = browser.find_elements(By.CSS_SELECTOR, '.span-row[data-tag="tool"][data-status="ERROR"]')
    assert len(failed) == 1 and "ERROR" in failed[0].text
    assert "error" in failed[0].get_attribute("class")
    failed[0].click()
    panel = _wait(browser, "#span-attributes")[0]
    _until(browser, lambda d: sc.GEN_AI_TOOL_NAME in d.find_element(By.ID, "span-panel").text)
    assert "calculator" in panel.text and "ERROR" in browser.find_element(By.ID, "span-panel").text
    _shot(browser, "04-rollout-tree")

    # Transitions: prompt tokens masked, response tokens trained, AIR on the malformed call
    browser.find_element(By.ID, "transitions-link").click()
    cards = _wait(browser, ".transition", count=3)
    first = cards[0]
    assert first.get_attribute("data-exact") == "true" and "exact token ids" in first.text
    masked = first.find_elements(By.CSS_SELECTOR, ".tok.masked")
    trained = first.find_elements(By.CSS_SELECTOR, ".tok.trained")
    assert masked and trained
    header = first.text
    assert f"{len(masked)} prompt + {len(trained)} response tokens" in header
    assert "calculator" in "".join(t.text for t in trained)  # the (malformed) tool call is what is trained
    assert first.find_element(By.CSS_SELECTOR, ".air").text == "-0.100"
    colours = browser.execute_script(
        "return [getComputedStyle(arguments[0]).backgroundColor, getComputedStyle(arguments[1]).backgroundColor]",
        masked[0],
        trained[0],
    )
    assert colours[0] != colours[1]
    for card in cards[1:]:
        assert card.find_element(By.CSS_SELECTOR, ".air").text == "0"
    response_tokens = [len(c.find_elements(By.CSS_SELECTOR, ".tok.trained")) for c in cards]
    _shot(browser, "05-transitions")

    # AIR off: the penalty disappears
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element(By.ID, "t-air")).select_by_visible_text("off")
    browser.find_element(By.ID, "t-apply").click()
    _until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".transition .air")[0].text == "0")

    # merged sequences: the agent's three calls extend one another exactly, so they are one sequence
    # whose loss mask trains the three responses and masks the tool results in between
    Select(browser.find_element(By.ID, "t-view")).select_by_visible_text("merged sequences")
    browser.find_element(By.ID, "t-apply").click()
    (seq,) = _wait(browser, ".trajectory")
    assert len(seq.find_elements(By.CSS_SELECTOR, ".segments tbody tr")) == 3
    assert len(seq.find_elements(By.CSS_SELECTOR, ".seg-mark")) == 3
    assert len(seq.find_elements(By.CSS_SELECTOR, ".tok.trained")) == sum(response_tokens)
    masked_between = seq.find_elements(By.CSS_SELECTOR, ".seg-mark ~ .tok.masked")
    assert masked_between and "malformed expression" in "".join(t.text for t in masked_between)
    _shot(browser, "05b-merged")

    # an adapter per agent: the adapter field keeps the calls that adapter trains on (solver's own)
    adapter = browser.find_element(By.ID, "t-adapter")
    adapter.send_keys("writer")
    browser.find_element(By.ID, "t-apply").click()
    _until(
        browser,
        lambda d: "Nothing here would be trained on." in d.find_element(By.ID, "transitions-page").text,
    )
    adapter.clear()
    adapter.send_keys("solver")
    browser.find_element(By.ID, "t-apply").click()
    _wait(browser, ".trajectory")

    # Runs: the held-out curve from the store's rollouts
    browser.get(f"{base}#/runs")
    table = _wait(browser, "#store-curve table tbody tr")[0]
    rewards = [v for v in truth["rewards"].values() if v is not None]
    assert f"{sum(rewards) / len(rewards):.3f}" in table.text
    # the version's training data through the adapter: all exact, AIR on the malformed calls only
    box = browser.find_element(By.ID, "version-metrics")
    Select(box.find_elements(By.TAG_NAME, "select")[1]).select_by_visible_text("test")
    _until(browser, lambda d: "AIR share" in d.find_element(By.ID, "version-metrics").text)
    _until(browser, lambda d: _metric(d, "transitions") == str(truth["transitions"]))
    assert _metric(browser, "exact-token ratio") == "1"
    assert _metric(browser, "AIR share (transitions with an AIR reward)") == f"{truth['air_share']:.3f}"
    _shot(browser, "06-runs-store")


def test_live_updates_and_cancel(served: Any, browser: Any) -> None:
    """A rollout enqueued while the page is open appears without a reload; the cancel button cancels."""
    from selenium.webdriver.common.by import By

    import agl.store
    from agl.types import NewRollout

    server, truth = served
    base = f"{server.url}/ui/"
    browser.get(base + "#/rollouts")
    browser.execute_script(f"localStorage.setItem('agl.dashboard.token', {json.dumps(TOKEN)})")
    browser.refresh()
    _wait(browser, "#rollouts-table tbody tr", count=len(truth["ids"]))
    _until(browser, lambda d: "live" in d.find_element(By.CSS_SELECTOR, ".live").get_attribute("class"))
    client = agl.store.open(server.url, token=TOKEN)
    try:
        (new,) = client.enqueue([NewRollout(id="ro-live-1", input={"q": "late"}, mode="val")])
        row = _wait(browser, '#rollouts-table tbody tr[data-id="ro-live-1"]', timeout=15)[0]
        assert "queued" in row.text
        row.find_element(By.TAG_NAME, "a").click()
        _wait(browser, "#cancel")[0].click()
        browser.switch_to.alert.accept()
        _until(browser, lambda d: "cancelled" in d.find_element(By.CSS_SELECTOR, "#rollout-page h2").text)
        assert client.get_rollout(new.id).status == "cancelled"
        assert not browser.find_elements(By.ID, "cancel")
        _shot(browser, "07-cancelled")
    finally:
        client.close()


def test_agl_dashboard_with_run_dir(scripted_store: str, browser: Any, tmp_path: Path) -> None:
    """``agl dashboard --store URL --run-dir DIR``: the Runs page draws metrics.jsonl's curves."""
    from selenium.webdriver.common.by import By

    run = tmp_path / "run"
    run.mkdir()
    records = [
        {
            "step": 0,
            "val_reward": 0.25,
            "train_reward": 0.2,
            "kl": 0.0,
            "exact_token_ratio": 1.0,
            "tokens_per_s": 900.0,
        },
        {
            "step": 1,
            "train_reward": 0.4,
            "kl": 0.01,
            "exact_token_ratio": 1.0,
            "zero_variance_groups": 1,
            "groups": 4,
        },
        {
            "step": 2,
            "val_reward": 0.5,
            "train_reward": 0.6,
            "kl": 0.02,
            "exact_token_ratio": 0.5,
            "tokens_per_s": 1100.0,
            "monitor_length_drift": 0.7,
            "monitor_warnings": [
                {"monitor": "length_drift", "step": 2, "message": "responses grew", "rollouts": ["ro-x"]}
            ],
        },
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3, "tra')
    dash = DashboardProcess(scripted_store, "--run-dir", str(run), log=tmp_path / "dash.log")
    try:
        browser.get(f"{dash.url}/#/runs")
        _wait(browser, ".run svg polyline", count=2)
        train = browser.find_elements(By.CSS_SELECTOR, ".run circle.train")
        val = browser.find_elements(By.CSS_SELECTOR, ".run circle.val")
        assert (len(train), len(val)) == (3, 2)
        metrics = {
            tr.get_attribute("data-key"): tr.text
            for tr in browser.find_elements(By.CSS_SELECTOR, ".run #key-metrics tbody tr")
        }
        assert metrics["exact_token_ratio"].split()[-2:] == ["0.500", "0.833"]  # last, mean
        assert metrics["kl"].split()[-2:] == ["0.020", "0.010"]
        assert "1 unreadable line(s) skipped" in browser.find_element(By.ID, "runs-page").text
        # the reward-hacking monitors: the warning names its step and links its evidence
        (li,) = browser.find_elements(By.CSS_SELECTOR, ".monitor-warnings li[data-monitor=length_drift]")
        assert "step 2 · length_drift" in li.text and "responses grew" in li.text
        assert li.find_element(By.TAG_NAME, "a").get_attribute("href").endswith("#/rollout/ro-x")
        assert metrics["monitor_length_drift"].split()[-2:] == ["0.700", "0.700"]
        _shot(browser, "08-runs-metrics")
        # the same rollouts as through the store server (no token: loopback, none configured)
        browser.get(f"{dash.url}/#/rollouts")
        n = len(_truth(scripted_store)["ids"])
        rows = _wait(browser, "#rollouts-table tbody tr", count=n)
        assert len(rows) == n
    finally:
        dash.stop()


def test_span_content_renders_as_text(browser: Any, tmp_path: Path) -> None:
    """Attributes, names, events and errors carrying markup show as text and never run."""
    from selenium.webdriver.common.by import By

    from agl.store.sqlite import SQLiteStore
    from agl.types import AttemptError, NewRollout, Span

    evil = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">'
    db = tmp_path / "xss.db"
    store = SQLiteStore(db)
    store.enqueue([NewRollout(id="ro-xss", input={"q": evil})])
    store.claim("w<b>1</b>")
    t0 = time.time_ns()
    store.add_spans(
        [
            Span(
                trace_id="ab" * 16,
                span_id="1" * 16,
                name=f"invoke_agent {evil}",
                start_ns=t0,
                end_ns=t0 + 10**6,
                rollout_id="ro-xss",
                attempt=1,
                attributes={
                    sc.GEN_AI_OPERATION_NAME: "invoke_agent",
                    sc.GEN_AI_AGENT_NAME: evil,
                    "note": evil,
                },
                events=[{"name": evil, "time_ns": t0, "attributes": {"why": evil}}],
                status={"code": "ERROR", "message": evil},
            )
        ]
    )
    store.finish_attempt("ro-xss", 1, "failed", error=AttemptError(type="X", message=evil, traceback=evil))
    store.close()
    dash = DashboardProcess(f"sqlite:///{db}", "--tokenizer", "none", log=tmp_path / "dash.log")
    try:
        browser.get(f"{dash.url}/#/rollout/ro-xss")
        row = _wait(browser, ".span-row[data-span]")[0]
        row.click()
        panel = _wait(browser, "#span-attributes")[0]
        _until(browser, lambda d: "note" in panel.text)
        page = browser.find_element(By.ID, "app").text
        assert "<script>window.__xss = 1</script>" in page
        assert browser.execute_script("return window.__xss === undefined")
        assert not browser.find_elements(By.CSS_SELECTOR, "#app script, #app img")
        _shot(browser, "09-xss-as-text")
    finally:
        dash.stop()
