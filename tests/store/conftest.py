"""Store factories for the conformance suite.

Every implementation of ``agl.store.base.Store`` runs the same tests (``conformance.py``). To add one,
write a context manager ``factory(tmp_path) -> Iterator[Store]`` that yields a fresh, empty store and
cleans up after itself, and add it to ``STORE_FACTORIES`` below. Nothing else changes.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

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

#: name -> factory. Add an implementation here (e.g. "http": a server over SQLite + HttpStore client).
STORE_FACTORIES: dict[str, StoreFactory] = {
    "memory": memory_store,
    "sqlite": sqlite_store,
    "http": http_store,  # store-server work: see http_store above
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
