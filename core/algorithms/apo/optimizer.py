"""The optimiser client: asks the optimiser LLM for a critique of a prompt (the *textual
gradient*) and a rewrite that answers it (the *edit*), within the token budget.

Each call is one rollout of the optimiser's store: APO enqueues and claims it itself, posts a plain
``chat/completions`` to the optimiser gateway's per-rollout URL, then finishes the attempt, so the
gateway records a server ``chat`` span with the full prompt and reply (``agl spans --store
sqlite:///RUN/optimizer.db ID``). Token usage is summed from each reply.

A call that yields nothing usable raises :class:`~agl.algorithms.apo.text.OptimizerError` with a
reason (``http_error``, ``bad_response``, ``bad_json``, ``empty_critique``, ``empty_rewrite``,
``bad_template``, ``placeholders``); the loop counts it and moves on to the next child.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agl.algorithms.apo.artifacts import RunFiles
from agl.algorithms.apo.beam import Candidate, Failure, mean
from agl.algorithms.apo.environment import Environment
from agl.algorithms.apo.text import (
    JSON_ASK,
    REPAIR_ASK,
    TEXT_ASK,
    OptimizerError,
    clip,
    estimate_tokens,
    parse_rewrite,
    summarize_trace,
)
from agl.errors import BudgetExhausted
from agl.tracing.prompts import placeholders
from agl.types import NewRollout, RolloutConfig, Span

if TYPE_CHECKING:
    from collections.abc import Callable

    from agl.algorithms.apo.algorithm import APO
    from agl.types import Rollout

__all__ = ["BudgetExhausted", "OptimizerClient"]

log = logging.getLogger("agl.apo")


class OptimizerClient:
    """Critiques and rewrites through the optimiser's gateway; counts calls, tokens and failures."""

    def __init__(
        self, apo: APO, env: Environment, files: RunFiles, spans_of: Callable[[Rollout], Sequence[Span]]
    ) -> None:
        self.apo, self.env, self.files = apo, env, files
        self.spans_of = spans_of  #: a failed rollout's spans, turned into the trace the critique shows
        self.calls = 0
        self.tokens_used = 0
        self.failures: dict[str, int] = {}
        self.budget_exhausted = False

    # ---------------------------------------------------------------------------------- one call
    def _reserve(self, messages: list[dict[str, str]], max_tokens: int) -> int:
        """``max_tokens`` cut to what the budget leaves after the (high) prompt estimate; raises
        :class:`BudgetExhausted` when fewer than ``min(64, max_tokens)`` reply tokens would fit."""
        budget = self.apo.max_optimizer_tokens
        if budget is None:
            return max_tokens
        left = budget - self.tokens_used - estimate_tokens(messages)
        if left < min(64, max_tokens):
            self.budget_exhausted = True
            raise BudgetExhausted()
        return min(max_tokens, left)

    def chat(self, messages: list[dict[str, str]], kind: str, meta: dict[str, Any]) -> str:
        """One optimiser call through its gateway, recorded as a rollout of the optimiser store."""
        import httpx

        from agl.types import AttemptError

        env, apo = self.env, self.apo
        sampling = dict(apo.optimizer_sampling)
        max_tokens = self._reserve(messages, int(sampling.pop("max_tokens", 1024)))
        rid = f"apo-opt-{uuid.uuid4().hex[:12]}"
        env.opt_store.enqueue(
            [
                NewRollout(
                    id=rid,
                    input={"kind": kind, **meta},
                    mode="test",
                    config=RolloutConfig(lease_s=max(3600.0, 2 * apo.optimizer_timeout_s)),
                    metadata={"apo": {"optimizer": kind, **meta}},
                )
            ]
        )
        claim = env.opt_store.claim("agl-apo-optimizer", timeout_s=5.0, modes=["test"])
        if claim is None or claim.rollout.id != rid:  # someone else shares the optimiser store
            raise RuntimeError("the optimiser store handed out another rollout: give APO a store of its own")
        self.calls += 1
        body = {"model": env.opt_model, "messages": messages, "max_tokens": max_tokens, **sampling}
        url = f"{env.opt_url[: -len('/v1')]}/rollouts/{rid}/attempts/1/v1/chat/completions"
        status, error = "failed", None
        try:
            try:
                resp = httpx.post(url, json=body, timeout=apo.optimizer_timeout_s)
            except httpx.HTTPError as exc:
                raise OptimizerError("http_error", f"the optimiser call failed: {exc!r}") from None
            data: Any = None
            with contextlib.suppress(ValueError):
                data = resp.json()
            usage = data.get("usage") if isinstance(data, dict) else None
            if isinstance(usage, dict):
                self.tokens_used += int(usage.get("prompt_tokens") or 0) + int(
                    usage.get("completion_tokens") or 0
                )
            else:
                self.tokens_used += estimate_tokens(messages)
            if resp.status_code >= 400:
                detail = (data or {}).get("error", {}).get("message") if isinstance(data, dict) else resp.text
                raise OptimizerError(
                    "http_error", f"the optimiser answered {resp.status_code}: {str(detail)[:300]}"
                )
            try:
                text = data["choices"][0]["message"].get("content") or ""
            except (TypeError, KeyError, IndexError, AttributeError):
                raise OptimizerError("bad_response", f"not a chat completion: {str(data)[:200]}") from None
            status = "succeeded"
            return str(text)
        except OptimizerError as exc:
            error = AttemptError(type=exc.reason, message=str(exc))
            raise
        finally:
            with contextlib.suppress(Exception):
                env.opt_store.finish_attempt(rid, 1, status, error=error)

    # ------------------------------------------------------------------- textual gradient, edit
    def critique(self, cand: Candidate, name: str, failures: Sequence[Failure], meta: dict[str, Any]) -> str:
        """What in prompt ``name`` makes the agent fail, from the failing tasks and their traces."""
        apo = self.apo
        rewards = cand.train_rewards
        parts = [
            f'The agent "{name}" runs with this prompt:\n<prompt>\n{cand.prompts[name]}\n</prompt>\n',
            f"With it the agent scored a mean reward of {mean(rewards) or 0.0:.2f} on {len(rewards)} "
            f"training tasks. Here are {len(failures)} tasks it failed, with what happened:\n",
        ]
        for i, (task, rollout, reward) in enumerate(failures, 1):
            trace = summarize_trace(self.spans_of(rollout), max_chars=apo.trace_chars)
            err = rollout.attempts[-1].error if rollout.attempts else None
            parts.append(
                f"### Failure {i} (reward {reward:g})\nTask: {clip(json.dumps(task.input, ensure_ascii=False), 600)}\n"
                + (f"Error: {err.type}: {clip(err.message, 300)}\n" if err is not None else "")
                + f"Trace:\n{trace}\n"
            )
        parts.append(
            "What in the prompt makes the agent fail on these tasks, and what should the prompt say "
            "instead? Be brief and concrete."
        )
        messages = [
            {"role": "system", "content": apo.critique_system},
            {"role": "user", "content": "\n".join(parts)},
        ]
        critique = self.chat(messages, "critique", meta).strip()
        if not critique:
            raise OptimizerError("empty_critique", "the optimiser's critique was empty")
        return critique

    def rewrite(self, cand: Candidate, name: str, critique: str, meta: dict[str, Any]) -> str:
        """A new prompt ``name`` that answers ``critique``, with the same ``{placeholders}``; a reply
        that is not the asked-for JSON is sent back for repair ``repair_retries`` times."""
        apo = self.apo
        old = cand.prompts[name]
        keep = sorted(placeholders(old))
        ask = JSON_ASK if apo.rewrite_format == "json" else TEXT_ASK
        if keep:
            braces = (
                " Keep these placeholders exactly as they are: "
                + ", ".join("{" + k + "}" for k in keep)
                + "."
            )
        else:
            braces = " Do not use curly braces."
        user = (
            f'The agent "{name}" runs with this prompt:\n<prompt>\n{old}\n</prompt>\n\n'
            f"A critique of it, from traces of tasks it failed:\n{critique}\n\n"
            f"Write the improved prompt.{braces} {ask}"
        )
        messages = [{"role": "system", "content": apo.rewrite_system}, {"role": "user", "content": user}]
        reply = self.chat(messages, "rewrite", meta)
        for attempt in range(apo.repair_retries + 1):
            try:
                new = parse_rewrite(reply, apo.rewrite_format)
                break
            except OptimizerError as exc:
                if exc.reason != "bad_json" or attempt == apo.repair_retries:
                    raise
                self.note_failure(exc, meta, retried=True)
                messages = [
                    *messages,
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": REPAIR_ASK},
                ]
                reply = self.chat(messages, "rewrite-repair", meta)
        try:
            got = placeholders(new)
        except ValueError as exc:
            raise OptimizerError("bad_template", f"the rewrite is not a valid template ({exc})") from None
        if got != set(keep):
            raise OptimizerError(
                "placeholders", f"the rewrite has placeholders {sorted(got)}, the prompt needs exactly {keep}"
            )
        return new

    def note_failure(self, exc: OptimizerError, meta: dict[str, Any], *, retried: bool = False) -> None:
        """Count a failure (``reason``, or ``reason_retried`` when the reply went back for repair)
        and write it to ``optimizer_failures.jsonl``."""
        key = exc.reason + ("_retried" if retried else "")
        self.failures[key] = self.failures.get(key, 0) + 1
        self.files.failure({**meta, "reason": exc.reason, "message": str(exc), "retried": retried})
        log.warning(
            "agl apo: optimiser %s (%s): %s",
            "reply sent back for repair" if retried else "failure",
            exc.reason,
            exc,
        )
