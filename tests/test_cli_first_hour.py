"""A new user's first hour: CLI errors are one line with a non-zero exit, never a traceback; the demo's
store can be looked at afterwards; failed attempts keep their error; untraced runners say so."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import agl
from agl.cli import main
from agl.store.sqlite import SQLiteStore
from agl.types import AttemptError, NewRollout

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, block: tuple[str, ...] = (), env: dict[str, str] | None = None) -> tuple[int, str]:
    """``agl ARGS`` in a fresh interpreter (with the ``block`` modules made unimportable)."""
    code = (
        "import sys\n"
        f"for m in {block!r}: sys.modules[m] = None\n"
        "from agl.cli import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )
    return proc.returncode, proc.stdout + proc.stderr


def assert_one_line_error(rc: int, out: str, *needles: str) -> None:
    assert rc != 0, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, out
    for needle in needles:
        assert needle in errors[0], out


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/reward": 0.5}) + "\n")
    rc, out = run_cli("plot", str(tmp_path), block=("matplotlib",))
    assert_one_line_error(rc, out, "pip install 'agl[train]'")


def test_gateway_without_torch_says_so_before_announcing() -> None:
    rc, out = run_cli("gateway", "serve", "--port", "0", block=("torch",))
    assert_one_line_error(rc, out, "agl[train]", "--backend scripted")
    assert "backend on http" not in out


@pytest.mark.parametrize(
    "command",
    [("store", "serve", "--store", "memory://"), ("gateway", "serve", "--backend", "scripted")],
)
def test_busy_port_is_one_line(busy_port: int, command: tuple[str, ...]) -> None:
    rc, out = run_cli(*command, "--port", str(busy_port))
    assert_one_line_error(rc, out, f"port {busy_port}", "already in use")


def test_bare_gateway_prints_its_own_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gateway"]) == 2
    out = capsys.readouterr().out
    assert "serve" in out and "agl gateway" in out


def test_gateway_serve_help_describes_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["gateway", "serve", "--help"])
    out = capsys.readouterr().out
    assert "OpenAI-compatible" in out
    assert "default: 127.0.0.1" in out and "default: 8765" in out and "default: info" in out


def _failed_with_exception_span(path: Path) -> str:
    """The README's store API: the agent's exception is recorded with emit_exception, then the attempt
    is finished as failed without error= (what a user following the tracing section does)."""
    store = SQLiteStore(path)
    try:
        (r,) = store.enqueue([NewRollout(input={"q": 1})])
        store.claim("w")
        agl.setup_tracing(store)
        with agl.rollout_context(r.id, 1):
            try:
                raise ZeroDivisionError("division by zero in the agent")
            except ZeroDivisionError as exc:
                agl.emit_exception(exc)
        agl.tracing.provider.flush()
        store.finish_attempt(r.id, 1, "failed")
        return r.id
    finally:
        store.close()


def test_emit_exception_error_shows_in_list_and_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "agl.db"
    rid = _failed_with_exception_span(path)
    assert main(["rollouts", "list", "--store", f"sqlite:///{path}"]) == 0
    out = capsys.readouterr().out
    assert "ZeroDivisionError: division by zero in the agent" in out
    assert main(["rollouts", "show", rid, "--traceback", "--store", f"sqlite:///{path}"]) == 0
    out = capsys.readouterr().out
    assert "Traceback (most recent call last)" in out and "raise ZeroDivisionError" in out


def test_attempt_error_from_exception_keeps_the_traceback() -> None:
    try:
        {}["missing"]
    except KeyError as exc:
        err = AttemptError.from_exception(exc)
    assert err.type == "KeyError" and "missing" in err.message
    assert err.traceback is not None and "KeyError" in err.traceback


def test_transitions_and_export_honour_agl_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "agl.db"
    rid = _failed_with_exception_span(path)
    monkeypatch.setenv("AGL_STORE", f"sqlite:///{path}")
    assert main(["transitions", rid]) == 0
    out_file = tmp_path / "out.jsonl"
    assert main(["export", "--format", "transitions", "--out", str(out_file)]) == 0
    assert out_file.exists()
    monkeypatch.setenv("AGL_STORE", f"sqlite:///{tmp_path / 'nope.db'}")
    assert main(["transitions", rid]) == 2  # names the missing store instead of creating an empty one


def test_demo_store_is_inspectable_after_dev(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main job's `dev` path keeps its rollouts in a SQLite store in its run dir, prints how to
    look at it once (a relative --run-dir used to print every command twice, with the store's absolute
    and relative paths), and `agl rollouts list` on that store lists them; rerunning into it needs
    --overwrite."""
    pytest.importorskip("openai")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # `examples` from the checkout
    from agl.gateway.testing import ScriptedBackend, serve_gateway
    from examples.learn_on_cpu.__main__ import main as demo

    monkeypatch.chdir(tmp_path)
    run_dir = Path("demo")  # relative, as a user types it
    backend = ScriptedBackend(["Answer: 8"], models=["scripted"], on_exhausted="cycle")
    try:
        with serve_gateway(backend) as url:
            args = ["dev", "-n", "2", "--runners", "1", "--run-dir", str(run_dir)]
            assert demo([*args, "--base-url", str(url), "--model-name", "scripted"]) == 0
            out = capsys.readouterr().out
            store_url = f"sqlite:///{(run_dir / 'store.db').resolve()}"
            for command in (
                "rollouts list",
                "rollouts show ROLLOUT_ID",
                "spans ROLLOUT_ID",
                "transitions ROLLOUT_ID",
            ):
                assert out.count(f"agl {command} --store") == 1, out
            assert f"agl rollouts list --store {store_url}\n" in out
            with pytest.raises(SystemExit, match="--overwrite"):
                demo([*args, "--base-url", str(url), "--model-name", "scripted"])
    finally:
        agl.uninstrument()
    assert main(["rollouts", "list", "--store", store_url]) == 0
    listed = capsys.readouterr().out
    assert "2 rollout(s): 2 succeeded" in listed


def test_plot_draws_a_baseline_and_refuses_a_malformed_one(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    records = [{"step": 0, "train_reward": 0.1}, {"step": 1, "train_reward": 0.2, "val_reward": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "curve.png"
    rc, text = run_cli("plot", str(tmp_path), "--out", str(out), "--baseline", "warm start=0.25")
    assert rc == 0, text
    assert out.read_bytes()[:4] == b"\x89PNG"
    rc, text = run_cli("plot", str(tmp_path), "--out", str(out), "--baseline", "warm start")
    assert_one_line_error(rc, text, "LABEL=VALUE")


# ------------------------------------------------------------------- errors: the user's vs agl's own


def test_a_users_mistake_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad flag value reaches the CLI as agl.errors.UsageError: one line, exit status 2."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "train_reward": 0.5}\n')
    rc = main(["plot", str(tmp_path), "--baseline", "no-number-here"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().splitlines() == [
        "agl plot: error: --baseline takes LABEL=VALUE with a number, got 'no-number-here'"
    ]
    assert "Traceback" not in err


def test_a_malformed_file_the_user_named_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A metrics file that is not JSON is the user's file, not agl's bug: one line naming file and line."""
    (tmp_path / "metrics.jsonl").write_text("{not json\n")
    rc = main(["plot", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{tmp_path / 'metrics.jsonl'}:1 is not JSON" in err


def test_an_internal_bug_keeps_its_traceback(tmp_path: Path) -> None:
    """A bare KeyError/ValueError from agl's own code is a bug: the CLI no longer hides it as a one-line
    user error (it used to print ``agl plot: error: 'step'``)."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "train_reward": 0.5}\n')
    code = (
        "import sys\n"
        "import agl.run.plot\n"
        "def broken(*a, **k):\n"
        "    return {}['step']  # an internal KeyError, as a bug in agl would raise\n"
        "agl.run.plot.plot_runs = broken\n"
        "import agl.cli.plot\n"
        "agl.cli.plot.plot_runs = broken\n"
        "from agl.cli import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "plot", str(tmp_path), "--out", str(tmp_path / "c.png")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr
    assert "KeyError: 'step'" in proc.stderr
    assert "agl plot: error" not in proc.stderr


def test_every_agl_error_is_an_agl_error_and_keeps_its_old_base() -> None:
    """One root for what agl raises on purpose; ``except ValueError`` callers keep working."""
    import agl.errors as errors

    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.AglError), name
    assert issubclass(errors.UsageError, ValueError)
    assert issubclass(errors.NotFoundError, KeyError) and issubclass(errors.InvalidInputError, ValueError)
    assert issubclass(errors.MissingFrameworkError, ImportError)
    assert issubclass(errors.PatchTargetError, AttributeError)
    assert issubclass(errors.StoreAuthError, PermissionError)


def test_library_code_never_imports_argparse() -> None:
    """The CLI floor: argparse lives in agl.cli only (REDESIGN §5.1)."""
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "core").rglob("*.py")
        if "cli" not in p.relative_to(ROOT / "core").parts[:1] and "argparse" in p.read_text()
    ]
    assert offenders == []
