"""A server process that agl starts, waits for, restarts and stops: :class:`ManagedProcess`.

The managed vLLM server (:class:`agl.engine.vllm_server.VLLMServer`) and SkyRL's Tinker server
(:class:`agl.tinker.server.SkyRLServer`) differ in their command, environment and readiness probe;
what they share lives here once:

- **the launcher**: the server runs under a small launcher (standard library only, run by the
  server's own interpreter) that forks it, forwards a SIGTERM, and ends the server's process group
  when agl's process is gone, even by SIGKILL (no ``atexit`` runs then). The server and its engine
  processes form one process group (``start_new_session``), killed together and not by the
  terminal's ^C;
- **start**: a free port when ``port=0`` (kept across restarts), the command's line and the server's
  output appended to ``log_path``, then :meth:`ManagedProcess.wait_ready` polls the subclass's
  :meth:`~ManagedProcess.is_ready` until it holds, failing at once with the end of the log when the
  server exits first, or after ``startup_timeout_s``; :meth:`~ManagedProcess.check_running` then
  checks the running server (a failed start is stopped, never left running);
- **stop**: SIGTERM the launcher (it stops the server), wait up to ``stop_timeout_s``, then SIGKILL
  the whole group, also when the launcher is gone; at interpreter exit every live server is stopped.
"""

from __future__ import annotations

import atexit
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, ClassVar

from agl.errors import InfraError, UsageError

__all__ = ["ManagedProcess", "free_port", "kill_group", "stop_process"]

_LOG_TAIL = 3000

#: The launcher (see the module docstring): argv[1] is agl's pid, the rest the server's argv.
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
        print(f"agl launcher: the server exited (wait status {status})", file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
        time.sleep(1)
        os.killpg(0, signal.SIGKILL)
    if os.getppid() != parent:
        stop()
    time.sleep(0.5)
"""


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the OS's pick)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def kill_group(pgid: int) -> None:
    """SIGKILL a process group; one already gone (or not ours) is not an error."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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
        kill_group(proc.pid)
        proc.wait(timeout=10)


class ManagedProcess:
    """One server process under the launcher (see the module docstring). A subclass gives
    :meth:`command`, :meth:`environment` and :meth:`is_ready`, and may give :meth:`prepare` (before
    each start) and :meth:`check_running` (after it); ``what`` names it in errors, which are ``error``.
    """

    #: the server's name in messages ("the vLLM server exited ...")
    what: ClassVar[str] = "server"
    #: the exception a failed start raises
    error: ClassVar[type[Exception]] = InfraError
    #: seconds between readiness probes, and a stop's SIGTERM grace
    poll_s: ClassVar[float] = 1.0
    stop_timeout_s: ClassVar[float] = 40.0

    def __init__(
        self,
        *,
        host: str,
        port: int,
        log_path: str | os.PathLike[str] | None,
        startup_timeout_s: float,
        python: str | None = None,
    ) -> None:
        #: the interpreter that runs the launcher: the server's own when it has one, else this one
        self.python = python
        self.host, self.port = host, int(port)
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0  # how many times it was started (restarts after a crash included)
        self._lock = threading.Lock()
        self._log_file: Any = None

    # ------------------------------------------------------------------------------ the subclass's
    def command(self) -> list[str]:
        """The argv that starts the server."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """The server's environment."""
        return dict(os.environ)

    def is_ready(self) -> bool:
        """One readiness probe (may raise httpx.HTTPError or ValueError: not ready yet)."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Before each start: folders the server writes to, and the like."""

    def check_running(self) -> None:
        """After the server is ready: checks on the running server (raise to fail the start)."""

    # ------------------------------------------------------------------------------ lifecycle
    @property
    def hostport(self) -> str:
        """``host:port``, an IPv6 host in brackets."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def start(self) -> Any:
        """Start the server and wait until it serves (:meth:`is_ready`, then :meth:`check_running`);
        raises ``error`` with the end of its log when it exits first or does not come up in time.
        A server already running is left as it is."""
        with self._lock:
            if self.alive():
                return self
            if self.port == 0:
                self.port = free_port(self.host)
            self._spawn()
        try:
            self.wait_ready()
            self.check_running()
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
                raise UsageError(f"cannot start the {self.what}: {argv[0]!r} is not on PATH")
            argv[0] = found
        self.prepare()
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - kept open while the server runs
            self._log_file.write(f"\n=== agl: {shlex.join(argv)}\n".encode())
            self._log_file.flush()
        out = self._log_file if self._log_file is not None else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                [str(self.python or sys.executable), "-c", _LAUNCHER, str(os.getpid()), *argv],
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped together, not by the terminal's ^C
            )
        except OSError:
            self.stop()  # the log file closed again: a start that never ran leaves nothing open
            raise
        self.starts += 1
        _LIVE.add(self)

    def wait_ready(self) -> None:
        """Block until :meth:`is_ready` holds; ``error`` with the log's end when the server exits
        first or ``startup_timeout_s`` passes."""
        import httpx

        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise self.error(
                    f"the {self.what} exited with status {self.proc.returncode if self.proc else '?'} "
                    f"before it was ready: {self._log_tail()}"
                )
            try:
                if self.is_ready():
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(self.poll_s)
        raise self.error(
            f"the {self.what} did not answer on {self.hostport} within {self.startup_timeout_s:.0f} s: "
            f"{self._log_tail()}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM the launcher (it stops the server), then SIGKILL the whole group if it lingers."""
        proc, self.proc = self.proc, None
        stop_process(proc, self.stop_timeout_s if timeout_s is None else timeout_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        _LIVE.discard(self)

    def restart(self) -> Any:
        """Stop what is left of the server and start it again on the same port."""
        self.stop()
        return self.start()

    def kill(self) -> None:
        """SIGKILL the server's whole process group at once (what a crash does; for tests)."""
        if self.proc is not None:
            kill_group(self.proc.pid)
            self.proc.wait(timeout=10)

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log: give log_path)"
        if self._log_file is not None:
            self._log_file.flush()
        data = self.log_path.read_bytes()[-_LOG_TAIL:].decode(errors="replace")
        return f"the end of {self.log_path}:\n{data}"

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: servers started by this process, stopped at interpreter exit
_LIVE: weakref.WeakSet[ManagedProcess] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(timeout_s=10)
