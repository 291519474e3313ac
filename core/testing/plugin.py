"""agl's pytest plugin (entry point ``pytest11``): the fixtures described in :mod:`agl.testing`.

Kept light: nothing heavy is imported until a fixture is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


# Module scope: a conftest.py may override agl_policy/agl_agent_of for its directory, and the model and
# gateway built from them must follow (a session-scoped model would keep the first directory's policy).
@pytest.fixture(scope="module")
def agl_policy() -> Callable[[Any], Any]:
    """The scripted model's policy, ``policy(request) -> reply``; override it in your conftest.py."""
    return lambda request: "ok"


@pytest.fixture(scope="module")
def agl_agent_of() -> Callable[[Any], str | None] | None:
    """``agent_of(request) -> name`` recorded with each call; override it in your conftest.py."""
    return None


@pytest.fixture(scope="module")
def agl_model(agl_policy: Callable[[Any], Any], agl_agent_of: Any) -> Any:
    """The recording scripted model (one per test module; the tokenizer is loaded once per process)."""
    from agl.testing.fixtures import RecordingModel

    return RecordingModel(agl_policy, agl_agent_of)


@pytest.fixture
def agl_store(tmp_path: Path) -> Iterator[Any]:
    """A fresh SQLite store in the test's tmp_path, closed afterwards."""
    from agl.store import open as open_store

    store = open_store(f"sqlite:///{tmp_path / 'agl.db'}")
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def agl_gateway(agl_model: Any, agl_store: Any) -> Iterator[Any]:
    """agl's gateway on 127.0.0.1 (scripted backend) writing its spans into ``agl_store``.

    A ``str`` (the ``/v1`` base URL) with ``.store``, ``.model``, ``.gateway`` and ``.for_rollout()``.
    """
    from agl.gateway.testing import serve_gateway

    agl_model.clear()
    with serve_gateway(agl_model.backend, agl_store) as url:
        url.store = agl_store  # type: ignore[attr-defined]
        url.model = agl_model  # type: ignore[attr-defined]
        yield url


@pytest.fixture(scope="module")
def agl_gateway_url(agl_model: Any) -> Iterator[Any]:
    """One gateway per test module that records no spans (for tests that keep spans in memory)."""
    from agl.gateway.testing import serve_gateway

    with serve_gateway(agl_model.backend) as url:
        url.model = agl_model  # type: ignore[attr-defined]
        yield url


@pytest.fixture
def agl_tracer() -> Iterator[Any]:
    """An in-memory tracer provider to instrument onto; uninstruments and resets tracing afterwards."""
    from agl.testing.fixtures import InstrumentedTracer

    tracer = InstrumentedTracer()
    try:
        yield tracer
    finally:
        tracer.close()
