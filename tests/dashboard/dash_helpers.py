"""Helpers of the dashboard tests (imported by name: pytest puts this directory on sys.path)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def artifacts_dir() -> Path:
    d = Path(os.environ.get("AGL_TEST_ARTIFACTS") or ROOT / "tests" / ".artifacts") / "dashboard"
    d.mkdir(parents=True, exist_ok=True)
    return d


class DashboardProcess:
    """``agl dashboard`` in a child process (the real CLI), on a free port."""

    def __init__(self, store_url: str, *args: str, token: str | None = None, log: Path | None = None) -> None:
        import subprocess

        env = {**os.environ}
        env.pop("AGL_STORE_TOKEN", None)
        if token is not None:
            env["AGL_STORE_TOKEN"] = token
        self._log = open(log or os.devnull, "ab")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "agl.cli", "dashboard", "--store", store_url, "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if "serving" not in line:
            self.stop()
            raise RuntimeError(f"agl dashboard did not start: {line!r} (log: {log})")
        self.url = line.split()[-1].rstrip("/")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
