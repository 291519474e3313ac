"""The judge tests' agent model: it answers ``answer N``, N from the rollout id (see judge_helpers.py)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture(scope="module")
def agl_policy() -> Callable[[Any], Any]:
    """The agent's model answers ``answer N`` where N is the digit at the end of the rollout id."""

    def policy(request: Any) -> str:
        rid = request.rollout[0] if request.rollout else "ro-0"
        digits = re.sub(r"\D", "", rid.rsplit("-", 1)[-1])
        return f"answer {digits or '0'}"

    return policy
