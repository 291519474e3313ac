"""``agl store serve`` in a child process (``ServerProcess``), for tests, benchmarks and crash drills.

Re-exported by ``agl.store.server``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence

from agl.store.base import STORE_TOKEN_ENV

__all__ = ["ServerProcess"]


class ServerProcess:
    """``agl store serve`` in a child process: for tests, benchmarks and crash drills.

    ``start()`` returns once the server prints its ready line (with the real port when ``port=0``);
    ``kill()`` sends SIGKILL, as a crash would; ``start()`` again restarts it on the same database.
    """

    def __init__(
        self,
        db: str | os.PathLike[str] | None = None,
        *,
        store_url: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        env: dict[str, str] | None = None,
        args: Sequence[str] = (),
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        if (db is None) == (store_url is None):
            raise ValueError("give exactly one of db= or store_url=")
        self.db = db
        self.store_url = store_url
        self.host = host
        self.port = port
        self.token = token
        self.env = env or {}
        self.args = list(args)
        self.log_path = log_path
        self.url: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        where = ["--db", os.fspath(self.db)] if self.db is not None else ["--store", str(self.store_url)]
        port = self.port
        if self.url is not None and port == 0:
            port = int(self.url.rsplit(":", 1)[1])  # a restart keeps the address clients know
        cmd = [
            sys.executable,
            "-m",
            "agl.cli",
            "store",
            "serve",
            *where,
            "--host",
            self.host,
            "--port",
            str(port),
        ]
        return cmd + self.args

    def start(self, timeout_s: float = 30.0) -> str:
        import selectors

        env = {**os.environ, **self.env}
        if self.token is not None:
            env[STORE_TOKEN_ENV] = self.token
        log = open(self.log_path, "ab") if self.log_path is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=log, env=env)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # type: ignore[union-attr]
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(remaining):
                self.kill()
                raise TimeoutError(f"store server did not start within {timeout_s}s: {self.command()}")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                code = self.proc.wait()
                raise RuntimeError(f"store server exited with {code} before it was ready: {self.command()}")
            line += chunk
        sel.close()
        self.url = line.decode().split()[-1]
        return self.url

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, exactly like a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """One plain request (stdlib client) with the token, for test plumbing."""
        import http.client
        from urllib.parse import urlsplit

        assert self.url is not None, "start() first"
        parts = urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname or self.host, parts.port, timeout=30)
        headers = {"content-type": "application/json"}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
