"""Every exception agl raises on purpose, under one root.

Every class is defined here (the modules that raise them import them from here, and re-export them
where a package's face names them: ``agl.judge.JudgeUnavailable``, ``agl.engine.vllm_server.VLLMServerError``). Each class also keeps the built-in base it had before ``AglError`` existed, so ``except
ValueError`` / ``except KeyError`` callers keep working::

    AglError
    ├── UsageError(ValueError) ................. a user's mistake: bad flag, bad file, busy port
    ├── StoreError ............................. status/code = the HTTP answer
    │   ├── InvalidInputError(ValueError) ...... 400
    │   ├── NotFoundError(KeyError) ............ 404
    │   ├── ConflictError ...................... 409
    │   ├── StoreUnavailableError(ConnectionError)  503, after the retry window
    │   └── StoreAuthError(PermissionError) ....... 401
    ├── InfraError ............................. an infrastructure failure, not the agent's: requeued
    ├── BackendError ........................... gateway answers 502
    │   └── UpstreamError ...................... an upstream's own 4xx, passed on
    ├── ContextWindowError ..................... gateway answers 400
    ├── UnknownModelError ...................... gateway answers 404
    ├── ApiError ............................... an OpenAI-style error body
    ├── MissingRolloutError(ValueError) ........ a span that names no rollout
    ├── MissingFrameworkError(ImportError) ..... an integration's framework is not installed
    ├── IntegrationNotFoundError(ValueError) ... no integration of that name
    ├── PatchTargetError(AttributeError) ....... a patched framework attribute is gone
    ├── OptimizerError ......................... one APO child fails
    ├── BudgetExhausted ........................ APO's optimiser token budget is spent
    ├── VLLMServerError ........................ the managed vLLM server did not start or lacks a need
    ├── MalformedJudgeOutput(ValueError) ....... a judge's reply is not the JSON asked for
    └── JudgeUnavailable(RuntimeError) ......... the judge endpoint kept failing after every retry

The ``agl`` command prints an ``AglError`` as one line (``agl CMD: error: ...``, exit status 2);
anything else that escapes a command — a bare ``KeyError`` or ``ValueError`` from agl's own code —
is a bug and keeps its traceback. A library function that refuses a caller's input raises a class
above (``UsageError`` when no narrower one fits), never a bare built-in the CLI would have to guess
about.

This module imports nothing from agl: every module can import its errors from here without a cycle,
and ``import agl.errors`` stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AglError",
    "ApiError",
    "BackendError",
    "BudgetExhausted",
    "ConflictError",
    "InfraError",
    "ContextWindowError",
    "IntegrationNotFoundError",
    "InvalidInputError",
    "JudgeUnavailable",
    "MalformedJudgeOutput",
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
    "VLLMServerError",
]


class AglError(Exception):
    """Root of every exception agl raises on purpose (see the hierarchy above)."""


class UsageError(AglError, ValueError):
    """A user's mistake — a bad flag, a missing or malformed file they named, a busy port — that the
    ``agl`` command prints as one line (exit status 2). A ``ValueError`` too, for callers of the
    library functions that raised ``ValueError`` before this class existed."""


# ------------------------------------------------------------------- store (HTTP status = the answer)


class StoreError(AglError):
    """Base of every error a store raises on purpose. ``status`` is the HTTP status the server uses."""

    status = 400
    code = "store_error"


class InvalidInputError(StoreError, ValueError):
    status = 400
    code = "invalid_input"


class NotFoundError(StoreError, KeyError):
    status = 404
    code = "not_found"

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "not found"


class ConflictError(StoreError):
    """The request is well-formed but illegal in the current state (e.g. finishing an ended attempt)."""

    status = 409
    code = "conflict"


class StoreUnavailableError(StoreError, ConnectionError):
    """The server could not be reached (or kept failing) for the whole retry window."""

    status = 503
    code = "unavailable"


class StoreAuthError(StoreError, PermissionError):
    """The server refused the bearer token (or none was given)."""

    status = 401
    code = "unauthorized"


# ------------------------------------------------------------------- gateway and its backends


class InfraError(AglError):
    """An infrastructure failure — an engine, gateway, tool server or network the agent depends on went
    down — which an agent raises (or records with ``agl.emit_exception(exc, infra=True)``) to say the
    rollout's outcome says nothing about the policy. The attempt is classified ``infra``
    (:func:`agl.adapter.failures.failure_kind`): the trainer requeues it and never scores it."""


class BackendError(AglError):
    """The backend failed to produce a reply; the gateway answers 502 and records an ERROR span."""


class UpstreamError(BackendError):
    """An upstream server refused the request itself (4xx): the gateway passes status and body on."""

    def __init__(self, status: int, message: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class ContextWindowError(AglError):
    """The rendered prompt does not fit the model's context window (the gateway answers 400)."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        super().__init__(
            f"this model's maximum context length is {limit} tokens, but the prompt has {prompt_tokens} "
            "tokens; shorten the messages"
        )
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class UnknownModelError(AglError):
    """The request names a model this backend does not serve (the gateway answers 404)."""

    def __init__(self, model: str, available: list[str]) -> None:
        super().__init__(
            f"the model {model!r} does not exist on this gateway; available: {', '.join(available)}"
        )
        self.model = model


class ApiError(AglError):
    """An error answered with an OpenAI-style JSON body: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ------------------------------------------------------------------- tracing and instrumentation


class MissingRolloutError(AglError, ValueError):
    """The span carries no ``agl.rollout.id``/``agl.attempt``: it belongs to no rollout."""


class MissingFrameworkError(AglError, ImportError):
    """An integration was asked for by name but its framework is not installed."""


class IntegrationNotFoundError(AglError, ValueError):
    """No registered integration has that name."""


class PatchTargetError(AglError, AttributeError):
    """A patch target does not exist (the framework renamed or removed it)."""


# ------------------------------------------------------------------- APO


class OptimizerError(AglError):
    """An optimiser call that produced nothing usable (HTTP error, bad JSON, empty or invalid rewrite)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class BudgetExhausted(AglError):
    """The next optimiser call would not fit in ``max_optimizer_tokens``."""


# ------------------------------------------------------------------- the managed vLLM server


class VLLMServerError(AglError):
    """The managed vLLM server did not start, exited, or lacks what agl needs."""


# ------------------------------------------------------------------- the LLM judge


class MalformedJudgeOutput(AglError, ValueError):
    """The judge's reply is not the JSON asked for; the message says what is wrong (the repair request
    quotes it)."""


class JudgeUnavailable(AglError, RuntimeError):
    """The judge endpoint kept failing after every retry: the step fails loudly, nothing is guessed."""
