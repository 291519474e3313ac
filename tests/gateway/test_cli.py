"""``agl gateway serve`` as a real process, and its argument errors."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agl.cli import main as agl_main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gateway_serve_scripted_process(tmp_path: Path) -> None:
    script = tmp_path / "replies.json"
    script.write_text(
        json.dumps(["first", {"content": None, "tool_calls": [{"name": "add", "arguments": {"a": 1}}]}])
    )
    port = _free_port()
    db = tmp_path / "agl.db"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agl.cli",
            "gateway",
            "serve",
            "--backend",
            "scripted",
            "--script",
            str(script),
            "--port",
            str(port),
            "--store",
            f"sqlite:///{db}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {"model": "scripted", "messages": [{"role": "user", "content": "x"}]}
        assert httpx.post(url, json=body).json()["choices"][0]["message"]["content"] == "first"
        call = httpx.post(url, json=body).json()["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == "add" and json.loads(call["arguments"]) == {"a": 1}
    finally:
        proc.terminate()
        out = proc.communicate(timeout=20)[0]
    assert f"http://127.0.0.1:{port}/v1" in out
    assert "/rollouts/{rollout_id}/attempts/{n}/v1" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["gateway", "serve", "--backend", "vllm"], "needs --upstream"),
        (["gateway", "serve", "--backend", "scripted", "--script", "/nonexistent.json"], "not found"),
    ],
)
def test_gateway_serve_argument_errors(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert agl_main(argv) == 2
    assert needle in capsys.readouterr().err


def test_bad_script_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "s.json"
    bad.write_text("{}")
    assert agl_main(["gateway", "serve", "--backend", "scripted", "--script", str(bad)]) == 2
    assert "non-empty JSON list" in capsys.readouterr().err
