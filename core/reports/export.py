"""Exports of what the adapter would train on (the library under ``agl export``; the commands
``agl export`` and ``agl transitions`` live in :mod:`agl.cli.export`).

``agl export --store URL --format transitions|sft|dpo --out FILE.jsonl`` writes one JSON object per
line (definitions in docs/architecture.md §8):

- ``transitions``: every transition (``agl.types.Transition`` fields) plus its ``advantage`` under
  the default LightningRL settings (or ``--credit``/``--gamma``/``--advantage-level``). With
  ``--form trajectories`` the same calls are written merged, one record per agent conversation
  (``agl.adapter.trajectories.Trajectory`` fields: ``prompt_ids``, ``completion_ids``, ``loss_mask`` 1 on the
  model's tokens, per-token ``logprobs``, and ``segments`` — each call's ``start``/``end`` in
  ``completion_ids``, span id, rewards and ``break_cause``) plus ``advantages``, one per segment: what
  the update trains on by default;
- ``sft``: one chat per LLM call of the selected agents, from rollouts whose final reward is at
  least ``--min-reward``: ``{"messages": [...prompt, assistant], "tools": [...]}`` in TRL's
  conversational SFT format. The assistant turn is the message the gateway returned to the agent —
  a tool call is in ``tool_calls`` (OpenAI format), never JSON text in ``content`` — and ``tools`` is
  the schema the model was offered (from the span's ``gen_ai.tool.definitions``). Each record also
  holds ``prompt_ids``/``response_ids``: the tokens exactly as the gateway rendered the conversation
  for the model (``agl sft`` trains on these, loss on the response only), plus provenance;
- ``dpo``: for every group, the best rollout against the worst one (by final reward, ties skipped):
  ``{"prompt": messages, "chosen": [assistant], "rejected": [assistant]}`` from the first transition
  of the selected agents in each (TRL's conversational preference format); pairs whose prompts
  differ are skipped.

``agl transitions ROLLOUT_ID --store URL`` prints, per transition, the agent, the prompt tail and the
response (decoded with ``--tokenizer`` if given), token counts, exactness and the rewards.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl.adapter import Adapter, finishing_attempt
from agl.adapter.trajectories import MergeStats, merge_transitions
from agl.algorithms.lightning_rl import LightningRL, compute_advantages
from agl.chat.tokenizer import load_tokenizer  # re-exported: agl.reports.export.load_tokenizer
from agl.errors import UsageError
from agl.types import Transition

__all__ = [
    "CallRecord",
    "ExportResult",
    "call_records",
    "check_format",
    "dpo_records",
    "export",
    "load_tokenizer",
    "sft_records",
    "trajectory_records",
    "transition_records",
]

FORMATS = ("transitions", "sft", "dpo")
#: the two forms of ``--format transitions``: one record per LLM call, or per merged agent conversation
FORMS = ("transitions", "trajectories")


@dataclass
class ExportResult:
    records: int = 0
    rollouts: int = 0
    transitions: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    #: what merging did (``form="trajectories"`` only)
    merge: MergeStats | None = None

    def skip(self, why: str, n: int = 1) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + n


# ------------------------------------------------------------------------------------ records


def _by_rollout(transitions: Iterable[Transition]) -> dict[tuple[str, int], list[Transition]]:
    out: dict[tuple[str, int], list[Transition]] = {}
    for t in transitions:
        out.setdefault((t.rollout_id, t.attempt), []).append(t)
    for ts in out.values():
        ts.sort(key=lambda t: t.index)
    return out


def transition_records(
    transitions: Sequence[Transition],
    cfg: LightningRL | None = None,
    *,
    min_reward: float | None = None,
    result: ExportResult | None = None,
) -> list[dict[str, Any]]:
    """Transitions as JSON objects with their advantage (computed over all given transitions' groups,
    before the ``min_reward`` filter, so filtering never changes an advantage)."""
    advantages, _ = compute_advantages(transitions, cfg)
    out = []
    for t, adv in zip(transitions, advantages, strict=True):
        if min_reward is not None and t.final_reward < min_reward:
            if result is not None:
                result.skip("below_min_reward")
            continue
        rec = t.model_dump(mode="json")
        rec["advantage"] = adv
        out.append(rec)
    return out


def trajectory_records(
    transitions: Sequence[Transition],
    cfg: LightningRL | None = None,
    *,
    min_reward: float | None = None,
    result: ExportResult | None = None,
) -> list[dict[str, Any]]:
    """The transitions merged per agent conversation (:func:`agl.adapter.trajectories.merge_transitions`, one
    attempt at a time), as JSON objects with ``advantages``: one per segment, computed over all given
    transitions as :func:`transition_records` does. A segment's ``transition`` is the call's
    ``Transition.index`` in its attempt. Without ``advantages`` a record validates as a
    :class:`~agl.adapter.trajectories.Trajectory`."""
    advantages, _ = compute_advantages(transitions, cfg)
    adv_of = {id(t): a for t, a in zip(transitions, advantages, strict=True)}
    stats = MergeStats()
    out = []
    for ts in _by_rollout(transitions).values():
        trajs, _ = merge_transitions(ts, stats)
        if min_reward is not None and ts[0].final_reward < min_reward:
            if result is not None:
                result.skip("below_min_reward", len(trajs))
            continue
        for tr in trajs:
            rec = tr.model_dump(mode="json")
            for seg in rec["segments"]:
                seg["transition"] = ts[seg["transition"]].index
            rec["advantages"] = [adv_of[id(ts[seg.transition])] for seg in tr.segments]
            out.append(rec)
    if result is not None:
        result.merge = stats
    return out


@dataclass(frozen=True)
class CallRecord:
    """What the gateway recorded about one LLM call beyond the transition: the assistant message it
    returned (content and/or ``tool_calls``) and the tool schema offered to the model."""

    message: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


def _json_attr(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


def call_records(store: Any, transitions: Sequence[Transition]) -> dict[str, CallRecord]:
    """``span_id -> CallRecord`` for the transitions' LLM calls, read from their spans in ``store``."""
    from agl import semconv as sc

    wanted: dict[tuple[str, int], set[str]] = {}
    for t in transitions:
        if t.span_id:
            wanted.setdefault((t.rollout_id, t.attempt), set()).add(t.span_id)
    out: dict[str, CallRecord] = {}
    for (rid, attempt), ids in wanted.items():
        for span in store.query_spans(rollout_id=rid, attempt=attempt):
            if span.span_id not in ids:
                continue
            a = span.attributes
            msgs = _json_attr(a.get(sc.GEN_AI_OUTPUT_MESSAGES))
            if isinstance(msgs, dict):
                msgs = [msgs]
            choice = a.get(sc.AGL_LLM_CHOICE_INDEX, 0)
            msg = None
            if isinstance(msgs, list) and msgs:
                pick = msgs[choice] if isinstance(choice, int) and 0 <= choice < len(msgs) else msgs[0]
                msg = pick if isinstance(pick, dict) else None
            tools = _json_attr(a.get(sc.GEN_AI_TOOL_DEFINITIONS))
            out[span.span_id] = CallRecord(
                message=msg,
                tools=[x for x in tools if isinstance(x, dict)] if isinstance(tools, list) else None,
            )
    return out


def _tool_calls(raw: Any) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` (``{"id", "type": "function", "function": {"name", "arguments"}}``, the
    arguments a JSON string) from a recorded message's tool calls."""
    out = []
    for tc in raw if isinstance(raw, list) else []:
        if not isinstance(tc, dict):
            continue
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else tc
        name = fn.get("name")
        if not isinstance(name, str):
            continue
        args = fn.get("arguments", {})
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
        if isinstance(tc.get("id"), str):
            call = {"id": tc["id"], **call}
        out.append(call)
    return out


def _assistant(t: Transition, call: CallRecord | None = None) -> dict[str, Any]:
    """The assistant turn as the agent received it: text in ``content``, tool calls in ``tool_calls``."""
    msg = call.message if call is not None else None
    if msg is not None:
        calls = _tool_calls(msg.get("tool_calls"))
        content = msg.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        if calls:
            return {"role": "assistant", "content": content or None, "tool_calls": calls}
        if isinstance(content, str):
            return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": t.response_text if t.response_text is not None else ""}


def sft_records(
    transitions: Sequence[Transition],
    *,
    min_reward: float | None = None,
    result: ExportResult | None = None,
    calls: dict[str, CallRecord] | None = None,
) -> list[dict[str, Any]]:
    """One conversational SFT example per transition of the rollouts with final reward >= min_reward.

    ``calls`` (from :func:`call_records`) supplies each call's assistant message and tool schema;
    without it the assistant turn is the transition's response text and no ``tools`` are written."""
    calls = calls or {}
    out = []
    for ts in _by_rollout(transitions).values():
        if min_reward is not None and ts[0].final_reward < min_reward:
            if result is not None:
                result.skip("below_min_reward", len(ts))
            continue
        for t in ts:
            if not t.messages or t.response_text is None:
                if result is not None:
                    result.skip("no_messages")
                continue
            call = calls.get(t.span_id or "")
            rec: dict[str, Any] = {"messages": [*t.messages, _assistant(t, call)]}
            if call is not None and call.tools:
                rec["tools"] = call.tools
            out.append(
                {
                    **rec,
                    "prompt_ids": list(t.prompt_ids),
                    "response_ids": list(t.response_ids),
                    "rollout_id": t.rollout_id,
                    "attempt": t.attempt,
                    "agent": t.agent,
                    "index": t.index,
                    "final_reward": t.final_reward,
                }
            )
    return out


def dpo_records(
    transitions: Sequence[Transition],
    *,
    min_reward: float | None = None,
    result: ExportResult | None = None,
    calls: dict[str, CallRecord] | None = None,
) -> list[dict[str, Any]]:
    """Per group: the best rollout's first transition (chosen) against the worst one's (rejected).

    Best/worst by final reward; on ties the earlier rollout (in input order) is taken. Groups with one
    rollout, no reward spread, a best rollout below ``min_reward``, or different first prompts are
    skipped (and counted in ``result``).
    """
    res = result if result is not None else ExportResult()
    calls = calls or {}
    groups: dict[str, list[list[Transition]]] = {}
    for ts in _by_rollout(transitions).values():
        gid = ts[0].group_id
        if gid is None:
            res.skip("no_group")
            continue
        groups.setdefault(gid, []).append(ts)
    out = []
    for gid, rollouts in groups.items():
        if len(rollouts) < 2:
            res.skip("single_rollout_group")
            continue
        best = max(rollouts, key=lambda ts: ts[0].final_reward)
        worst = min(rollouts, key=lambda ts: ts[0].final_reward)
        if best[0].final_reward == worst[0].final_reward:
            res.skip("no_reward_spread")
            continue
        if min_reward is not None and best[0].final_reward < min_reward:
            res.skip("below_min_reward")
            continue
        chosen, rejected = best[0], worst[0]
        if not chosen.messages or list(chosen.messages) != list(rejected.messages):
            res.skip("prompt_mismatch")
            continue
        rec: dict[str, Any] = {}
        tools = getattr(calls.get(chosen.span_id or ""), "tools", None)
        if tools:
            rec["tools"] = tools
        out.append(
            {
                "prompt": list(chosen.messages),
                "chosen": [_assistant(chosen, calls.get(chosen.span_id or ""))],
                "rejected": [_assistant(rejected, calls.get(rejected.span_id or ""))],
                **rec,
                "group_id": gid,
                "agent": chosen.agent,
                "chosen_rollout_id": chosen.rollout_id,
                "rejected_rollout_id": rejected.rollout_id,
                "chosen_reward": chosen.final_reward,
                "rejected_reward": rejected.final_reward,
            }
        )
    return out


def _write_jsonl(records: Iterable[dict[str, Any]], out: str) -> None:
    """All or nothing: records go to a temporary file that replaces ``out`` only when complete."""
    if out == "-":
        for rec in records:
            sys.stdout.write(json.dumps(rec, ensure_ascii=False) + "\n")
        return
    directory = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"output directory {directory} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=".agl-export-", suffix=".jsonl", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise


def export(
    store: Any,
    fmt: str,
    out: str,
    *,
    adapter: Adapter | None = None,
    rollout_ids: Sequence[str] | None = None,
    mode: str | None = None,
    min_reward: float | None = None,
    algorithm: LightningRL | None = None,
    progress: bool = False,
    form: str = "transitions",
) -> ExportResult:
    """Export the finished rollouts of ``store`` (or the given ones) as JSONL in ``fmt``; ``form``
    (``transitions`` or ``trajectories``) picks per-call or merged records for ``fmt="transitions"``."""
    check_format(fmt, form)
    adapter = adapter or Adapter(algorithm=algorithm)
    if rollout_ids is None:
        rollouts = store.query_rollouts(status=["succeeded", "failed"], mode=mode)
        ids = [r.id for r in rollouts if finishing_attempt(r) is not None]
    else:
        ids = list(rollout_ids)
    transitions = adapter.from_store(store, ids, progress=progress)
    result = ExportResult(rollouts=len(ids), transitions=len(transitions))
    if fmt == "transitions" and form == "trajectories":
        records = trajectory_records(transitions, algorithm, min_reward=min_reward, result=result)
    elif fmt == "transitions":
        records = transition_records(transitions, algorithm, min_reward=min_reward, result=result)
    elif fmt == "sft":
        records = sft_records(
            transitions, min_reward=min_reward, result=result, calls=call_records(store, transitions)
        )
    else:
        records = dpo_records(
            transitions, min_reward=min_reward, result=result, calls=call_records(store, transitions)
        )
    _write_jsonl(records, out)
    result.records = len(records)
    return result


def check_format(fmt: str, form: str) -> None:
    """One clear error for a format or form that does not exist or a form the format has not."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    if form not in FORMS:
        raise UsageError(f"unknown export form {form!r}; use one of {', '.join(FORMS)}")
    if form == "trajectories" and fmt != "transitions":
        raise UsageError(
            f"--form trajectories applies to --format transitions only ({fmt} records are one per LLM call)"
        )
