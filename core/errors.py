"""Every exception agl raises on purpose, under one root.

Hierarchy (the defining module in brackets; each class also keeps the built-in base it had before
``AglError`` existed, so ``except ValueError`` / ``except KeyError`` callers keep working)::

    AglError
    ├── UsageError(ValueError) ................. a user's mistake: bad flag, bad file, busy port
    ├── StoreError ............................. [agl.store.base] status/code = the HTTP answer
    │   ├── InvalidInputError(ValueError) ...... 400
    │   ├── NotFoundError(KeyError) ............ 404
    │   ├── ConflictError ...................... 409
    │   ├── StoreUnavailableError(ConnectionError)  [agl.store.http] 503, after the retry window
    │   └── StoreAuthError(PermissionError) ....... [agl.store.http] 401
    ├── BackendError ........................... [agl.gateway.backends.base] gateway answers 502
    │   └── UpstreamError ...................... an upstream's own 4xx, passed on
    ├── ContextWindowError ..................... [agl.gateway.backends.base] gateway answers 400
    ├── UnknownModelError ...................... [agl.gateway.backends.base] gateway answers 404
    ├── ApiError ............................... [agl.gateway.protocol] an OpenAI-style error body
    ├── MissingRolloutError(ValueError) ........ [agl.tracing.provider] a span that names no rollout
    ├── MissingFrameworkError(ImportError) ..... [agl.instrumentation.registry]
    ├── IntegrationNotFoundError(ValueError) ... [agl.instrumentation.registry]
    ├── PatchTargetError(AttributeError) ....... [agl.instrumentation.toolkit]
    ├── OptimizerError ......................... [agl.algorithms.apo.text] one APO child fails
    └── BudgetExhausted ........................ [agl.algorithms.apo.optimizer]

The ``agl`` command prints an ``AglError`` as one line (``agl CMD: error: ...``, exit status 2);
anything else that escapes a command — a bare ``KeyError`` or ``ValueError`` from agl's own code —
is a bug and keeps its traceback. A library function that refuses a caller's input raises a class
above (``UsageError`` when no narrower one fits), never a bare built-in the CLI would have to guess
about.

This module imports nothing from agl at load time: the classes defined elsewhere are re-exported
lazily (``agl.errors.StoreError`` imports ``agl.store.base`` on first use), so every module can
import ``AglError`` from here without a cycle and ``import agl.errors`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names re-exported below, for type checkers and linters
    from agl.algorithms.apo.optimizer import BudgetExhausted
    from agl.algorithms.apo.text import OptimizerError
    from agl.gateway.backends.base import BackendError, ContextWindowError, UnknownModelError, UpstreamError
    from agl.gateway.protocol import ApiError
    from agl.instrumentation.registry import IntegrationNotFoundError, MissingFrameworkError
    from agl.instrumentation.toolkit import PatchTargetError
    from agl.store.base import ConflictError, InvalidInputError, NotFoundError, StoreError
    from agl.store.http import StoreAuthError, StoreUnavailableError
    from agl.tracing.provider import MissingRolloutError

__all__ = [
    "AglError",
    "ApiError",
    "BackendError",
    "BudgetExhausted",
    "ConflictError",
    "ContextWindowError",
    "IntegrationNotFoundError",
    "InvalidInputError",
    "MissingFrameworkError",
    "MissingRolloutError",
    "NotFoundError",
    "OptimizerError",
    "PatchTargetError",
    "StoreAuthError",
    "StoreError",
    "StoreUnavailableError",
    "UnknownModelError",
    "UpstreamError",
    "UsageError",
]


class AglError(Exception):
    """Root of every exception agl raises on purpose (see the hierarchy above)."""


class UsageError(AglError, ValueError):
    """A user's mistake — a bad flag, a missing or malformed file they named, a busy port — that the
    ``agl`` command prints as one line (exit status 2). A ``ValueError`` too, for callers of the
    library functions that raised ``ValueError`` before this class existed."""


#: re-exported name -> the module that defines it (imported on first access)
_HOMES: dict[str, str] = {
    "StoreError": "agl.store.base",
    "InvalidInputError": "agl.store.base",
    "NotFoundError": "agl.store.base",
    "ConflictError": "agl.store.base",
    "StoreUnavailableError": "agl.store.http",
    "StoreAuthError": "agl.store.http",
    "BackendError": "agl.gateway.backends.base",
    "UpstreamError": "agl.gateway.backends.base",
    "ContextWindowError": "agl.gateway.backends.base",
    "UnknownModelError": "agl.gateway.backends.base",
    "ApiError": "agl.gateway.protocol",
    "MissingRolloutError": "agl.tracing.provider",
    "MissingFrameworkError": "agl.instrumentation.registry",
    "IntegrationNotFoundError": "agl.instrumentation.registry",
    "PatchTargetError": "agl.instrumentation.toolkit",
    "OptimizerError": "agl.algorithms.apo.text",
    "BudgetExhausted": "agl.algorithms.apo.optimizer",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'agl.errors' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
