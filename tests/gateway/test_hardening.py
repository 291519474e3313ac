"""Hardening of the gateway: no single request stalls it, no public bind without a key.

Real uvicorn servers on 127.0.0.1 with the scripted backend (its real SmolLM2 tokenizer and template).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx

from agl.gateway.testing import ScriptedBackend, serve_gateway

MSG = [{"role": "user", "content": "hi"}]


def _chat(url: str, content: str, **kw: Any) -> httpx.Response:
    body = {"model": "scripted", "messages": [{"role": "user", "content": content}]}
    return httpx.post(url + "/chat/completions", json=body, timeout=120, **kw)


def _timed_small_calls(url: str, until: threading.Event, out: list[float]) -> None:
    """Another client: small chat calls one after another, each one's latency recorded."""
    with httpx.Client(timeout=30) as client:
        while not until.is_set():
            t0 = time.perf_counter()
            resp = client.post(url + "/chat/completions", json={"model": "scripted", "messages": MSG})
            out.append(time.perf_counter() - t0)
            assert resp.status_code == 200, resp.text


def test_a_4_mib_prompt_is_refused_before_tokenising_and_stalls_nobody() -> None:
    seen: list[int] = []  # content sizes that reached the backend (to be rendered and tokenised)

    def script(request: Any) -> str:
        seen.append(len(request.messages[-1]["content"]))
        return "ok"

    with serve_gateway(ScriptedBackend(script)) as url:
        assert _chat(url, "warm up").status_code == 200
        done = threading.Event()
        latencies: list[float] = []
        other = threading.Thread(target=_timed_small_calls, args=(url, done, latencies))
        other.start()
        try:
            t0 = time.perf_counter()
            resp = _chat(url, "word " * (4 * 1024 * 1024 // 5))  # 4 MiB of content
            refused_after = time.perf_counter() - t0
            while len(latencies) < 3 and other.is_alive():  # the other client keeps being served
                time.sleep(0.01)
        finally:
            done.set()
            other.join(60)
        assert resp.status_code in (400, 413), resp.text
        err = resp.json()["error"]
        assert err["code"] == "context_length_exceeded"
        assert err["param"] == "messages"
        assert "characters" in err["message"]
        assert max(seen) < 100, seen  # refused before the backend rendered or tokenised it
        assert refused_after < 5.0, refused_after  # was 3.2 s of a frozen event loop, unloaded
        assert len(latencies) >= 3 and max(latencies) < 0.5, latencies


def test_a_body_too_large_for_the_context_window_is_413_before_parsing() -> None:
    backend = ScriptedBackend(["ok"], on_exhausted="repeat")
    with serve_gateway(backend) as url:
        limit = url.gateway.body_limit()
        # derived from the context window: 8192 tokens x at most 81 characters a token, JSON-escaped
        assert backend.max_prompt_chars() == 8192 * backend.tokenizer.max_token_chars
        assert limit < url.gateway.max_body_bytes
        resp = _chat(url, "x" * (limit + 1))
        assert resp.status_code == 413, resp.text
        assert resp.json()["error"]["code"] == "request_too_large"
        assert backend.calls == 0


def test_a_long_prompt_is_tokenised_off_the_event_loop() -> None:
    """A prompt under the character bound but over the token limit is tokenised (seconds of CPU) in a
    worker thread: other clients are answered meanwhile, then it gets its 400."""
    seen_big = threading.Event()

    def script(request: Any) -> str:
        if len(request.messages[-1]["content"]) > 100_000:
            seen_big.set()  # the backend starts on it: rendering and tokenising come next
        return "ok"

    backend = ScriptedBackend(script)
    limit = backend.max_prompt_chars()
    assert limit is not None
    # varied words, so it encodes to many tokens (several per word): far over 8192, under the bound
    text = " ".join(f"w{i % 9973}x{i % 7}" for i in range(limit // 12))
    assert len(text) < limit
    with serve_gateway(backend) as url:
        assert _chat(url, "warm up").status_code == 200
        result: list[httpx.Response] = []
        big = threading.Thread(target=lambda: result.append(_chat(url, text)))
        big.start()
        assert seen_big.wait(60)
        latencies: list[float] = []
        with httpx.Client(timeout=30) as client:
            while big.is_alive():
                t0 = time.perf_counter()
                resp = client.post(url + "/chat/completions", json={"model": "scripted", "messages": MSG})
                latencies.append(time.perf_counter() - t0)
                assert resp.status_code == 200
        big.join()
        (resp,) = result
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
        assert "8192" in resp.json()["error"]["message"]  # refused on its real token count
        assert len(latencies) >= 2, latencies  # tokenising took a while, and others were served
        assert max(latencies) < 0.5, latencies


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
