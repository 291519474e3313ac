"""The managed vLLM server (start, check, log, restart after a crash, stop, die with agl) and the probe,
against the fake vLLM run as a program with vLLM's command line (``fake_vllm_server.py``). The same
against the real vLLM: tests/gateway/test_vllm_real.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest
from gw_helpers import server_spans

from agl import semconv as sc
from agl.engine.vllm_probe import VLLMSupport, probe
from agl.engine.vllm_server import VLLMServer, VLLMServerError, server_environment
from agl.errors import UsageError
from agl.gateway.backends.vllm import VLLMBackend
from agl.gateway.testing import serve_gateway

openai = pytest.importorskip("openai")

FAKE = [sys.executable, str(Path(__file__).with_name("fake_vllm_server.py"))]
ASSETS = str(resources.files("agl.chat").joinpath("assets"))  # a folder agl can render with


def fake_server(tmp_path: Path, *extra: str) -> VLLMServer:
    return VLLMServer(
        ASSETS,
        command=FAKE,
        served_name="smol",
        extra_args=list(extra),
        log_path=tmp_path / "vllm.log",
        startup_timeout_s=60,
    )


def test_command_and_environment_carry_what_agl_needs() -> None:
    server = VLLMServer("/models/m", python=sys.executable, lora_rank=32, adapters=3, tool_parser="hermes")
    argv = server.command()
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(argv)
    for part in (
        "--model /models/m",
        "--served-model-name m",
        "--enable-lora",
        "--max-lora-rank 32",
        "--max-loras 6",
        "--logprobs-mode processed_logprobs",
        "--enable-auto-tool-choice --tool-call-parser hermes",
    ):
        assert part in flags
    env = server_environment({"VLLM_CPU_KVCACHE_SPACE": "8"})
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "8"  # the user's value is kept
    with pytest.raises(UsageError, match="interpreter"):
        VLLMServer("/m", python="/no/such/python")


def test_start_probe_log_and_stop(tmp_path: Path) -> None:
    with fake_server(tmp_path) as server:
        assert server.alive() and server.port > 0
        support = probe(server.url, generate=True)
        assert support.token_ids is True and support.runtime_lora is True and support.pause_keep is True
        assert support.base_model()["id"] == "smol" and support.missing() == []
        assert "agl can train through it: yes" in support.report()
        pid = server.proc.pid if server.proc else 0
    assert not server.alive()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the whole process group is gone
    assert "fake vLLM on" in (tmp_path / "vllm.log").read_text()


def test_a_server_without_runtime_lora_is_refused_naming_the_flag(tmp_path: Path) -> None:
    server = fake_server(tmp_path, "--fake-no-lora")
    with pytest.raises(VLLMServerError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
        server.start()
    assert not server.alive()


def test_a_server_that_exits_at_start_fails_with_its_log(tmp_path: Path) -> None:
    server = fake_server(tmp_path, "--fake-exit", "3")
    t0 = time.monotonic()
    with pytest.raises(VLLMServerError, match="told to fail at start"):
        server.start()
    assert time.monotonic() - t0 < 30  # at once, not after the startup timeout


def test_the_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from agl.engine.vllm_server import VLLMServer
        s = VLLMServer({ASSETS!r}, command={FAKE!r}, log_path={str(tmp_path / "v.log")!r}).start()
        print(s.proc.pid, s.port, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline() if parent.stdout else ""
        group, port = map(int, line.split())
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        parent.send_signal(signal.SIGKILL)  # no atexit, no finally: only the launcher notices
        parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the vLLM server outlived the process that started it")


def test_a_killed_server_is_restarted_with_its_adapters_and_the_calls_go_on(
    tmp_path: Path, store: Any, rollout: tuple[str, int]
) -> None:
    server = fake_server(tmp_path, "--fake-token-delay", "0.5").start()
    backend = VLLMBackend(server.url, server=server)
    try:
        with serve_gateway(backend, store) as url:
            client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
            chat = [{"role": "user", "content": "hi"}]
            r = httpx.post(url.root + "/agl/v1/adapters", json={"path": "/ckpt/v1", "version": 1}, timeout=30)
            assert r.status_code == 200
            client.chat.completions.create(model="smol", messages=chat)
            stream = iter(client.chat.completions.create(model="smol", messages=chat, stream=True))
            next(stream)  # the call is in flight (the fake streams a token every 0.5 s)
            server.kill()  # SIGKILL, the whole process group
            with pytest.raises(openai.APIError):  # the call fails; its caller retries
                list(stream)
            reply = client.chat.completions.create(model="smol", messages=chat)  # waits for the restart
            assert reply.choices[0].message.content == "Hello from the managed fake."
            models = httpx.get(server.url + "/models").json()["data"]
            assert "smol-agl-v1" in [m["id"] for m in models]  # the pushed adapter, loaded again
            assert httpx.get(url.root + "/agl/v1/status").json()["weight_version"] == 1
        assert backend.restarts == 1 and server.starts == 2
        first, failed, last = server_spans(store, rollout[0])
        assert first.attributes[sc.AGL_LLM_WEIGHT_VERSION] == last.attributes[sc.AGL_LLM_WEIGHT_VERSION] == 1
        assert failed.status.code == "ERROR" and "being restarted" in (failed.status.message or "")
    finally:
        server.stop()
    assert "=== agl:" in (tmp_path / "vllm.log").read_text()


def test_missing_names_each_flag() -> None:
    support = VLLMSupport(url="http://h/v1", reachable=True, schema=True, token_ids=False, pause_keep=False)
    text = "; ".join(support.missing(pause=True))
    assert "vLLM >= 0.10.2" in text and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in text
    assert "VLLM_SERVER_DEV_MODE=1" in text
    assert "unreachable" in probe("http://127.0.0.1:9/v1").report()


def test_agl_vllm_serve_starts_reports_and_stops_on_sigterm(tmp_path: Path) -> None:
    cmd = " ".join(FAKE)
    proc = subprocess.Popen(
        [sys.executable, "-m", "agl.cli", "vllm", "serve", "--command", cmd, "--model", ASSETS, "--port", "0"]
        + ["--log", str(tmp_path / "v.log"), "--", "--max-model-len", "1024"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("agl vllm: serving on"):
                break
        url = lines[-1].split()[-1]
        assert httpx.get(url + "/models").json()["data"][0]["max_model_len"] == 1024  # the flag after --
        assert any("agl can train through it: yes" in x for x in lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/models")


def test_agl_doctor_upstream_reports_what_the_server_lacks() -> None:
    from fake_vllm import FakeVLLM

    from agl.gateway.testing import serve_asgi

    fake = FakeVLLM(["x"], lora_api=False, pause_api="none")
    with serve_asgi(fake.app) as root:
        out = subprocess.run(
            [sys.executable, "-m", "agl.cli", "doctor", "--upstream", root, "--generate"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 1
    assert "runtime LoRA loading: NO — VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in out.stdout
    assert "pause/resume around a push (mode=keep): NO" in out.stdout
    assert "token ids (exact prompt/response ids): yes" in out.stdout
