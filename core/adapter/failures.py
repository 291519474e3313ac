"""Why a rollout ended as it did: one rule, read from what the store and the spans already hold.

The trainer must not score an attempt that failed because the infrastructure did (a 502 from the
gateway, an engine that went away, a runner that died): its zero would teach the policy to avoid
whatever it did before the crash and shift its group's baseline. :func:`failure_kind` tells those apart
from the agent's own failures and from honest outcomes. The first row that matches decides:

| kind        | when                                                                                   |
|-------------|----------------------------------------------------------------------------------------|
| `infra`     | no attempt finished (every one was `lost` or `timed_out`: the runner died or lost its  |
|             | lease; but see `agent`); an `agl.exception` span marked infra (`agl.emit_exception(exc, infra=True)`,    |
|             | an `agl.InfraError`); an LLM call span in ERROR with an infrastructure error (the       |
|             | gateway's 502 `BackendError`, an unreachable or closed upstream) — also when the agent  |
|             | caught it and returned a reward of its own; the attempt's error is an infrastructure    |
|             | one (a connection error, a 5xx answer, the runner's shutdown); a rollout timeout while  |
|             | one of its LLM calls failed, was cut off or still waited on its reply (the runner marks |
|             | that timeout's ``agl.exception`` span infra: ``agl.tracing.provider.open_llm_calls``)   |
| `agent`     | the attempt failed otherwise: the agent's own code raised (a bug, a crashed tool), or  |
|             | it ran past its timeout with no LLM call left waiting — also when the store's timeout  |
|             | ended the attempt first and the live runner's verdict (its ``TimeoutError`` span, not  |
|             | marked infra) came after                                                               |
| `task`      | the attempt succeeded with a reward span, good or bad                                  |
| `no_reward` | the attempt succeeded without a reward span                                            |

Infrastructure errors are recognised by type name (:data:`INFRA_ERROR_TYPES`, the names agl's gateway
and the OpenAI/Anthropic/httpx clients use) or by an HTTP 5xx in the message (``Error code: 502``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

from agl import semconv as sc
from agl.adapter.rewards import final_reward
from agl.adapter.spans import finishing_attempt
from agl.types import AttemptError, Rollout, Span

__all__ = [
    "FAILURE_KINDS",
    "INFRA_ERROR_TYPES",
    "FailureKind",
    "attempt_kind",
    "deciding_attempt",
    "failure_kind",
    "is_infra_error",
]

FailureKind = Literal["infra", "agent", "task", "no_reward"]
FAILURE_KINDS: tuple[str, ...] = ("infra", "agent", "task", "no_reward")

#: exception type names that mean the infrastructure failed, not the agent (agl's own, the gateway's
#: 502, the OpenAI/Anthropic SDKs' connection and 5xx errors, httpx/aiohttp/stdlib connection errors)
INFRA_ERROR_TYPES: frozenset[str] = frozenset(
    {
        "InfraError",
        "BackendError",  # the gateway answered 502: the engine failed to reply
        "StoreUnavailableError",
        "_ShutdownError",  # the runner shut down under the rollout
        "ClientGone",  # the gateway saw the call's connection close
        "APIConnectionError",
        "APITimeoutError",
        "InternalServerError",
        "ServiceUnavailableError",
        "BadGatewayError",
        "ConnectError",
        "ConnectTimeout",
        "ReadError",
        "RemoteProtocolError",
        "ServerDisconnectedError",
        "ClientConnectorError",
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionRefusedError",
        "ConnectionAbortedError",
        "BrokenPipeError",
        "IncompleteRead",
    }
)

_HTTP_5XX = re.compile(r"\b(?:error code|status(?: code)?|HTTP)[: ]+5\d\d\b", re.IGNORECASE)
_LLM_SPANS = frozenset({sc.SPAN_CHAT, sc.OP_TEXT_COMPLETION, sc.OP_GENERATE_CONTENT})


def is_infra_error(type_name: str | None, message: str | None = None) -> bool:
    """Whether an error (its type's name, its message) is an infrastructure failure."""
    name = (type_name or "").rsplit(".", 1)[-1]
    return name in INFRA_ERROR_TYPES or bool(message and _HTTP_5XX.search(message))


def _span_errors(span: Span) -> list[tuple[str | None, str | None]]:
    """(type, message) of each exception a span records: its events, else its own attributes."""
    out = [
        (e.attributes.get(sc.AGL_EXCEPTION_TYPE), e.attributes.get(sc.AGL_EXCEPTION_MESSAGE))
        for e in span.events
        if e.name == sc.EVENT_EXCEPTION
    ]
    return out or [(span.attributes.get(sc.AGL_EXCEPTION_TYPE), span.status.message)]  # type: ignore[list-item]


def _infra_in_spans(spans: list[Span]) -> bool:
    """An infra-marked ``agl.exception`` span, or an LLM call that failed on the infrastructure."""
    for s in spans:
        if s.name == sc.SPAN_EXCEPTION and s.attributes.get(sc.AGL_EXCEPTION_INFRA) is True:
            return True
        if s.name in _LLM_SPANS and s.status.code == "ERROR":
            if any(is_infra_error(t if isinstance(t, str) else None, m) for t, m in _span_errors(s)):
                return True
    return False


def _timed_out_waiting(error: AttemptError, spans: list[Span]) -> bool:
    """A rollout timeout while an LLM call failed or was cut off (the call waited on the engine)."""
    if error.type != "TimeoutError":
        return False
    return any(s.name in _LLM_SPANS and s.status.code == "ERROR" for s in spans)


def deciding_attempt(rollout: Rollout) -> int | None:
    """The attempt whose spans decide ``rollout``'s kind: its finishing attempt, else the last one the
    store ended (``lost``/``timed_out``; its spans are stale, but hold the runner's verdict when the
    runner lived to give one), else None. Pass its spans, stale ones included, to :func:`failure_kind`."""
    att = finishing_attempt(rollout)
    if att is None and rollout.attempts:
        return rollout.attempts[-1].number
    return att


def _timed_out_in_own_code(rollout: Rollout, attempt: int, spans: list[Span]) -> bool:
    """The store timed the attempt out, but its live runner recorded the timeout (a ``TimeoutError``
    exception span) with no sign of the infrastructure: no call was left waiting, none failed."""
    mine = [s for s in spans if s.rollout_id == rollout.id and s.attempt == attempt]
    said = any(
        s.name == sc.SPAN_EXCEPTION and s.attributes.get(sc.AGL_EXCEPTION_TYPE) == "TimeoutError"
        for s in mine
    )
    return (
        said
        and not _infra_in_spans(mine)
        and not any(s.name in _LLM_SPANS and s.status.code == "ERROR" for s in mine)
    )


def failure_kind(rollout: Rollout, spans: Iterable[Span]) -> FailureKind:
    """The failure kind of ``rollout``'s finishing attempt (the table in the module docstring).

    ``spans`` are the spans of its :func:`deciding_attempt` (others, and stale ones of a finishing
    attempt, are ignored), as the adapter reads them. A rollout still running has no kind yet: it is
    classified as what it is now (``no_reward``)."""
    spans = list(spans)
    att = finishing_attempt(rollout)
    if att is None:
        ended = [a for a in rollout.attempts if a.status in ("lost", "timed_out")]
        if (
            ended
            and ended[-1].status == "timed_out"
            and _timed_out_in_own_code(rollout, ended[-1].number, spans)
        ):
            return "agent"
        return "infra" if ended or rollout.status == "failed" else "no_reward"
    live = [s for s in spans if not s.stale and s.rollout_id == rollout.id and s.attempt == att]
    if _infra_in_spans(live):
        return "infra"
    attempt = next((a for a in rollout.attempts if a.number == att), None)
    if attempt is not None and attempt.status == "failed":
        error = attempt.error
        if error is not None and (
            is_infra_error(error.type, error.message) or _timed_out_waiting(error, live)
        ):
            return "infra"
        return "agent"
    return "task" if final_reward(live) is not None else "no_reward"


def attempt_kind(rollout: Rollout, number: int, spans: Iterable[Span]) -> FailureKind | None:
    """The failure kind of attempt ``number`` alone, as if it had been the rollout's only attempt (the
    same table): a retried attempt says why it was retried (``infra``: requeued; ``agent``: the store's
    retry). For the :func:`deciding_attempt` this is :func:`failure_kind`. None while it runs.
    ``spans``: the rollout's spans, stale ones included (those of other attempts are ignored)."""
    attempt = next((a for a in rollout.attempts if a.number == number), None)
    if attempt is None or attempt.status == "running":
        return None
    status = "succeeded" if attempt.status == "succeeded" else "failed"
    alone = rollout.model_copy(update={"attempts": [attempt], "status": status})
    return failure_kind(alone, [s for s in spans if s.attempt == number])
