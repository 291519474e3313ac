"""Fixtures for the dashboard tests: a store filled by a real scripted run, servers, a real browser.

The browser is Debian's headless Chromium driven by Selenium through the system ``chromedriver``
(``apt-get install chromium chromium-driver``; ``.ci/run`` installs them). Without them the browser
tests skip and say why. Screenshots go to ``$AGL_TEST_ARTIFACTS`` (else ``tests/.artifacts``).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from dash_helpers import ROOT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver") or (
    "/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None
)


@pytest.fixture(scope="session")
def scripted_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite store filled by a real run: examples/calc_agent (AutoGen AgentChat, instrumented)
    against agl's gateway with the scripted model, through the Runner. Each group of four problems has
    a right answer, a wrong one, a tool-free one and a malformed calculator call (an ERROR tool span)."""
    pytest.importorskip("autogen_agentchat")
    pytest.importorskip("autogen_ext.models.openai")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import agl.store
    from examples.calc_agent import cli

    path = tmp_path_factory.mktemp("dashboard") / "scripted.db"
    store = agl.store.open(f"sqlite:///{path}")
    try:
        args = cli.parser().parse_args(["dev", "--backend", "scripted", "-n", "8"])
        cli.dev(args, store=store)
    finally:
        store.close()
    return f"sqlite:///{path}"


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Headless Chromium (Debian's), fresh profile, no network side traffic."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install 'agl[dev]')")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="agl-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1400,1000",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
