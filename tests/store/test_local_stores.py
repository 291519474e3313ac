"""In-process stores only (memory, SQLite): behaviour that has no meaning for a remote client."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agl.store.base import ConflictError, Store
from agl.store.memory import MemoryStore
from agl.store.sqlite import SQLiteStore
from agl.types import NewRollout

OPENERS: dict[str, Callable[[Path], Store]] = {
    "memory": lambda tmp: MemoryStore(),
    "sqlite": lambda tmp: SQLiteStore(tmp / "local.db"),
}


@pytest.fixture(params=list(OPENERS))
def local_store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return OPENERS[request.param](tmp_path)


@pytest.mark.parametrize("call", ["claim", "wait"])
def test_close_wakes_blocked_callers(local_store: Store, call: str) -> None:
    rid = local_store.enqueue([NewRollout()])[0].id
    local_store.claim("w")  # the queue is empty now: claim blocks, and so does the wait
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            if call == "claim":
                local_store.claim("w2", timeout_s=30)
            else:
                local_store.wait_for_rollouts([rid], timeout_s=30)
        except BaseException as e:
            errors.append(e)

    th = threading.Thread(target=blocked)
    th.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    local_store.close()
    th.join(timeout=10)
    assert not th.is_alive() and time.monotonic() - t0 < 5
    assert len(errors) == 1 and isinstance(errors[0], ConflictError) and "closed" in str(errors[0])
    local_store.close()  # closing twice is harmless
    with pytest.raises(ConflictError, match="closed"):
        local_store.enqueue([NewRollout()])
