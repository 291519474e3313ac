"""Instrumentation: ``agl.instrument()`` and the toolkit every integration is built with.

- :mod:`agl.instrumentation.registry` — ``instrument`` / ``uninstrument``, the ``Instrumentor`` base
  class, the registry of integrations (held by the plugin manager) and their ``health()``.
- :mod:`agl.instrumentation.toolkit` — ``PatchLedger`` (reversible ``wrapt`` patches by path),
  ``safe_json`` (span attributes) and ``guarded`` (an integration's failure is logged once per site,
  counted, and never reaches the application).
- :mod:`agl.reports.doctor` — what ``agl doctor`` prints from these.

``agl.instrument`` and ``agl.uninstrument`` are these functions, re-exported by ``agl``.
"""

from __future__ import annotations

from agl.instrumentation.registry import (
    Health,
    Instrumentor,
    IntegrationNotFoundError,
    MissingFrameworkError,
    available_instrumentors,
    get_instrumentor,
    health,
    instrument,
    instrumented,
    is_installed,
    is_instrumented,
    is_waiting,
    uninstrument,
)
from agl.instrumentation.toolkit import PatchLedger, PatchTargetError, failure_counts, guarded, safe_json

__all__ = [
    "Health",
    "IntegrationNotFoundError",
    "Instrumentor",
    "MissingFrameworkError",
    "PatchLedger",
    "PatchTargetError",
    "available_instrumentors",
    "failure_counts",
    "get_instrumentor",
    "guarded",
    "health",
    "instrument",
    "instrumented",
    "is_installed",
    "is_waiting",
    "is_instrumented",
    "safe_json",
    "uninstrument",
]
