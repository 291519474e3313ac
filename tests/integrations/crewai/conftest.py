"""The CrewAI suite on agl.testing's fixtures: the scripted model plays the research crew's agents.

No framework import at module level: without CrewAI (the ``core`` env) the test modules skip
themselves through ``pytest.importorskip`` and these fixtures are never used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture(scope="module")
def agl_policy() -> Callable[[Any], Any]:
    from crewai_research_app import policy

    return policy


@pytest.fixture(scope="module")
def agl_agent_of() -> Callable[[Any], str | None]:
    from crewai_research_app import agent_of

    return lambda request: agent_of(request.messages)
