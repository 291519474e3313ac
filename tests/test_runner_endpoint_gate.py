"""Runners pause claiming while the agents' LLM endpoint is down (a gateway inside a restarting
trainer), and go on when it is back: the queue is not burnt through its attempts in the meantime.

A real openai client in the agent, agl's real gateway (scripted backend) on a fixed 127.0.0.1 port
that is closed at first and served later, a memory store with ``max_attempts=2``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from agl.runner.endpoint_gate import connection_failure
from agl.runner.runner import Runner
from agl.store.memory import MemoryStore
from agl.tracing import provider as tracing
from agl.types import LLM, NewRollout, RolloutConfig

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


@pytest.fixture()
def store() -> Iterator[MemoryStore]:
    s = MemoryStore()
    yield s
    tracing.reset_tracing()
    s.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def agent(task: dict, resources) -> float:
    client = openai.OpenAI(base_url=resources.llm.base_url, api_key="x", max_retries=0)
    out = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": task["q"]}], max_tokens=8
    )
    return 1.0 if out.choices[0].message.content == "ok" else 0.0


def _wait(cond, what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_claims_pause_while_the_gateway_is_down_and_resume_when_it_is_back(store: MemoryStore) -> None:
    from agl.gateway.testing import ScriptedBackend, serve_gateway

    port = _free_port()
    store.add_resources({"main": LLM(base_url=f"http://127.0.0.1:{port}/v1", model="scripted")})
    cfg = RolloutConfig(max_attempts=2)
    ids = [r.id for r in store.enqueue([NewRollout(input={"q": f"q{i}"}, config=cfg) for i in range(8)])]
    runner = Runner(agent, store, concurrency=2, claim_timeout_s=0.05)
    done = threading.Event()

    def run() -> None:
        runner.run(max_rollouts=None)
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        _wait(lambda: runner.stats.failed >= 1, "the first attempt to fail on the closed port")
        time.sleep(1.5)  # long enough to burn the whole queue twice over without the gate
        # only the attempts in flight when the endpoint went away failed; nothing else was claimed
        assert runner.stats.claimed <= 2 and runner.stats.failed <= 2
        assert runner.stats.endpoint_pauses == 1
        assert all(store.get_rollout(rid).status == "queued" for rid in ids[2:])
        with serve_gateway(ScriptedBackend(["ok"], on_exhausted="cycle"), store, port=port):
            _wait(lambda: all(store.get_rollout(r).status == "succeeded" for r in ids), "all rollouts")
    finally:
        runner.stop(now=True)
        done.wait(10)
    # every rollout succeeded; the ones that failed at the outage did so once, and were retried
    attempts = {rid: len(store.get_attempts(rid)) for rid in ids}
    assert sum(n - 1 for n in attempts.values()) == runner.stats.failed
    assert max(attempts.values()) <= 2
    assert runner.stats.succeeded == len(ids)


def test_connection_failure_looks_through_the_wrapping_chain() -> None:
    """A framework's own error raised from the client's connection error counts; other errors do not."""
    request = httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions")
    try:
        try:
            raise openai.APIConnectionError(request=request)
        except Exception as inner:
            raise RuntimeError("the framework's wrapper") from inner
    except RuntimeError as exc:
        assert connection_failure(exc)
    assert connection_failure(ConnectionRefusedError())
    assert not connection_failure(ValueError("the agent's own bug"))
    assert not connection_failure(
        openai.BadRequestError("400", response=httpx.Response(400, request=request), body=None)
    )


def test_a_runner_draining_the_queue_is_not_held_by_a_down_endpoint(store: MemoryStore) -> None:
    """``until_idle`` (drain, then exit): a wrong endpoint fails every rollout and the run ends."""
    store.add_resources({"main": LLM(base_url=f"http://127.0.0.1:{_free_port()}/v1", model="scripted")})
    ids = [r.id for r in store.enqueue([NewRollout(input={"q": f"q{i}"}) for i in range(3)])]
    stats = Runner(agent, store, concurrency=2, claim_timeout_s=0.05).run(until_idle=True)
    assert stats.failed == 3 and stats.endpoint_pauses == 1
    assert all(store.get_rollout(rid).status == "failed" for rid in ids)


def test_a_gateway_that_comes_back_elsewhere_releases_the_runners(store: MemoryStore) -> None:
    """A restarted trainer may serve on a new port and publish it: waiting for the old address would be
    forever, so the runners go on as soon as the store's latest resources name another endpoint."""
    from agl.gateway.testing import ScriptedBackend, serve_gateway

    store.add_resources({"main": LLM(base_url=f"http://127.0.0.1:{_free_port()}/v1", model="scripted")})
    cfg = RolloutConfig(max_attempts=2)
    ids = [r.id for r in store.enqueue([NewRollout(input={"q": f"q{i}"}, config=cfg) for i in range(4)])]
    runner = Runner(agent, store, concurrency=1, claim_timeout_s=0.05)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        _wait(lambda: runner.stats.endpoint_pauses == 1, "the runner to pause on the closed port")
        with serve_gateway(ScriptedBackend(["ok"], on_exhausted="cycle"), store) as url:
            store.add_resources({"main": LLM(base_url=str(url), model="scripted")})  # published elsewhere
            _wait(lambda: all(store.get_rollout(r).status == "succeeded" for r in ids), "all rollouts")
    finally:
        runner.stop(now=True)
        thread.join(10)
    assert runner.stats.failed == 1 and runner.stats.succeeded == len(ids)
