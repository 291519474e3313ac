"""Asynchronous training with every piece in its own process, as on separate hosts: a store server
(``agl store serve`` over SQLite, or over PostgreSQL with the trainer opening the database itself), a
gateway (``agl gateway serve``: a tiny random Llama on the transformers engine, its spans to the store
server), two ``agl runner`` processes, and the trainer (``runners=0``, ``gateway_url=``, LoRA adapters
pushed over HTTP, ``max_staleness=1``).

The trainer is SIGKILLed twice, each time after it has trained a step of its own, and resumed with
``resume=True``. Asserts: the run reaches its final step; every trained rollout id is in exactly one
step of metrics.jsonl; every pipeline group the store holds is trained or dropped (and counted), but
the ones still outstanding at the end; every group that had finished untrained at a kill is consumed
later; the same runner processes (same PIDs, still alive) ran rollouts before, between and after the
kills: the gateway and the store outlive the trainer, so the runners never notice it is gone.

Then the same with the gateway inside the trainer (``gateway_bind``), gone at each kill: the runners
stop claiming until the resumed trainer serves its port again, and no rollout fails for good.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")
httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")

import agl.store  # noqa: E402
from agl.store.server import ServerProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# 7, not 5: a resumed run enqueues a fresh group only while more than K + 1 steps remain, and the
# runners must have work after the last kill. The kills land at next_step 1 and 2 as a rule, one step
# later when the trainer races ahead of the watcher (which failed CI once at 5 steps).
STEPS = 7
TASKS_PER_STEP = 1
GROUP_SIZE = 2
K = 1

AGENT = """
import time
import openai


def agent(task, resources):
    llm = resources.llm
    client = openai.OpenAI(base_url=llm.base_url, api_key="x", max_retries=0)
    out = client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["q"]}], **llm.sampling
    )
    time.sleep(0.2)
    return float(len(out.choices[0].message.content or "") % 2)
"""

TRAINER = """
import sys
import torch
torch.set_num_threads(1)
import agl
from agl.config import RolloutSettings
from agl.trainer.trainer import Trainer, load_tokenizer
from mh_agent import agent

run_dir, store, gateway, model, resume = sys.argv[1:6]
# "bind:HOST:PORT": the gateway runs inside this trainer (and dies with it); else an external one's URL
served = {"gateway_bind": gateway[5:]} if gateway.startswith("bind:") else {"gateway_url": gateway}
trainer = Trainer(
    agl.LightningRL(group_size=GROUP_SIZE, learning_rate=1e-2, lora_r=4, lora_alpha=8),
    model=model,
    serving=agl.Serving(
        model_name="tiny", tokenizer=load_tokenizer(), store=store, **served, runners=0, run_dir=run_dir,
        progress=False,
    ),
    loop=agl.LoopConfig(
        tasks_per_step=TASKS_PER_STEP, steps=STEPS, val_every=0, checkpoint_every=1,
        max_staleness=MAX_STALENESS, resume=resume == "1",
    ),
    rollout=RolloutSettings(lease_s=5.0, max_attempts=5),
    config=agl.RunConfig(max_tokens=4),
)
trainer.fit(agent, [{"q": w} for w in ("a", "b", "c", "d", "e")])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _records(path: Path) -> list[dict[str, Any]]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _wait(cond: Callable[[], bool], what: str, proc: subprocess.Popen[Any] | None, limit_s: float) -> None:
    """Poll ``cond`` until it holds; fails if ``proc`` exits first or ``limit_s`` passes."""
    deadline = time.monotonic() + limit_s
    while not cond():
        assert proc is None or proc.poll() is None, f"exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class Cluster:
    """The processes of the run; every one started is stopped at the end, by its own handle."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[Any]] = []
        self.env = {**os.environ, "PYTHONPATH": f"{tmp}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[Any]:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT, env=self.env)
        log.close()
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _save_tiny_model(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from agl.trainer.trainer import load_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)


def _start_gateway(c: Cluster, model: Path, store_url: str) -> str:
    port = _free_port()
    cmd = [sys.executable, "-m", "agl.cli", "gateway", "serve", "--backend", "transformers"]
    cmd += ["--model", str(model), "--model-name", "tiny", "--store", store_url, "--port", str(port)]
    proc = c.spawn("gateway", [*cmd, "--threads", "1", "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/v1/models", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    _wait(up, "the gateway to serve", proc, 90)
    return url


def _start_runners(c: Cluster, store_url: str, n: int) -> list[subprocess.Popen[Any]]:
    cmd = [sys.executable, "-m", "agl.cli", "runner", "--store", store_url, "--agent", "mh_agent:agent"]
    return [c.spawn(f"runner{i}", [*cmd, "--concurrency", "2", "--idle-s", "1"]) for i in range(n)]


def _run_trainer(c: Cluster, args: list[str], run: Path, resume: bool) -> tuple[Any, int]:
    """Start the trainer; returns it and the step it starts from (metrics.jsonl keeps that many)."""
    state = run / "trainer_state.json"
    start = json.loads(state.read_text())["next_step"] if resume else 0
    proc = c.spawn("trainer", [sys.executable, str(c.tmp / "mh_trainer.py"), *args, "1" if resume else "0"])
    return proc, start


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def _store_suite() -> Any:
    """tests/store/conftest.py as a module of its own name (every conftest is named ``conftest``)."""
    import importlib.util

    name = "agl_tests_store_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "store" / "conftest.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def _sqlite_stores(tmp: Path) -> tuple[ServerProcess, str | None]:
    """A store server over SQLite; the trainer uses it over HTTP too (None: the server's URL)."""
    return ServerProcess(tmp / "store.db", log_path=tmp / "store.log"), None


def _postgres_stores(tmp: Path) -> tuple[ServerProcess, str | None]:
    """A store server over a fresh PostgreSQL schema; the trainer opens the database itself."""
    _, _, url = _store_suite().new_pg_database()  # the store suite's PostgreSQL server, or skip
    return ServerProcess(store_url=url, log_path=tmp / "store.log"), url


@pytest.mark.parametrize("db", ["sqlite", "postgres"])
def test_trainer_killed_twice_runners_on_other_hosts_keep_going(
    db: str, tmp_path: Path, cluster: Cluster
) -> None:
    server, trainer_store = (_sqlite_stores if db == "sqlite" else _postgres_stores)(tmp_path)
    store_url = server.start()
    try:
        _scenario(cluster, tmp_path, store_url, trainer_store or store_url)
    finally:
        cluster.stop()
        server.stop()


def test_runners_wait_out_a_gateway_that_restarts_inside_the_trainer(
    tmp_path: Path, cluster: Cluster
) -> None:
    """The same, with the gateway inside the trainer (``gateway_bind`` on a fixed port), so it dies at
    each kill: the runners' calls in flight fail (one attempt each), the runners stop claiming until the
    resumed trainer serves the port again (agl.runner.endpoint_gate), and no rollout fails for good."""
    server, _ = _sqlite_stores(tmp_path)
    store_url = server.start()
    try:
        _scenario(cluster, tmp_path, store_url, store_url, inside=True)
        store = agl.store.open(store_url)
        try:
            rollouts = store.query_rollouts(mode="train")
            assert not [r.id for r in rollouts if r.status == "failed"]
            # an attempt fails only while a runner has not yet seen the gateway gone: at each of the 2
            # kills, at most one attempt per runner slot (2 runners x concurrency 2). Without the gate
            # the runners claimed and failed queued rollouts for the whole restart (max_attempts=5).
            failed = [a for r in rollouts for a in r.attempts if a.status == "failed"]
            assert len(failed) <= 2 * 2 * 2, len(failed)
            assert all(a.error is not None and "Connection" in a.error.type for a in failed), failed
        finally:
            store.close()
        logs = "".join((tmp_path / f"runner{i}.log").read_text(errors="replace") for i in range(2))
        assert "claiming paused" in logs and "answers again" in logs
    finally:
        cluster.stop()
        server.stop()


def _scenario(c: Cluster, tmp: Path, store_url: str, trainer_store: str, *, inside: bool = False) -> None:
    (tmp / "mh_agent.py").write_text(AGENT)
    script = TRAINER
    for name, value in {"GROUP_SIZE": GROUP_SIZE, "TASKS_PER_STEP": TASKS_PER_STEP, "STEPS": STEPS}.items():
        script = script.replace(name, str(value))
    (tmp / "mh_trainer.py").write_text(script.replace("MAX_STALENESS", str(K)))
    model = tmp / "tiny"
    _save_tiny_model(model)
    gateway = f"bind:127.0.0.1:{_free_port()}" if inside else _start_gateway(c, model, store_url)
    runners = _start_runners(c, store_url, 2)
    run = tmp / "run"
    args = [str(run), trainer_store, gateway, str(model)]
    kills: list[tuple[float, dict[str, Any]]] = []
    watch = agl.store.open(store_url)
    try:
        _kill_twice(c, args, run, watch, kills)
    finally:
        watch.close()
    assert all(r.poll() is None for r in runners), [c.log(f"runner{i}") for i in range(2)]
    _check(run, trainer_store, kills, {r.pid for r in runners})


def _claimed_since(store: Any, t: float) -> bool:
    """Whether a training rollout enqueued after ``t`` has been claimed by a runner."""
    return any(r.created_at > t and r.status != "queued" for r in store.query_rollouts(mode="train"))


def _kill_twice(c: Cluster, args: list[str], run: Path, watch: Any, kills: list[tuple[float, Any]]) -> None:
    """Run the trainer three times: SIGKILL the first two mid-step, let the third finish."""
    for attempt in range(3):
        trainer, start = _run_trainer(c, args, run, resume=attempt > 0)
        if attempt == 2:
            assert trainer.wait(timeout=240) == 0, c.log("trainer")
            break
        # a step of its own trained, then into the next one: a group it enqueued since is running
        _wait(lambda s=start: len(_records(run / "metrics.jsonl")) > s, "a trained step", trainer, 120)
        trained_at = time.time()
        _wait(lambda t=trained_at: _claimed_since(watch, t), "a rollout claimed", trainer, 60)
        os.kill(trainer.pid, signal.SIGKILL)
        assert trainer.wait(timeout=30) == -signal.SIGKILL, c.log("trainer")
        state = json.loads((run / "trainer_state.json").read_text())
        assert state["next_step"] < STEPS
        kills.append((time.time(), state))
        time.sleep(0.5)  # the runners go on without a trainer


def _check(run: Path, store_url: str, kills: list[tuple[float, dict[str, Any]]], pids: set[int]) -> None:
    records = _records(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))  # the final step, each once
    trained = [rid for r in records for rid in r["trained_rollout_ids"]]
    dropped = [rid for r in records for rid in r["dropped_rollout_ids"]]
    assert len(trained) == len(set(trained)) == STEPS * TASKS_PER_STEP * GROUP_SIZE
    assert not set(dropped) & set(trained) and len(dropped) == len(set(dropped))
    final = json.loads((run / "trainer_state.json").read_text())
    assert final["next_step"] == STEPS
    store = agl.store.open(store_url)
    try:
        rollouts = {r.id: r for r in store.query_rollouts(mode="train")}
        groups: dict[str, list[Any]] = {}
        for r in rollouts.values():
            groups.setdefault(r.group_id, []).append(r)
        used = {rollouts[rid].group_id for rid in trained + dropped}
        assert used == set(final["consumed_groups"]) and len(final["consumed_groups"]) == len(used)
        leftover = set(groups) - used  # only the groups still outstanding when the run ended
        assert len(leftover) <= (K + 1) * TASKS_PER_STEP, leftover
        for killed_at, state in kills:  # finished untrained while no trainer ran: picked up later
            done = {
                gid
                for gid, rs in groups.items()
                if all(
                    r.ended_at is not None and r.ended_at < killed_at and r.status != "cancelled" for r in rs
                )
            }
            assert done - set(state["consumed_groups"]) <= used
        _check_runners(store, rollouts, kills, pids)
    finally:
        store.close()


def _check_runners(
    store: Any, rollouts: dict[str, Any], kills: list[tuple[float, Any]], pids: set[int]
) -> None:
    """Every attempt ran on the two runner processes, and both ran before the first kill, between the
    kills and after the last one (the same PIDs: no runner died or was replaced)."""
    host = socket.gethostname()
    workers = {f"{host}-{pid}" for pid in pids}
    bounds = [0.0, *(t for t, _ in kills), float("inf")]
    seen: list[set[str]] = [set() for _ in range(len(bounds) - 1)]
    for rid in rollouts:
        for a in store.get_attempts(rid):
            worker = (a.worker_id or "").rsplit("-", 1)[0]  # host-pid-suffix
            assert worker in workers, (a.worker_id, workers)
            for i in range(len(seen)):
                if bounds[i] <= a.started_at < bounds[i + 1]:
                    seen[i].add(worker)
    assert all(seen), (seen, [state["next_step"] for _, state in kills])


def test_versions_a_killed_run_pushed_stay_known_after_a_second_resume() -> None:
    """The scenario above, on the ledger alone: run 1 pushes v1 (update 0), checkpoints, pushes v2 (the
    checkpoint's weights) and dies; run 2 pushes v3, v4 and checkpoints; run 3 must still place v2
    (served a call run 2 had not trained for good). Before the fix, v2 was below run 2's saved versions
    and unknown: the step failed with 'did not publish'."""
    from agl.trainer.pipeline import VersionLedger

    run1 = VersionLedger()
    run1.pushed(1, 0)
    saved1 = run1.state()
    run1.pushed(2, 1)  # after the checkpoint of update 1 ... and killed
    run2 = VersionLedger()
    run2.restore({**saved1, "version_updates": {"1": 0}}, resumed_update=1)
    run2.pushed(3, 1)
    assert run2.lag(2, 3) == 0  # the killed run's v2 held the checkpoint's weights
    run2.pushed(4, 2)
    saved2 = run2.state()
    run3 = VersionLedger()
    run3.restore(saved2, resumed_update=2)
    run3.pushed(6, 2)
    assert run3.lag(2, 6) == 1 and run3.lag(5, 6) == 0 and run3.lag(1, 6) == 2
    with pytest.raises(RuntimeError, match="newer"):
        run3.lag(7, 6)
