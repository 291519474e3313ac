"""The wheel ships the dashboard's page, script, styles and the vendored libraries with their licences."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_the_dashboard_assets(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (whl,) = tmp_path.glob("agl-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    static = "agl/dashboard/static/"
    for name in (
        "index.html",
        "app.js",
        "app.css",
        "favicon.ico",
        "vendor/preact.mjs",
        "vendor/preact-hooks.mjs",
        "vendor/htm.mjs",
    ):
        assert static + name in names, name
    assert {static + "vendor/LICENSE-preact", static + "vendor/LICENSE-htm"} <= names
    assert "agl/cli/dashboard.py" in names and "agl/dashboard/mount.py" in names
