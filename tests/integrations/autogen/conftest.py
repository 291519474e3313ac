"""The AutoGen suite on agl.testing's fixtures: the scripted model plays the math app's agents."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("autogen_agentchat")
pytest.importorskip("autogen_ext.models.openai")

from autogen_math_app import policy, role_of  # noqa: E402


@pytest.fixture(scope="module")
def agl_policy() -> Callable[[Any], Any]:
    return lambda request: policy(request.messages)


@pytest.fixture(scope="module")
def agl_agent_of() -> Callable[[Any], str | None]:
    return lambda request: role_of(request.messages)
