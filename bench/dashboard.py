"""The dashboard at scale: a store with many rollouts and a 5k-span attempt, opened in headless Chromium.

    python bench/dashboard.py [--rollouts 100000] [--tree-spans 5000] [--repeat 3]

Served the way users open it (``agl store serve`` over a SQLite file, the UI under ``/ui``). Measured:

- index build: the first ``/ui/api/rollouts`` answer (the dashboard reads every rollout once), and an
  incremental refresh round (``refresh_cost_s``: new rollouts plus the ``--active`` ones still queued;
  it sets how often the index follows the store);
- a rollouts page (50 rows, newest first) with and without a status filter, over HTTP, p50;
- in Chromium: the rollouts page from navigation to the table drawn, the rollout page of the 5k-span
  attempt from navigation to the tree drawn (page load, fetches, JSON, render), and the tree's render
  alone (from the tree component's render to its DOM committed), best of ``--repeat``.

Needs ``chromium``, ``chromium-driver`` and ``selenium`` (see tests/dashboard).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "dashboard"))

from agl import semconv as sc  # noqa: E402
from agl.store.server import ServerProcess  # noqa: E402
from agl.store.sqlite import SQLiteStore  # noqa: E402
from agl.types import NewRollout, Span  # noqa: E402

TOKEN = "bench"


def fill(db: Path, n: int, finished: int, tree_spans: int) -> str:
    """``n`` rollouts (the oldest ``finished`` of them claimed, rewarded and finished) and one rollout
    whose attempt has ``tree_spans`` spans: an agent with LLM calls and tools, some failing."""
    store = SQLiteStore(db)
    store.enqueue([NewRollout(id="ro-tree")])
    c = store.claim("bench")
    assert c is not None and c.rollout.id == "ro-tree"
    spans = []
    t0 = time.time_ns()
    root = "f" * 16
    spans.append(Span(trace_id="e" * 32, span_id=root, name=sc.SPAN_INVOKE_AGENT, start_ns=t0, end_ns=t0 + tree_spans * 10**6,
                      rollout_id="ro-tree", attempt=1, attributes={sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT, sc.GEN_AI_AGENT_NAME: "bench"}))  # fmt: skip
    for i in range(1, tree_spans):
        kind = i % 3
        parent = f"{i - 2:016x}" if kind == 2 and i > 2 else root  # steps nest under a chat span
        attrs: dict[str, object] = {}
        status: dict[str, object] = {}
        name = sc.SPAN_CHAT
        if kind == 0:
            attrs = {sc.GEN_AI_OPERATION_NAME: sc.OP_CHAT, sc.AGL_SIDE: sc.SIDE_SERVER,
                     sc.AGL_LLM_PROMPT_TOKEN_IDS: list(range(200)), sc.AGL_LLM_RESPONSE_TOKEN_IDS: list(range(40))}  # fmt: skip
        elif kind == 1:
            name = sc.SPAN_EXECUTE_TOOL
            attrs = {sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL, sc.GEN_AI_TOOL_NAME: f"tool{i % 7}"}
            if i % 50 == 1:
                status = {"code": "ERROR", "message": "boom"}
        else:
            name = "step"
        spans.append(Span(trace_id="e" * 32, span_id=f"{i:016x}", parent_id=parent, name=name, start_ns=t0 + i * 10**6,
                          end_ns=t0 + i * 10**6 + 900_000, rollout_id="ro-tree", attempt=1, attributes=attrs,
                          status=status or {"code": "UNSET"}))  # fmt: skip
    for k in range(0, len(spans), 500):
        store.add_spans(spans[k : k + 500])
    store.finish_attempt("ro-tree", 1, "succeeded")
    bar = tqdm(total=n, desc="enqueue", unit="rollout")
    for start in range(0, n, 2000):
        k = min(2000, n - start)
        store.enqueue(
            [
                NewRollout(id=f"ro-{start + i:06d}", mode="train" if i % 5 else "val", resources_version=None)
                for i in range(k)
            ]
        )
        bar.update(k)
    bar.close()
    # the oldest rollouts are claimed first: finish the first `finished` ones with a reward span
    for i in tqdm(range(finished), desc="finish", unit="rollout"):
        c = store.claim("bench")
        assert c is not None
        rid = c.rollout.id
        store.add_spans(
            [
                Span(
                    trace_id=f"{i + 1:032x}",
                    span_id=f"{i + 1:016x}",
                    name=sc.SPAN_REWARD,
                    start_ns=1,
                    end_ns=2,
                    rollout_id=rid,
                    attempt=1,
                    attributes={sc.AGL_REWARD_VALUE: (i % 10) / 10},
                )
            ]
        )
        store.finish_attempt(rid, 1, "succeeded")
    store.close()
    return "ro-tree"


def p50(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=100_000)
    ap.add_argument(
        "--active", type=int, default=1_000, help="rollouts left queued (the rest finish with a reward)"
    )
    ap.add_argument("--tree-spans", type=int, default=5_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--db", type=Path, default=None, help="reuse a database filled by an earlier run")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="agl-bench-dash-"))
    db = args.db or tmp / "store.db"
    rid = "ro-tree"
    if args.db is None or not args.db.exists():
        t = time.perf_counter()
        fill(db, args.rollouts, max(0, args.rollouts - args.active), args.tree_spans)
        took = time.perf_counter() - t
        print(f"filled {args.rollouts} rollouts + a {args.tree_spans}-span attempt in {took:.0f}s")
    print(f"database: {db}")
    server = ServerProcess(
        db, token=TOKEN, env={"AGL_DASHBOARD_TOKENIZER": "none"}, log_path=tmp / "server.log"
    )
    url = server.start()
    h = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=f"{url}/ui/api", headers=h, timeout=120) as c:
        t = time.perf_counter()
        first = c.get("/rollouts?limit=50").json()
        print(f"first page: {time.perf_counter() - t:.2f}s (indexing: {first['indexing']})")
        while c.get("/rollouts?limit=1").json()["indexing"] is not None:
            time.sleep(0.2)
        print(f"all {first['indexing']['total'] if first['indexing'] else first['total']} rollouts indexed "
              f"{time.perf_counter() - t:.1f}s after the first request")  # fmt: skip
        lat: dict[str, list[float]] = {"page": [], "page, status=succeeded": [], "page, reward 0.5-1": []}
        for _ in range(10):
            for key, q in (
                ("page", ""),
                ("page, status=succeeded", "&status=succeeded"),
                ("page, reward 0.5-1", "&reward_min=0.5&reward_max=1"),
            ):
                t = time.perf_counter()
                data = c.get(f"/rollouts?limit=50&offset=100{q}").json()
                lat[key].append(time.perf_counter() - t)
        print(
            f"incremental refresh round: {data['refresh_cost_s']:.2f}s; rewards pending {data['rewards_pending']}"
        )
        for key, xs in lat.items():
            print(f"{key}: p50 {p50(xs) * 1000:.0f} ms")
        t = time.perf_counter()
        tree = c.get(f"/rollouts/{rid}/attempts/1/spans").json()
        print(f"span tree API ({tree['count']} spans): {(time.perf_counter() - t) * 1000:.0f} ms")

    from dash_helpers import ROOT  # noqa: F401 - makes sure the tests' helpers are importable
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000",
                 f"--user-data-dir={tmp / 'profile'}"):  # fmt: skip
        opts.add_argument(flag)
    d = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        d.get(f"{url}/ui/")
        d.execute_script(f"localStorage.setItem('agl.dashboard.token', '{TOKEN}')")
        table: list[float] = []
        trees: list[float] = []
        renders: list[float] = []
        for _ in range(args.repeat):
            d.get(f"{url}/ui/#/rollouts")
            d.refresh()
            WebDriverWait(d, 120).until(
                lambda d: (
                    d.execute_script("return document.querySelectorAll('#rollouts-table tbody tr').length")
                    == 50
                )
            )
            table.append(d.execute_script("return performance.now()") / 1000)
            d.get(f"{url}/ui/#/rollout/{rid}")
            d.execute_script("window.__aglTree = null")
            d.refresh()
            WebDriverWait(d, 120).until(
                lambda d: (
                    d.execute_script("return window.__aglTree && window.__aglTree.rows") == args.tree_spans
                )
            )
            trees.append(d.execute_script("return performance.now()") / 1000)
            renders.append(d.execute_script("return window.__aglTree.render_ms") / 1000)
        n, k = args.tree_spans, args.repeat
        print(f"browser: rollouts page drawn {min(table):.2f}s after navigation (best of {k})")
        print(f"browser: {n}-span rollout page drawn {min(trees):.2f}s after navigation (best of {k})")
        print(f"browser: {n}-span tree render (data to DOM) {min(renders) * 1000:.0f} ms (best of {k})")
    finally:
        d.quit()
        server.stop()
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
