"""Fixtures for the gateway tests: a memory store with a running rollout."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gw_helpers import start_rollout

import agl.store


@pytest.fixture
def store() -> Iterator[Any]:
    s = agl.store.open("memory://")
    yield s
    s.close()


@pytest.fixture
def rollout(store: Any) -> tuple[str, int]:
    return start_rollout(store, "ro-gw-1")
