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
        (["gateway", "serve", "--backend", "scripted", "--serve", "gpt-4o"], "takes NAME=TARGET"),
        (["gateway", "serve", "--backend", "scripted", "--serve", "a=/nowhere.json"], "is none of"),
        (["gateway", "serve", "--backend", "scripted", "--serve", "a=policy", "--serve", "A=base"], "twice"),
        (["gateway", "serve", "--backend", "scripted", "--max-tokens", "0"], "max_tokens must be"),
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


def _wait_up(proc: subprocess.Popen[str], port: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
            return
        except httpx.HTTPError:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.1)


def test_gateway_serve_model_names_and_sampling_process(tmp_path: Path) -> None:
    """``--model-name`` twice, ``--only-model-names``, ``--serve NAME=SCRIPT`` (a second model) and
    ``--max-tokens``: the SelectorGroupChat shape, from the command line."""
    (tmp_path / "agents.json").write_text(json.dumps(["one two three four five six seven"]))
    (tmp_path / "selector.json").write_text(json.dumps(["writer"]))
    port = _free_port()
    argv = ["gateway", "serve", "--backend", "scripted", "--script", str(tmp_path / "agents.json")]
    argv += ["--model-name", "gpt-4o", "--model-name", "gpt-4.1", "--only-model-names"]
    argv += ["--serve", f"gpt-4o-mini={tmp_path / 'selector.json'}", "--max-tokens", "3", "--port", str(port)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "agl.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_up(proc, port)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"

        def ask(model: str) -> httpx.Response:
            return httpx.post(url, json={"model": model, "messages": [{"role": "user", "content": "x"}]})

        agents, selector, unknown = ask("GPT-4o").json(), ask("gpt-4o-mini").json(), ask("gpt-3.5-turbo")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
    finally:
        proc.terminate()
        out = proc.communicate(timeout=20)[0]
    assert agents["choices"][0]["finish_reason"] == "length" and agents["usage"]["completion_tokens"] == 3
    assert selector["choices"][0]["message"]["content"] == "writer"
    assert unknown.status_code == 404 and "gpt-3.5-turbo" in unknown.json()["error"]["message"]
    assert [m["id"] for m in models] == ["scripted", "gpt-4o-mini", "gpt-4o", "gpt-4.1"]
    assert "model names: only the names given; gpt-4o-mini -> scripted backend" in out
