"""Training on several processes, for real: ``python -m torch.distributed.run`` (torchrun) or
``accelerate launch`` starts 2 ranks of an ordinary script (tests/fixtures/distributed_worker.py) on the gloo backend, on CPU,
data-parallel (DDP) or sharded (FSDP2, asked for as accelerate asks: ``ACCELERATE_USE_FSDP``/``FSDP_VERSION``).

Asserts: two ranks' update equals one process's on the same transitions and seed (LoRA, or all, weights within
1e-5, the logged loss and gradient norm, the step's counts); a rank with no micro-batch does not hang
the step; a whole ``Trainer.fit`` on two ranks has one store, one metrics file and one set of
checkpoints on rank 0 while rank 1 only updates; a rank killed mid-run fails the run within a bounded
time and ``resume=True`` continues from the last checkpoint, no step trained twice.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agl.algorithms.distributed import shard, timeout_s
from agl.errors import UsageError

WORKER = Path(__file__).parent / "fixtures" / "distributed_worker.py"
#: far above a step's minute on a busy 2-core box; a hang is what these tests exist to catch
LIMIT_S = 240


def test_shards_are_disjoint_cover_the_step_and_balance_tokens() -> None:
    tokens = [50, 7, 30, 30, 8, 90, 1, 12]
    keep = [0, 1, 2, 3, 5, 6, 7]
    shares = [shard(keep, tokens, r, 3) for r in range(3)]
    assert sorted(i for s in shares for i in s) == keep
    assert all(s == sorted(s) for s in shares)
    loads = [sum(tokens[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(tokens[i] for i in keep)
    assert shard(keep, tokens, 0, 1) == keep
    assert shard([0], tokens, 1, 2) == []  # a rank may get nothing: the update still runs its passes
    prompts = ["a", "a", "b", "b", "c", "c", "d", "d"]  # a group's sequences share a prompt
    shares = [shard(range(8), tokens, r, 2, together=prompts) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(8))
    assert {prompts[i] for i in shares[0]}.isdisjoint(prompts[i] for i in shares[1])
    one_prompt = shard(range(8), tokens, 1, 2, together=["p"] * 8)  # fewer prompts than ranks: split
    assert one_prompt and len(one_prompt) < 8


def test_collective_timeout_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGL_DIST_TIMEOUT_S", "42")
    assert timeout_s() == 42.0
    for bad in ("0", "-3", "soon"):
        monkeypatch.setenv("AGL_DIST_TIMEOUT_S", bad)
        with pytest.raises(UsageError, match="AGL_DIST_TIMEOUT_S"):
            timeout_s()


def test_fsdp_is_asked_for_as_accelerate_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from agl.algorithms.fsdp import accelerate_without_fsdp, requested

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert not requested()  # DDP unless FSDP is asked for
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert requested()
    with accelerate_without_fsdp():  # hidden from accelerate while TRL builds its Accelerator
        assert "ACCELERATE_USE_FSDP" not in os.environ
    assert os.environ["ACCELERATE_USE_FSDP"] == "true"
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(UsageError, match="FSDP2"):
        requested()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not requested()  # one process: nothing to shard across


# ------------------------------------------------------------------------------ real launches
def _need_training() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.update(extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None) if k not in extra else None
    return env


def _start(
    args: list[str], nproc: int, *, accelerate: bool = False, fsdp: bool = False, **env: str
) -> subprocess.Popen:
    """The worker on ``nproc`` ranks (torchrun, or ``accelerate launch``, on a free port, with
    ``fsdp`` its FSDP2 flags), or alone for ``nproc=1``."""
    launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    launch += [f"--master-port={_free_port()}", "--monitor-interval=0.5"]
    if accelerate:  # on a machine without GPUs, --multi_gpu is what starts several gloo processes
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines=1"]
        launch += [f"--num_processes={nproc}", f"--main_process_port={_free_port()}", "--mixed_precision=no"]
        launch += ["--dynamo_backend=no"]
        if fsdp:  # accelerate takes one of --multi_gpu/--use_fsdp; the latter starts the processes too
            launch = [a for a in launch if a != "--multi_gpu"] + ["--use_fsdp", "--fsdp_version=2"]
    cmd = [*(launch if nproc > 1 else [sys.executable]), str(WORKER), *args]
    return subprocess.Popen(cmd, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, expect_ok: bool = True) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the launch hung for {LIMIT_S}s:\n{out[-4000:]}")
    if expect_ok and proc.returncode != 0:
        pytest.fail(f"the launch failed ({proc.returncode}):\n{out[-6000:]}")
    return proc.returncode, out


def _compare(one: Path, two: Path, tol: float, *, lora: bool = True) -> None:
    import torch

    a, b = torch.load(one / "weights.pt"), torch.load(two / "weights.pt")
    assert a.keys() == b.keys() and any("lora_" in k for k in a) == lora
    moved = max((a[k] - torch.load(one / "start.pt")[k]).abs().max().item() for k in a)
    assert moved > 20 * tol  # the update changed the weights by far more than the tolerance
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff <= tol, f"LoRA weights differ by {diff:.3g}"
    m1, m2 = (json.loads((d / "metrics.json").read_text()) for d in (one, two))
    for key in ("loss", "grad_norm", "entropy"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    for key in ("sequences", "response_tokens", "tokens_flat", "update_tokens", "trained_transitions"):
        assert m2[key] == m1[key], key


@pytest.mark.parametrize(
    ("one_sequence", "full"),
    [(False, False), (True, False), (False, True)],
    ids=["shared-step", "rank-without-micro-batch", "full-parameter"],
)
def test_two_ranks_update_equals_one_process(tmp_path: Path, one_sequence: bool, full: bool) -> None:
    """DDP on LoRA (and on every weight): the same weights, loss and gradient norm as one process;
    with a single trained sequence, rank 1 has no micro-batch and still joins the step's collectives
    (no hang)."""
    _need_training()
    extra = (["--one"] if one_sequence else []) + (["--full"] if full else [])
    two = _start(["update", str(tmp_path / "two"), *extra], 2)
    one = _start(["update", str(tmp_path / "one"), *extra], 1)
    _finish(one)
    _finish(two)
    _compare(tmp_path / "one", tmp_path / "two", 1e-5, lora=not full)
    if not (one_sequence or full):  # the same script under accelerate launch
        _finish(_start(["update", str(tmp_path / "acc")], 2, accelerate=True))
        _compare(tmp_path / "one", tmp_path / "acc", 1e-5)
    metrics = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert metrics["sequences"] == (1 if one_sequence else 7)
    if not (one_sequence or full):  # the groups' shared prompts ran once per rank's tree, not once per call
        assert metrics["tokens_packed"] < metrics["tokens_flat"]


FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}  # what `accelerate launch --use_fsdp
# --fsdp_version 2` puts in each process's environment; under torchrun the user sets them


@pytest.mark.parametrize(
    ("one_sequence", "full"),
    [(False, False), (True, False), (False, True)],
    ids=["lora", "rank-without-micro-batch", "full-parameter"],
)
def test_fsdp2_update_equals_one_process(tmp_path: Path, one_sequence: bool, full: bool) -> None:
    """FSDP2 on two ranks (sharded parameters, gradients, optimizer state; agl applies fully_shard on
    CPU where accelerate would fall back to DDP): the same whole weights, gathered on rank 0, the same
    loss and gradient norm as one process, within 1e-4."""
    _need_training()
    extra = (["--one"] if one_sequence else []) + (["--full"] if full else [])
    two = _start(["update", str(tmp_path / "two"), *extra], 2, **FSDP2)
    one = _start(["update", str(tmp_path / "one"), *extra], 1)
    _finish(one)
    _, log = _finish(two)
    assert "agl applies fully_shard itself" in log  # the fallback to DDP is not silent
    _compare(tmp_path / "one", tmp_path / "two", 1e-4, lora=not full)


def test_fsdp2_fit_pushes_gathered_weights_to_the_embedded_engine(tmp_path: Path) -> None:
    """Trainer.fit under FSDP2 on 2 ranks, launched as accelerate launches it (``--use_fsdp
    --fsdp_version 2``), with the embedded transformers engine on rank 0: every push serves exactly
    the whole LoRA tensors gathered from the shards, and they were trained (LoRA B grew from 0)."""
    _need_training()
    out, run = tmp_path / "out", tmp_path / "run"
    _, log = _finish(_start(["fit", str(out), str(run), "2", "--engine"], 2, accelerate=True, fsdp=True))
    assert "agl applies fully_shard itself" in log  # accelerate's DDP fallback on CPU was overridden
    pushes = [json.loads(line) for line in (out / "pushes.jsonl").read_text().splitlines()]
    assert len(pushes) >= 2 and all(p["n"] > 0 for p in pushes)
    assert all(p["diff"] == 0.0 for p in pushes), pushes  # the engine serves the gathered tensors
    assert pushes[-1]["lora_b"] > 0.0, pushes  # the update trained them: the push is no initial copy
    seen = json.loads((out / "rank-1.json").read_text())
    assert seen["global_step"] == 2 and not seen["env"]


def test_fsdp2_checkpoint_resumes_at_another_process_count(tmp_path: Path) -> None:
    """A checkpoint saved under FSDP2 on 2 ranks resumes on 1 process, and one saved by 1 process
    resumes under FSDP2 on 2 ranks: the step after the resume gives the weights of the run that went
    on without stopping (Adam's moments included), within 1e-4."""
    _need_training()
    saves = [_start(["update", str(tmp_path / "two"), "--save"], 2, **FSDP2)]
    saves.append(_start(["update", str(tmp_path / "one"), "--save"], 1))
    for proc in saves:
        _finish(proc)
    ckpt = "ckpt/checkpoint-1"
    loads = [_start(["update", str(tmp_path / "1of2"), "--load", str(tmp_path / "two" / ckpt)], 1)]
    loads.append(
        _start(["update", str(tmp_path / "2of1"), "--load", str(tmp_path / "one" / ckpt)], 2, **FSDP2)
    )
    for proc in loads:
        _finish(proc)
    _compare(tmp_path / "two", tmp_path / "1of2", 1e-4)
    _compare(tmp_path / "one", tmp_path / "2of1", 1e-4)
    assert (tmp_path / "two" / ckpt / "adapter_model.safetensors").is_file()  # the one-process files


def test_fsdp2_fit_killed_rank_resumes_on_one_process_with_sqlite_store(tmp_path: Path) -> None:
    """Trainer.fit under FSDP2 on 2 ranks with a SQLite store: rank 1 SIGKILLed at its third update
    fails the run within a bounded time after two steps; resume=True on one process finishes it from
    checkpoint-2, and no rollout is trained twice across the two runs."""
    _need_training()
    out, run = tmp_path / "out", tmp_path / "run"
    t0 = time.monotonic()
    args = ["fit", str(out), str(run), "3", "--sqlite"]
    rc, log = _finish(_start(args, 2, AGL_TEST_KILL_AT="3", **FSDP2), expect_ok=False)
    assert rc != 0 and "SIGKILL" in log, log[-3000:]
    assert time.monotonic() - t0 < LIMIT_S
    assert sorted(p.name for p in (run / "checkpoints").glob("checkpoint-*")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    _finish(_start([*args, "--resume"], 1))
    seen = json.loads((out / "rank-0.json").read_text())
    assert seen["global_step"] == seen["summary_steps"] == 3
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    trained = [json.loads(line) for line in (out / "trained.jsonl").read_text().splitlines()]
    assert len(trained) == 3  # two updates before the kill, one after the resume
    ids = [rid for batch in trained for rid in batch]
    assert ids and len(ids) == len(set(ids))  # no rollout trained twice


def test_fit_on_two_ranks_then_a_killed_rank_and_resume(tmp_path: Path) -> None:
    """An unchanged Trainer.fit script on 2 ranks; rank 1 SIGKILLed at its second update fails the run
    within a bounded time; resume=True on 2 ranks finishes it from the checkpoint, no step twice."""
    _need_training()
    out, run = tmp_path / "out", tmp_path / "run"
    t0 = time.monotonic()
    rc, log = _finish(_start(["fit", str(out), str(run), "2"], 2, AGL_TEST_KILL_AT="2"), expect_ok=False)
    assert rc != 0 and "SIGKILL" in log, log[-3000:]
    assert time.monotonic() - t0 < LIMIT_S
    assert sorted(p.name for p in (run / "checkpoints").glob("checkpoint-*")) == ["checkpoint-1"]
    assert not list(out.glob("rank-*.json"))  # neither rank finished
    _finish(_start(["fit", str(out), str(run), "2", "--resume"], 2))
    seen = {r: json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)}
    assert seen[0]["store"] and seen[0]["env"]  # rank 0 owns the store, gateway and runners
    assert not seen[1]["store"] and not seen[1]["env"]  # rank 1 only updates
    assert seen[0]["global_step"] == seen[1]["global_step"] == 2
    assert seen[1]["summary_steps"] == seen[0]["summary_steps"] == 2  # fit returns rank 0's summary
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]  # one metrics file, each step once: step 1 trained after the resume only
    assert sorted(p.name for p in (run / "checkpoints").glob("checkpoint-*")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
