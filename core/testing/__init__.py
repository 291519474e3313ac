"""``agl.testing``: what agl's own integration tests use, for users' tests of their own agents.

Installed as a pytest plugin (entry point ``pytest11``), so with agl installed these fixtures are
available in any test suite without an import:

- ``agl_store`` — a fresh SQLite store in the test's ``tmp_path``, closed afterwards;
- ``agl_gateway`` — agl's real OpenAI-compatible gateway on 127.0.0.1 with the ``scripted`` backend,
  writing its spans into ``agl_store``; a ``str`` base URL with ``.store``, ``.model`` (the
  :class:`RecordingModel`: every call the model was asked) and ``.for_rollout(id, attempt)``;
  ``agl_gateway_url`` is one per session that records no spans;
- ``agl_policy`` / ``agl_agent_of`` — override these (session scope) in your ``conftest.py`` to script
  the model: ``policy(request) -> reply`` (see ``agl.gateway.testing.reply``/``tool_call``) and
  ``agent_of(request) -> name`` for the record;
- ``agl_tracer`` — a private tracer provider with spans kept in memory; ``agl_tracer.instrument(...)``
  instruments integrations onto it, and everything is uninstrumented and reset afterwards.

Helpers: :func:`assert_agent_spans` (``assert_agent_spans(store, rollout_id, ["writer", "checker"])``),
:class:`SpanTree`, and :func:`assert_merged` (``assert_merged(transitions, {"writer": 1})``: what
multi-turn merging makes of each agent's calls, checked). Test-only store-server routes (a fresh
store per test on one server process) live in :mod:`agl.testing.store_server`.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "AgentSpans",
    "Call",
    "InstrumentedTracer",
    "Merged",
    "RecordingModel",
    "SpanTree",
    "assert_agent_spans",
    "assert_merged",
]

_LAZY = {
    "AgentSpans": "agl.testing.spans",
    "SpanTree": "agl.testing.spans",
    "assert_agent_spans": "agl.testing.spans",
    "Merged": "agl.testing.merging",
    "assert_merged": "agl.testing.merging",
    "Call": "agl.testing.fixtures",
    "InstrumentedTracer": "agl.testing.fixtures",
    "RecordingModel": "agl.testing.fixtures",
}


def __getattr__(name: str) -> Any:  # lazy: the pytest plugin loads this package in every test run
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agl.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
