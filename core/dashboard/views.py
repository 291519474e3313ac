"""What each dashboard page shows, as JSON-ready dicts built from store records (no HTTP here).

The span tree is laid out on the server (depth-first order, depth, offsets on the attempt's time
axis), so the browser only draws rows; heavy attributes (token ids, messages) are sent only for the
span a user clicks. Transitions come from :class:`agl.adapter.Adapter` — the same code the trainer
runs — so the page shows exactly what would be trained on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agl import semconv as sc
from agl.reports.inspect import (  # the CLI's span tags and one-line details, shared on purpose
    span_details,
    span_tag,
)
from agl.types import Rollout, Span

__all__ = [
    "KEY_METRICS",
    "read_run",
    "rollout_view",
    "span_detail",
    "span_tree",
    "trajectories_view",
    "transitions_view",
]

#: metrics.jsonl keys shown in the Runs page's table (label, key), in order
KEY_METRICS: tuple[tuple[str, str], ...] = (
    ("train reward", "train_reward"),
    ("held-out reward", "val_reward"),
    ("exact-token ratio", "exact_token_ratio"),
    ("behaviour ratio dev", "behaviour_ratio_dev"),
    ("zero-variance groups", "zero_variance_groups"),
    ("groups", "groups"),
    ("AIR share", "air_share"),
    ("KL", "kl"),
    ("tokens/s", "tokens_per_s"),
    ("loss", "loss"),
    ("rollouts failed", "rollouts_failed"),
    ("step time (s)", "step_s"),
    # LLM judge and reward-hacking monitors (agl.judge, agl.trainer.monitors)
    ("judge reward", "judge_reward"),
    ("task reward (before the judge)", "train_task_reward"),
    ("task-judge divergence", "monitor_divergence"),
    ("identical answers across tasks", "monitor_identical_answers"),
    ("response-length drift", "monitor_length_drift"),
    ("tool-call rate drift", "monitor_tool_rate_drift"),
    ("held-out change since last check", "monitor_val_delta"),
    ("judge calls", "judge_calls"),
    ("judge tokens (prompt)", "judge_prompt_tokens"),
    ("judge time (s)", "judge_s"),
    ("judge groups skipped", "judge_groups_skipped"),
)


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


# ------------------------------------------------------------------------------------------ runs


def read_run(run_dir: str | Path) -> dict[str, Any]:
    """A trainer run directory's ``metrics.jsonl``: the per-step records, skipping unreadable lines
    (a run still writing may end with a partial line) and saying how many were skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return {"run_dir": str(run_dir), "error": f"{path} does not exist", "records": []}
    records: list[dict[str, Any]] = []
    warnings: list[dict[str, Any]] = []
    skipped = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                skipped += 1
                continue
            if isinstance(rec, dict) and _number(rec.get("step")) is not None:
                records.append({k: v for k, v in rec.items() if _number(v) is not None or v is None})
                warnings += _monitor_warnings(rec.get("monitor_warnings"))
            else:
                skipped += 1
    return {
        "run_dir": str(run_dir),
        "records": records,
        "warnings": warnings,
        "skipped_lines": skipped,
        "error": None,
    }


def _monitor_warnings(raw: Any) -> list[dict[str, Any]]:
    """A record's reward-hacking warnings (:mod:`agl.trainer.monitors`), kept only in the shape they are written."""
    out = []
    for w in raw if isinstance(raw, list) else ():
        if isinstance(w, dict) and isinstance(w.get("monitor"), str) and _number(w.get("step")) is not None:
            rollouts = [str(r) for r in w.get("rollouts") or () if isinstance(r, str)][:20]
            out.append(
                {
                    "monitor": w["monitor"],
                    "step": int(w["step"]),
                    "message": str(w.get("message", "")),
                    "rollouts": rollouts,
                }
            )
    return out


# -------------------------------------------------------------------------------------- rollouts


def rollout_view(
    r: Rollout,
    span_counts: dict[int, int],
    now: float,
    kind: str | None = None,
    attempt_kinds: dict[int, str | None] | None = None,
) -> dict[str, Any]:
    """A rollout with its attempts (worker, timing, error and traceback, stale marker, each one's
    ``failure_kind`` from ``attempt_kinds``: :func:`agl.adapter.failures.attempt_kind`) and its own
    failure ``kind`` (:func:`agl.adapter.failures.failure_kind`; None while it runs)."""
    from agl.adapter import finishing_attempt

    data = r.model_dump(mode="json")
    fin = finishing_attempt(r)
    for a in data["attempts"]:
        end = a["ended_at"] if a["ended_at"] is not None else now
        a["duration_s"] = max(0.0, end - a["started_at"])
        a["stale"] = a["status"] in ("lost", "timed_out")
        a["spans"] = span_counts.get(a["number"], 0)
        a["finishing"] = a["number"] == fin
        a["failure_kind"] = (attempt_kinds or {}).get(a["number"])
    data["finishing_attempt"] = fin
    data["failure_kind"] = kind
    return data


# ----------------------------------------------------------------------------------------- spans


def _order(spans: Sequence[Span]) -> list[tuple[int, int]]:
    """(index, depth) in depth-first order, children by start time; parent cycles cannot loop it."""
    by_id: dict[str, int] = {}
    for i, s in enumerate(spans):
        by_id.setdefault(s.span_id, i)
    children: dict[int, list[int]] = {}
    for i, s in enumerate(spans):
        p = by_id.get(s.parent_id, -1) if s.parent_id is not None else -1
        if p == i:
            p = -1
        children.setdefault(p, []).append(i)
    for kids in children.values():
        kids.sort(key=lambda i: (spans[i].start_ns, spans[i].seq or 0))
    out: list[tuple[int, int]] = []
    seen = bytearray(len(spans))

    def walk(root: int) -> None:
        stack = [(root, 0)]
        while stack:
            i, d = stack.pop()
            if seen[i]:
                continue
            seen[i] = 1
            out.append((i, d))
            for k in reversed(children.get(i, ())):
                stack.append((k, d + 1))

    for root in children.get(-1, ()):
        walk(root)
    for i in range(len(spans)):  # only reachable through a parent cycle
        if not seen[i]:
            walk(i)
    return out


def _label(s: Span, tag: str) -> str:
    a = s.attributes
    if tag == "agent":
        name = a.get(sc.GEN_AI_AGENT_NAME)
        return f"{s.name} {name}" if isinstance(name, str) and name and name not in s.name else s.name
    if tag == "tool":
        name = a.get(sc.GEN_AI_TOOL_NAME)
        return f"{s.name} {name}" if isinstance(name, str) and name and name not in s.name else s.name
    return s.name


def span_tree(spans: Sequence[Span]) -> dict[str, Any]:
    """Rows of the tree and timeline: depth-first, with tag, label, details and time offsets (ms)."""
    if not spans:
        return {"rows": [], "start_ns": 0, "duration_ms": 0.0, "count": 0, "errors": 0, "stale": 0}
    t0 = min(s.start_ns for s in spans)
    t1 = max(s.end_ns for s in spans)
    rows = []
    errors = stale = 0
    for i, depth in _order(spans):
        s = spans[i]
        tag = span_tag(s)
        err = s.status.code == "ERROR"
        errors += err
        stale += s.stale
        rows.append(
            {
                "i": i,
                "span_id": s.span_id,
                "parent_id": s.parent_id,
                "depth": depth,
                "name": s.name,
                "label": _label(s, tag),
                "tag": tag,
                "details": span_details(s)[:300],
                "start_ms": (s.start_ns - t0) / 1e6,
                "duration_ms": s.duration_ns / 1e6,
                "status": s.status.code,
                "status_message": s.status.message,
                "stale": s.stale,
                "seq": s.seq,
            }
        )
    return {
        "rows": rows,
        "start_ns": t0,
        "duration_ms": (t1 - t0) / 1e6,
        "count": len(spans),
        "errors": errors,
        "stale": stale,
    }


def span_detail(s: Span) -> dict[str, Any]:
    """Everything about one span: attributes (JSON strings parsed for display), events, resource."""
    data = s.model_dump(mode="json")
    data["tag"] = span_tag(s)
    parsed = {}
    for key in (sc.GEN_AI_INPUT_MESSAGES, sc.GEN_AI_OUTPUT_MESSAGES, sc.GEN_AI_TOOL_DEFINITIONS):
        raw = s.attributes.get(key)
        if isinstance(raw, str):
            try:
                parsed[key] = json.loads(raw)
            except ValueError:
                pass
    data["parsed"] = parsed
    return data


# ----------------------------------------------------------------------------------- transitions


def _pieces(tok: Any, ids: Sequence[int], cap: int) -> list[str] | None:
    """The text of each token (None without a tokenizer); the last ``cap`` tokens at most."""
    if tok is None:
        return None
    ids = list(ids[-cap:])
    try:
        return [str(tok.decode([i])) for i in ids]
    except Exception:  # noqa: BLE001 - an id outside the vocabulary: show ids instead
        return None


def transitions_view(
    transitions: Sequence[Any],
    no_air: Sequence[Any],
    advantages: dict[tuple[str, int], float],
    stats: dict[str, Any],
    tokenizer: Any,
    *,
    token_cap: int = 4096,
) -> dict[str, Any]:
    """Each transition: its prompt (masked context) and response (trained) tokens, and its rewards.

    ``no_air`` are the same transitions adapted with AIR off: the difference of intermediate rewards
    is the AIR part, the rest is what the agent emitted itself.
    """
    base = {(t.span_id, t.index): t for t in no_air}
    base_by_span = {t.span_id: t for t in no_air}
    out = []
    for t in transitions:
        plain = base.get((t.span_id, t.index)) or base_by_span.get(t.span_id)
        emitted = plain.intermediate_reward if plain is not None else 0.0
        prompt = list(t.prompt_ids)
        response = list(t.response_ids)
        out.append(
            {
                "index": t.index,
                "agent": t.agent,
                "span_id": t.span_id,
                "model": t.model,
                "exact": t.exact,
                "weight_version": t.weight_version,
                "prompt_len": len(prompt),
                "response_len": len(response),
                "prompt_ids": prompt[-token_cap:],
                "response_ids": response[:token_cap],
                "prompt_truncated": max(0, len(prompt) - token_cap),
                "response_truncated": max(0, len(response) - token_cap),
                "prompt_pieces": _pieces(tokenizer, prompt, token_cap),
                "response_pieces": _pieces(tokenizer, response[:token_cap], token_cap),
                "messages": list(t.messages),
                "response_text": t.response_text,
                "final_reward": t.final_reward,
                "intermediate_reward": t.intermediate_reward,
                "emitted_reward": emitted,
                "air_reward": t.intermediate_reward - emitted,
                "return": t.reward,
                "advantage": advantages.get((t.rollout_id, t.index)),
                "has_logprobs": t.response_logprobs is not None,
            }
        )
    return {"transitions": out, "stats": stats, "tokenizer": tokenizer is not None}


def trajectories_view(
    transitions: Sequence[Any],
    advantages: dict[tuple[str, int], float],
    tokenizer: Any,
    *,
    token_cap: int = 8192,
) -> dict[str, Any]:
    """The same calls merged per agent conversation (``agl.adapter.trajectories``): one sequence each, its loss
    mask (1 on the model's own response tokens, 0 on context in between) and its segments."""
    from agl.adapter.trajectories import merge_transitions

    trajs, stats = merge_transitions(list(transitions))
    out = []
    for tr in trajs:
        completion = list(tr.completion_ids[:token_cap])
        segments = []
        for seg in tr.segments:
            t = transitions[seg.transition]
            segments.append(
                {
                    "index": t.index,
                    "span_id": seg.span_id,
                    "start": seg.start,
                    "end": seg.end,
                    "exact": t.exact,
                    "final_reward": seg.final_reward,
                    "intermediate_reward": seg.intermediate_reward,
                    "return": seg.reward,
                    "advantage": advantages.get((t.rollout_id, t.index)),
                }
            )
        out.append(
            {
                "agent": tr.agent,
                "exact": tr.exact,
                "prompt_ids": list(tr.prompt_ids[-token_cap:]),
                "prompt_truncated": max(0, len(tr.prompt_ids) - token_cap),
                "prompt_pieces": _pieces(tokenizer, tr.prompt_ids, token_cap),
                "completion_ids": completion,
                "completion_pieces": _pieces(tokenizer, completion, token_cap),
                "completion_truncated": max(0, len(tr.completion_ids) - token_cap),
                "loss_mask": list(tr.loss_mask[:token_cap]),
                "tokens": tr.tokens,
                "trained_tokens": tr.response_tokens,
                "segments": segments,
            }
        )
    return {"trajectories": out, "merge_stats": stats.as_dict()}
