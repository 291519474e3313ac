"""Shutdown drill: `agl store serve` and `agl runner` processes after a real run, stopped as a shutdown
script stops them (SIGTERM to the server and a runner together), while a trainer holds a long-poll
and writes spans.

What must hold: the server exits 0 within its grace period with nothing but its own lines in its log
(no "Exception in ASGI application", no "Cancel N running task(s)": the held claims and waits end at
once, the writes in flight finish); the runner told to stop exits 0 without a failed claim; the runner
left running says in one line that its store is gone, waits, and claims again once the store is back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agl.errors import StoreUnavailableError
from agl.store.http import HttpStore
from agl.store.server import GRACEFUL_SHUTDOWN_S, ServerProcess
from agl.types import NewRollout, RolloutConfig, Span

AGENT = "import time\n\ndef agent(task, resources):\n    time.sleep(0.05)\n    return 1.0\n"
UNREACHABLE = "the store is unreachable"


def _runner(url: str, tmp_path: Path, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "agl.cli", "runner", "--store", url, "--agent", "drill_agent:agent"]
    cmd += ["--mode", "train", "--no-instrument", "--worker-id", name]
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    return proc, log


def _wait_for(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.05)


def _span(rid: str, name: str) -> Span:
    return Span(
        trace_id=os.urandom(16).hex(),
        span_id=os.urandom(8).hex(),
        name=name,
        start_ns=1,
        end_ns=2,
        rollout_id=rid,
        attempt=1,
    )


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:  # whatever a failed assertion left running
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_to_server_and_runner_after_a_run_is_clean_and_the_other_runner_waits(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    (tmp_path / "drill_agent.py").write_text(AGENT)
    server_log = tmp_path / "server.log"
    server = ServerProcess(tmp_path / "drill.db", log_path=server_log)
    url = server.start()
    assert server.proc is not None
    procs.append(server.proc)
    (stopped, stopped_log), (left, left_log) = (_runner(url, tmp_path, n) for n in ("r-stopped", "r-left"))
    procs += [stopped, left]

    trainer = HttpStore(url, retry_timeout_s=3.0)
    ids = [r.id for r in trainer.enqueue([NewRollout(input={"i": i}) for i in range(24)])]
    finished = trainer.wait_for_rollouts(ids, timeout_s=90)
    assert len(finished) == 24 and {r.status for r in finished} == {"succeeded"}
    # the trainer's own connections: a long wait on a rollout no runner takes, and a stream of writes
    (target,) = trainer.enqueue([NewRollout(id="ro-val", mode="val", config=RolloutConfig(lease_s=3600))])
    assert trainer.claim("trainer", modes=["val"]) is not None
    acked: list[str] = []
    outcome: dict[str, BaseException] = {}
    stop_writing = threading.Event()

    def hold_a_wait() -> None:
        try:
            HttpStore(url, retry_timeout_s=3.0).wait_for_rollouts([target.id], timeout_s=60)
        except StoreUnavailableError as exc:
            outcome["wait"] = exc

    def write() -> None:
        client = HttpStore(url, retry_timeout_s=3.0)
        i = 0
        try:
            while not stop_writing.is_set():
                i += 1
                acked.extend(
                    s.span_id for s in client.add_spans([_span(target.id, f"w{i}-{k}") for k in range(50)])
                )
        except StoreUnavailableError as exc:
            outcome["write"] = exc

    threads = [threading.Thread(target=hold_a_wait), threading.Thread(target=write)]
    for t in threads:
        t.start()
    time.sleep(1.5)  # both runners are in a claim long-poll, longer than the server's grace period

    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    stopped.send_signal(signal.SIGTERM)
    assert server.proc.wait(GRACEFUL_SHUTDOWN_S + 3) == 0
    server_took = time.monotonic() - t0
    assert stopped.wait(10) == 0
    stop_writing.set()
    for t in threads:
        t.join(15)
    text = server_log.read_text()
    for bad in ("Traceback", "Exception in ASGI application", "running task(s)", "CancelledError"):
        assert bad not in text, text
    assert server_took < GRACEFUL_SHUTDOWN_S + 2, server_took
    stopped_text = stopped_log.read_text()
    assert "claim failed" not in stopped_text and "500" not in stopped_text, stopped_text
    assert isinstance(outcome.get("wait"), StoreUnavailableError)  # the trainer's wait: gone, not a 500

    _wait_for(lambda: UNREACHABLE in left_log.read_text(), 20, "the runner left running notices")
    time.sleep(2.0)  # a few more of its probes
    lines = left_log.read_text().splitlines()
    assert len([line for line in lines if UNREACHABLE in line]) == 1, lines
    assert not [line for line in lines if "claim failed" in line or "answered 500" in line], lines

    server.start()  # the store returns on the same address: the runner claims again
    procs.append(server.proc)
    _wait_for(lambda: "answers again" in left_log.read_text(), 20, "the runner sees the store back")
    again = HttpStore(url)
    (late,) = again.enqueue([NewRollout(input={"late": True})])
    (done,) = again.wait_for_rollouts([late.id], timeout_s=30)
    assert done.status == "succeeded" and done.attempts[-1].worker_id == "r-left"
    stored = {s.span_id for s in again.query_spans(rollout_id=target.id)}
    assert acked and set(acked) <= stored  # every write the server acknowledged was kept
    again.close()

    left.send_signal(signal.SIGTERM)
    assert left.wait(10) == 0
    server.stop()
    assert server.proc.returncode == 0
