"""Branch rollouts: the gateway replays a parent rollout's calls up to a branch call, then samples afresh.

A *branch rollout* (made by :func:`agl.trainer.branching.enqueue_branches`) carries in its metadata
(:data:`agl.semconv.ROLLOUT_BRANCH_KEY`) its parent rollout, the parent's attempt and the index of the
*branch call* in it. Its program runs again from the start, and the gateway answers its calls in the
order the attempt makes them (the index :class:`~agl.gateway.seeds.CallSeeds` gives each call):

- a call **before** the branch call is *replayed*: answered with the parent's recorded response — the
  same text, tool calls, token ids and log-probs — without asking the backend. Its span carries
  ``agl.llm.replayed`` (the trainer leaves replayed calls out of the update: their parent trains them);
- the **branch call** is sampled by the backend afresh, with the branch rollout's own seed (every branch
  member draws its own continuation), and its span carries ``agl.llm.branch_point``;
- every call **after** it runs live.

What holds: the branch call's prompt is the parent's, token for token, when the program is
*deterministic given the LLM's responses* (the contract a rollout declares with
``@agl.rollout(replayable=True)``). The gateway checks it: a call up to the branch call whose messages
(or prompt, or ``n``) differ from the parent's call at the same index is answered ``422`` with a JSON
error (``branch_replay_diverged``; every later call of that attempt too), so a program that is not deterministic fails its branch rollout
loudly instead of training on a prompt its parent never saw. A branch rollout whose parent has no call
at an index it asks to replay is answered the same way.

The parent's calls are read from the store once per branch rollout (its server ``chat`` spans of the
named attempt) and kept for the last ``max_rollouts`` branch rollouts.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from agl import semconv as sc
from agl.errors import ApiError
from agl.gateway.backends.base import Choice, GenerationRequest, GenerationResult, ToolCall
from agl.gateway.spans import _dumps

__all__ = ["BranchPlan", "Replays", "branch_of", "recorded_calls", "replayed_result"]

log = logging.getLogger("agl.gateway")


@dataclass(frozen=True)
class BranchPlan:
    """A branch rollout's parent calls (by index in the parent's attempt) and its branch call."""

    parent: str
    attempt: int
    call: int
    calls: dict[int, Any]  # call index -> the parent's server chat span


def branch_of(metadata: dict[str, Any]) -> tuple[str, int, int] | None:
    """``(parent rollout, parent attempt, branch call)`` from a rollout's metadata; None when it is no
    branch rollout (or the entry is malformed)."""
    raw = metadata.get(sc.ROLLOUT_BRANCH_KEY)
    if not isinstance(raw, dict):
        return None
    parent, attempt, call = raw.get("parent"), raw.get("attempt"), raw.get("call")
    if not isinstance(parent, str) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (attempt, call)
    ):
        return None
    return parent, int(attempt), int(call)  # type: ignore[arg-type]


def recorded_calls(store: Any, rollout_id: str, attempt: int) -> dict[int, Any]:
    """The server ``chat`` spans of one attempt, by call index (the first choice's span of each call;
    spans without a call index, from a gateway that did not number calls, are left out)."""
    calls: dict[int, Any] = {}
    for s in store.query_spans(rollout_id=rollout_id, attempt=attempt, name=sc.SPAN_CHAT):
        a = s.attributes
        index = a.get(sc.AGL_LLM_CALL_INDEX)
        if a.get(sc.AGL_SIDE) != sc.SIDE_SERVER or not isinstance(index, int) or isinstance(index, bool):
            continue
        if a.get(sc.AGL_LLM_CHOICE_INDEX, 0) != 0 or s.status.code == "ERROR":
            continue
        calls.setdefault(index, s)
    return calls


def replayed_result(span: Any) -> GenerationResult:
    """The parent's recorded response as a backend result: its text, tool calls, ids and log-probs."""
    a = span.attributes
    out = json.loads(a.get(sc.GEN_AI_OUTPUT_MESSAGES) or "[{}]")
    msg = out[0] if out and isinstance(out[0], dict) else {}
    calls = [
        ToolCall(name=tc["function"]["name"], arguments=tc["function"]["arguments"], id=tc["id"])
        for tc in msg.get("tool_calls") or []
    ]
    finish = a.get(sc.GEN_AI_RESPONSE_FINISH_REASONS) or ["stop"]
    ids = a.get(sc.AGL_LLM_RESPONSE_TOKEN_IDS)
    logprobs = a.get(sc.AGL_LLM_RESPONSE_LOGPROBS)
    content = msg.get("content")
    choice = Choice(
        text=content or "",
        content=content,
        tool_calls=calls,
        response_ids=list(ids) if ids is not None else None,
        logprobs=list(logprobs) if logprobs is not None else None,
        finish_reason=str(finish[0]),
    )
    prompt = a.get(sc.AGL_LLM_PROMPT_TOKEN_IDS)
    version = a.get(sc.AGL_LLM_WEIGHT_VERSION)
    return GenerationResult(
        model=str(a.get(sc.GEN_AI_RESPONSE_MODEL) or a.get(sc.GEN_AI_REQUEST_MODEL) or ""),
        choices=[choice],
        prompt_ids=list(prompt) if prompt is not None else None,
        prompt_tokens=a.get(sc.GEN_AI_USAGE_INPUT_TOKENS),
        weight_version=version if isinstance(version, int) else None,
        adapter=a.get(sc.AGL_LLM_ADAPTER),
        exact=bool(a.get(sc.AGL_LLM_EXACT, prompt is not None)),
        forced_tokens=int(a.get(sc.AGL_LLM_FORCED_TOKENS) or 0),
    )


def _diverged(index: int, plan: BranchPlan, what: str) -> ApiError:
    return ApiError(
        422,
        f"branch replay diverged at call {index} of the branch of rollout {plan.parent} (attempt "
        f"{plan.attempt}, branch call {plan.call}): {what}. Branching needs a rollout function that is "
        "deterministic given the LLM's responses (@agl.rollout(replayable=True)); this one is not",
        type="invalid_request_error",
        code="branch_replay_diverged",
    )


class Replays:
    """Replays the calls of branch rollouts before their branch call (see the module docstring)."""

    def __init__(self, store: Any, *, max_rollouts: int = 1024) -> None:
        self.store = store
        self.max_rollouts = max_rollouts
        self.in_loop = bool(getattr(store, "in_process", False))  # read on the event loop (no network wait)
        self._plans: OrderedDict[str, BranchPlan | None] = OrderedDict()
        #: branch attempts that diverged: every later call of theirs is refused too (a client that
        #: retries must not slip past the branch call, its retry numbered as the next call)
        self._diverged: OrderedDict[tuple[str, int], ApiError] = OrderedDict()
        #: calls answered from a parent's record, and branch calls sampled afresh
        self.replayed = 0
        self.branched = 0

    async def prepare(self, gen: GenerationRequest) -> None:
        """Mark ``gen`` (numbered by :class:`~agl.gateway.seeds.CallSeeds`) as replayed (``gen.replay``
        holds the parent's response) or as its rollout's branch call; raise a 422 ``ApiError`` when it
        differs from the parent's call at the same index."""
        if gen.rollout is None or self.store is None or gen.call_index is None:
            return
        if gen.rollout in self._diverged:
            raise self._diverged[gen.rollout]
        plan = await self._plan(gen.rollout[0])
        if plan is None or gen.call_index > plan.call:
            return
        try:
            span = self._check_same(gen.call_index, plan, gen)
        except ApiError as exc:
            self._diverged[gen.rollout] = exc
            while len(self._diverged) > self.max_rollouts:
                self._diverged.popitem(last=False)
            raise
        index = gen.call_index
        if index == plan.call:
            gen.branch_point = True
            self.branched += 1
            return
        gen.replay = replayed_result(span)
        self.replayed += 1

    @staticmethod
    def _check_same(index: int, plan: BranchPlan, gen: GenerationRequest) -> Any:
        """The parent's call ``index`` when ``gen`` asks what it asked; else the divergence error."""
        span = plan.calls.get(index)
        if span is None:
            raise _diverged(index, plan, f"the parent made no call {index} (it made {sorted(plan.calls)})")
        a = span.attributes
        if gen.n != 1:
            raise _diverged(index, plan, f"a branch call takes n=1, this one asks n={gen.n}")
        if gen.messages is not None and _dumps(gen.messages) != a.get(sc.GEN_AI_INPUT_MESSAGES):
            raise _diverged(index, plan, "the call's messages differ from the parent's")
        if gen.prompt is not None and gen.prompt != a.get(sc.AGL_LLM_PROMPT_TEXT):
            raise _diverged(index, plan, "the call's prompt differs from the parent's")
        if gen.tools and _dumps(gen.tools) != a.get(sc.GEN_AI_TOOL_DEFINITIONS):
            raise _diverged(index, plan, "the call's tools differ from the parent's")
        return span

    async def _plan(self, rollout_id: str) -> BranchPlan | None:
        if rollout_id in self._plans:
            self._plans.move_to_end(rollout_id)
            return self._plans[rollout_id]
        try:
            plan = self._read(rollout_id) if self.in_loop else await asyncio.to_thread(self._read, rollout_id)
        except Exception as exc:  # noqa: BLE001 - an unknown rollout is served live, as before
            log.debug("agl gateway: no branch plan for rollout %s: %s", rollout_id, exc)
            return None
        self._plans[rollout_id] = plan
        while len(self._plans) > self.max_rollouts:
            self._plans.popitem(last=False)
        return plan

    def _read(self, rollout_id: str) -> BranchPlan | None:
        branch = branch_of(self.store.get_rollout(rollout_id).metadata)
        if branch is None:
            return None
        parent, attempt, call = branch
        return BranchPlan(parent, attempt, call, recorded_calls(self.store, parent, attempt))
