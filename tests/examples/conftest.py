"""The examples are run as ``python -m examples.<name>`` from the repository root: make that root
importable here too, whatever directory pytest was started from."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _uninstrument_after_the_example() -> object:
    """An example instruments its frameworks as a user's app would and never undoes it; undo it here so
    later test modules start from an uninstrumented process."""
    yield
    import agl

    agl.uninstrument()
