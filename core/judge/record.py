"""The judge's calls, served through a gateway of its own and recorded as rollouts in a judge store.

Each judge call is a rollout (mode ``test``, metadata ``{"agl.judge": ...}`` naming the rollouts it
judged): the gateway writes the call's chat span — prompt, reply, token counts — under it, and
:meth:`JudgeRecorder.finish` adds one ``agl.object`` span with the parsed scores, so any reward can be
traced back to the call that produced it. The gateway is agl's own (:mod:`agl.gateway`) in front of
an :class:`~agl.gateway.OpenAIBackend` (any OpenAI-compatible endpoint) or a given backend.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from agl import semconv as sc
from agl.errors import JudgeUnavailable

__all__ = ["JudgeCall", "JudgeRecorder", "JudgeUnavailable"]

#: rollout metadata key marking a judge call
META_KEY = "agl.judge"


class _TransientError(Exception):
    pass


@dataclass
class JudgeCall:
    """One judge rollout in progress: its id and attempt, and the usage of its requests so far."""

    rollout_id: str
    attempt: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0


class JudgeRecorder:
    """A judge store plus the gateway in front of the judge model; thread-safe, one call at a time."""

    def __init__(self, store: Any, backend: Any, *, retries: int = 3, backoff_s: float = 1.0) -> None:
        from agl.gateway.testing import serve_gateway  # uvicorn in a daemon thread, loopback only

        self.store = store
        self.retries = retries
        self.backoff_s = backoff_s
        self._stack = contextlib.ExitStack()
        self._root = self._stack.enter_context(serve_gateway(backend, store)).root
        self._lock = threading.Lock()

    def start(self, metadata: dict[str, Any]) -> JudgeCall:
        """A new judge rollout, running, ready to receive the gateway's spans."""
        from agl.types import NewRollout

        rid = f"judge-{uuid.uuid4().hex[:16]}"
        with self._lock:
            self.store.enqueue([NewRollout(id=rid, mode="test", metadata={META_KEY: metadata})])
            claim = self.store.claim("agl-judge", modes=["test"])
        if claim is None or claim.rollout.id != rid:
            raise RuntimeError(
                f"the judge store has other queued test rollouts ({claim.rollout.id if claim else 'none'}); "
                "use a judge store of its own"
            )
        return JudgeCall(rid, claim.attempt.number)

    def chat(self, call: JudgeCall, model: str, messages: list[dict[str, Any]], timeout_s: float) -> str:
        """The judge's reply text, retried with exponential backoff on transport errors and 5xx/429;
        :class:`JudgeUnavailable` when every try failed."""
        last = ""
        for i in range(self.retries + 1):
            if i:
                time.sleep(self.backoff_s * 2 ** (i - 1))
            try:
                return self._post(call, model, messages, timeout_s)
            except _TransientError as exc:
                last = str(exc)
        raise JudgeUnavailable(f"the judge endpoint failed {self.retries + 1} times; last error: {last}")

    def _post(self, call: JudgeCall, model: str, messages: list[dict[str, Any]], timeout_s: float) -> str:
        import httpx

        url = f"{self._root}/rollouts/{call.rollout_id}/attempts/{call.attempt}/v1/chat/completions"
        body = {"model": model, "messages": messages, "temperature": 0.0}
        try:
            r = httpx.post(url, json=body, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise _TransientError(f"{type(exc).__name__}: {exc}") from None
        if r.status_code >= 500 or r.status_code == 429:
            raise _TransientError(f"HTTP {r.status_code}: {r.text[:200]}")
        if r.status_code >= 400:
            raise JudgeUnavailable(
                f"the judge endpoint refused the request: HTTP {r.status_code}: {r.text[:300]}"
            )
        data = r.json()
        usage = data.get("usage") or {}
        call.requests += 1
        call.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        call.completion_tokens += int(usage.get("completion_tokens") or 0)
        return str((data.get("choices") or [{}])[0].get("message", {}).get("content") or "")

    def finish(self, call: JudgeCall, result: dict[str, Any], ok: bool) -> None:
        """Record the parsed scores (or why there are none) as an ``agl.object`` span and end the rollout."""
        from agl.types import AttemptError, Span

        now = time.time_ns()
        span = Span(
            trace_id=secrets.token_hex(16),
            span_id=secrets.token_hex(8),
            name=sc.SPAN_OBJECT,
            start_ns=now,
            end_ns=now,
            attributes={sc.AGL_OBJECT_JSON: json.dumps(result, ensure_ascii=False, default=str)},
            rollout_id=call.rollout_id,
            attempt=call.attempt,
        )
        self.store.add_spans([span])
        error = (
            None if ok else AttemptError(type="JudgeOutputError", message=str(result.get("error", ""))[:500])
        )
        self.store.finish_attempt(call.rollout_id, call.attempt, "succeeded" if ok else "failed", error=error)

    def close(self) -> None:
        self._stack.close()
