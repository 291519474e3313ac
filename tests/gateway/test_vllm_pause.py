"""The vllm backend pauses generation around a weight push through vLLM's own API (fake vLLM, real HTTP).

vLLM's routes (``POST /pause?mode=...``, ``POST /resume``, ``GET /is_paused``, with
``VLLM_SERVER_DEV_MODE=1``) are described in :mod:`agl.gateway.backends.vllm`; ``fake_vllm`` speaks
them, freezing the streams in flight under ``mode=keep``, ending them under ``mode=abort`` (vLLM's
default) and queueing new requests until the resume.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fake_vllm import FakeVLLM

from agl.errors import UsageError
from agl.gateway.backends.base import BackendError, GenerationRequest, GenerationResult
from agl.gateway.backends.vllm import VLLMBackend
from agl.gateway.testing import serve_asgi

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
LONG = " ".join(f"word{i}" for i in range(30)) + "."
PUSH_EVENTS = ("pause", "resume", "load_lora_adapter", "unload_lora_adapter")


@contextmanager
def _serve(**kwargs: Any) -> Iterator[tuple[FakeVLLM, str]]:
    fake = FakeVLLM([LONG, "Short reply."], **kwargs)
    with serve_asgi(fake.app) as root:
        yield fake, root


@pytest.fixture
def upstream() -> Iterator[tuple[FakeVLLM, str]]:
    with _serve(token_delay_s=0.01) as served:
        yield served


def _push_log(fake: FakeVLLM) -> list[tuple[str, Any]]:
    """The pause, resume, load and unload calls in server order (a load says whether vLLM was paused)."""
    out: list[tuple[str, Any]] = []
    for what, info in fake.control:
        if what == "pause":
            out.append(("pause", info["mode"]))
        elif what == "resume":
            out.append(("resume", None))
        elif what in PUSH_EVENTS:
            out.append((what, (info["lora_name"], info["paused"])))
    return out


def _chat(text: str = "hi") -> GenerationRequest:
    messages = [{"role": "user", "content": text}]
    raw = {"model": MODEL, "messages": messages, "max_tokens": 200}
    return GenerationRequest(model=MODEL, messages=messages, max_tokens=200, raw=raw)


async def _streamed(backend: VLLMBackend, request: GenerationRequest) -> GenerationResult:
    result = None
    async for event in backend.stream(request):
        if event["type"] == "end":
            result = event["result"]
    assert result is not None
    return result


async def _until(check: Any, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out waiting")


def test_a_push_pauses_with_keep_loads_then_resumes_and_unloads_after(
    upstream: tuple[FakeVLLM, str], caplog: pytest.LogCaptureFixture
) -> None:
    fake, root = upstream
    backend = VLLMBackend(root, keep_adapters=1)

    async def run() -> None:
        await backend.start()
        assert await backend.load_adapter("/ckpt/1") == 1
        assert await backend.load_adapter("/ckpt/2") == 2
        await backend.close()

    with caplog.at_level(logging.INFO, logger="agl.gateway"):
        asyncio.run(run())
    v1, v2 = f"{MODEL}-agl-v1", f"{MODEL}-agl-v2"
    assert _push_log(fake) == [
        ("pause", "keep"),
        ("load_lora_adapter", (v1, True)),
        ("resume", None),
        ("pause", "keep"),
        ("load_lora_adapter", (v2, True)),
        ("resume", None),
        ("unload_lora_adapter", (v1, False)),  # after the resume: the pause covers only the swap
    ]
    pause = next(info for what, info in fake.control if what == "pause")
    assert pause["clear_cache"] == "false"
    assert not fake.paused and list(fake.loras) == [v2]
    said = [r.getMessage() for r in caplog.records if "pause" in r.getMessage()]
    assert len(said) == 1 and "POST /pause?mode=keep" in said[0], said  # asked once, one line


def test_per_agent_push_pauses_once_for_all_its_adapters(
    upstream: tuple[FakeVLLM, str], tmp_path: Any
) -> None:
    fake, root = upstream
    backend = VLLMBackend(root, adapters=["writer", "rewriter"])

    async def run() -> None:
        await backend.start()
        await backend.load_agent_loras({"writer": str(tmp_path / "w"), "rewriter": str(tmp_path / "r")})
        await backend.close()

    asyncio.run(run())
    assert _push_log(fake) == [
        ("pause", "keep"),
        ("load_lora_adapter", (f"{MODEL}-writer-v1", True)),
        ("load_lora_adapter", (f"{MODEL}-rewriter-v1", True)),
        ("resume", None),
    ]


def test_a_call_in_flight_during_a_push_finishes_and_a_new_one_waits_for_the_resume(
    upstream: tuple[FakeVLLM, str],
) -> None:
    fake, root = upstream
    fake.load_delay_s = 0.3
    backend = VLLMBackend(root)

    async def run() -> tuple[GenerationResult, GenerationResult, GenerationResult, int, bool]:
        await backend.start()
        in_flight = asyncio.create_task(_streamed(backend, _chat()))
        await _until(lambda: fake.streamed_tokens >= 3)
        push = asyncio.create_task(backend.load_adapter("/ckpt/1"))
        await _until(lambda: fake.paused)
        frozen_at = fake.streamed_tokens
        arrived = asyncio.create_task(backend.generate(_chat("new")))
        await asyncio.sleep(0.1)
        waited = not arrived.done() and not in_flight.done()
        await push
        result, late = await in_flight, await arrived
        after = await backend.generate(_chat("after"))
        await backend.close()
        return result, late, after, frozen_at, waited

    result, late, after, frozen_at, waited = asyncio.run(run())
    assert waited  # paused: the stream is frozen and the new call queued, neither lost nor answered
    assert frozen_at < len(result.choices[0].response_ids or [])  # the stream was mid-way at the pause
    assert result.choices[0].text.startswith(LONG) and result.choices[0].finish_reason == "stop"
    assert result.weight_version == 0  # admitted before the push: the old weights, as its span says
    assert fake.tokens_while_paused == 0 and fake.aborted_streams == 0
    # the call that arrived mid-push was routed before the switch: queued, then run on the old weights
    assert late.choices[0].text == "Short reply." and late.weight_version == 0
    whats = [what for what, _ in fake.control if what in ("pause", "resume", "generate")]
    assert whats == ["generate", "pause", "resume", "generate", "generate"]  # it ran after the resume
    assert [b["model"] for k, b in fake.requests if k == "chat"] == [MODEL, MODEL, f"{MODEL}-agl-v1"]
    assert after.weight_version == 1  # the next call gets the new adapter


def test_a_failed_load_still_resumes_and_its_error_surfaces(upstream: tuple[FakeVLLM, str]) -> None:
    fake, root = upstream
    fake.fail_loads = 1
    backend = VLLMBackend(root)

    async def run() -> GenerationResult:
        await backend.start()
        with pytest.raises(BackendError, match="No adapter found for /missing"):
            await backend.load_adapter("/missing")
        result = await asyncio.wait_for(backend.generate(_chat()), 10)  # vLLM is not left paused
        await backend.close()
        return result

    result = asyncio.run(run())
    assert _push_log(fake) == [
        ("pause", "keep"),
        ("load_lora_adapter", (f"{MODEL}-agl-v1", True)),
        ("resume", None),
    ]
    assert not fake.paused and backend.weight_version == 0 and result.weight_version == 0
    assert fake.requests[-1][1]["model"] == MODEL  # routing unchanged


def test_a_failed_per_agent_load_unloads_this_pushs_copies_and_resumes(
    upstream: tuple[FakeVLLM, str], tmp_path: Any
) -> None:
    fake, root = upstream
    fake.refuse_loras = {f"{MODEL}-rewriter-v1"}
    backend = VLLMBackend(root, adapters=["writer", "rewriter"])

    async def run() -> None:
        await backend.start()
        with pytest.raises(BackendError, match="rewriter-v1"):
            await backend.load_agent_loras({"writer": str(tmp_path / "w"), "rewriter": str(tmp_path / "r")})
        await backend.close()

    asyncio.run(run())
    assert _push_log(fake) == [
        ("pause", "keep"),
        ("load_lora_adapter", (f"{MODEL}-writer-v1", True)),
        ("load_lora_adapter", (f"{MODEL}-rewriter-v1", True)),
        ("unload_lora_adapter", (f"{MODEL}-writer-v1", True)),
        ("resume", None),
    ]
    assert not fake.paused and not fake.loras
    assert backend.lora_served == {"writer": None, "rewriter": None} and backend.weight_version == 0


def test_a_failed_resume_is_an_error(upstream: tuple[FakeVLLM, str]) -> None:
    fake, root = upstream
    fake.fail_resumes = 1
    backend = VLLMBackend(root)

    async def run() -> None:
        await backend.start()
        with pytest.raises(BackendError, match="did not resume generation"):
            await backend.load_adapter("/ckpt/1")
        await backend.close()

    asyncio.run(run())
    assert fake.paused  # the fake refused: the error says so instead of calls hanging silently


def test_an_old_vllm_without_the_endpoints_still_gets_the_adapter(caplog: pytest.LogCaptureFixture) -> None:
    with _serve(pause_api="none") as (fake, root):
        backend = VLLMBackend(root)

        async def run() -> None:
            await backend.start()
            await backend.load_adapter("/ckpt/1")
            await backend.load_adapter("/ckpt/2")
            await backend.close()

        with caplog.at_level(logging.INFO, logger="agl.gateway"):
            asyncio.run(run())
        assert [what for what, _ in _push_log(fake)] == ["load_lora_adapter", "load_lora_adapter"]
        assert list(fake.loras) == [f"{MODEL}-agl-v1", f"{MODEL}-agl-v2"] and backend.weight_version == 2
        said = [r.getMessage() for r in caplog.records if "pause" in r.getMessage().lower()]
        assert len(said) == 1 and "offers no POST /pause" in said[0], said


def test_a_pause_without_keep_mode_is_not_used(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's first /pause ignores ``mode`` and aborts by default: the stream in flight must survive."""
    with _serve(pause_api="legacy", token_delay_s=0.01) as (fake, root):
        backend = VLLMBackend(root)

        async def run() -> GenerationResult:
            await backend.start()
            in_flight = asyncio.create_task(_streamed(backend, _chat()))
            await _until(lambda: fake.streamed_tokens >= 3)
            await backend.load_adapter("/ckpt/1")
            result = await in_flight
            await backend.close()
            return result

        with caplog.at_level(logging.INFO, logger="agl.gateway"):
            result = asyncio.run(run())
        assert not [w for w, _ in fake.control if w == "pause"] and fake.aborted_streams == 0
        assert result.choices[0].finish_reason == "stop"
        said = [r.getMessage() for r in caplog.records if "pause" in r.getMessage().lower()]
        assert len(said) == 1 and "without mode=keep" in said[0], said


def test_the_legacy_fake_aborts_like_vllm_when_mode_is_ignored() -> None:
    """The fake's legacy /pause is what makes the test above meaningful: mode=keep there aborts."""
    with _serve(pause_api="legacy", token_delay_s=0.01) as (fake, root):
        backend = VLLMBackend(root)

        async def run() -> GenerationResult:
            await backend.start()
            in_flight = asyncio.create_task(_streamed(backend, _chat()))
            await _until(lambda: fake.streamed_tokens >= 3)
            status, _ = await backend.request("POST", root + "/pause?mode=keep")
            assert status == 200
            result = await in_flight
            await backend.request("POST", root + "/resume")
            await backend.close()
            return result

        result = asyncio.run(run())
        assert fake.aborted_streams == 1 and result.choices[0].finish_reason == "abort"


def test_without_a_schema_auto_does_not_pause_and_true_does(caplog: pytest.LogCaptureFixture) -> None:
    with _serve(docs=False) as (fake, root):

        async def push(backend: VLLMBackend) -> None:
            await backend.start()
            await backend.load_adapter("/ckpt/1", version=len(fake.loras) + 1)
            await backend.close()

        with caplog.at_level(logging.INFO, logger="agl.gateway"):
            asyncio.run(push(VLLMBackend(root)))
        assert not [w for w, _ in fake.control if w == "pause"]
        assert any("serves no /openapi.json" in r.getMessage() for r in caplog.records)
        fake.control.clear()
        asyncio.run(push(VLLMBackend(root, pause_on_push=True)))
        assert [w for w, _ in _push_log(fake)] == ["pause", "load_lora_adapter", "resume"]


def test_pause_on_push_false_never_pauses_and_true_requires_it(upstream: tuple[FakeVLLM, str]) -> None:
    fake, root = upstream

    async def push(backend: VLLMBackend) -> None:
        await backend.start()
        try:
            await backend.load_adapter("/ckpt/1")
        finally:
            await backend.close()

    asyncio.run(push(VLLMBackend(root, pause_on_push=False)))
    assert [w for w, _ in _push_log(fake)] == ["load_lora_adapter"]
    with _serve(pause_api="none") as (old, root_old):
        with pytest.raises(BackendError, match="pause_on_push=True"):
            asyncio.run(push(VLLMBackend(root_old, pause_on_push=True)))
        assert not old.loras  # nothing loaded unpaused when the pause was required
    with pytest.raises(UsageError, match="pause_on_push"):
        VLLMBackend(root, pause_on_push="yes")  # type: ignore[arg-type]
