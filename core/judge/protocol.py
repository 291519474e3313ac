"""What a judge is asked and how its answer is read: the prompts of the two modes, and a strict
parser that either returns one score per trajectory or says exactly what is wrong (the repair request
quotes it). A score is never invented: a missing, duplicated or out-of-range score is an error.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agl.errors import MalformedJudgeOutput

__all__ = [
    "MODES",
    "MalformedJudgeOutput",
    "Score",
    "absolute_messages",
    "parse_scores",
    "relative_messages",
    "repair_message",
]

MODES = ("relative", "absolute")

_SYSTEM = (
    "You are a strict, fair judge of AI agent trajectories. Score each trajectory from 0 (useless or wrong) "
    "to 1 (fully solves the task) according to the rubric. Judge what the agent achieved, not how long it "
    "wrote. Reply with JSON only, no prose, in exactly this form: "
    '{"scores": [{"id": "<trajectory id>", "score": <number 0..1>, "reason": "<one short sentence>"}]}'
)


@dataclass(frozen=True)
class Score:
    """One trajectory's verdict: ``score`` in [0, 1] and the judge's short reason."""

    score: float
    reason: str


def relative_messages(
    rubric: str, task: str, trajectories: Sequence[tuple[str, str]], reference: str | None = None
) -> list[dict[str, str]]:
    """One call over a group: the task (and its reference answer, if any) and every trajectory
    (``(label, text)``), compared together."""
    body = [f"Rubric:\n{rubric}", f"Task:\n{task}"]
    if reference is not None:
        body.append(f"Reference answer:\n{reference}")
    body.append(f"There are {len(trajectories)} trajectories for this task.")
    for label, text in trajectories:
        body.append(f"=== trajectory {label} ===\n{text}")
    body.append("Compare them with each other and score every one; use the whole range when they differ.")
    return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": "\n\n".join(body)}]


def absolute_messages(
    rubric: str, task: str, label: str, text: str, reference: str | None
) -> list[dict[str, str]]:
    """One call per trajectory against the rubric, with the task's reference answer when there is one."""
    body = [f"Rubric:\n{rubric}", f"Task:\n{task}"]
    if reference is not None:
        body.append(f"Reference answer:\n{reference}")
    body.append(f"=== trajectory {label} ===\n{text}")
    return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": "\n\n".join(body)}]


def repair_message(error: str) -> dict[str, str]:
    """The one follow-up a malformed reply gets: what was wrong, and the form again."""
    return {
        "role": "user",
        "content": f"Your reply could not be used: {error}. Reply again with JSON only, "
        'exactly {"scores": [{"id": ..., "score": ..., "reason": ...}]}, one entry per trajectory id.',
    }


def _json_object(text: str) -> Any:
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    if fenced:
        text = fenced.group(1)
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise MalformedJudgeOutput("no JSON object in the reply")
    try:
        return json.loads(text[start : end + 1])
    except ValueError as exc:
        raise MalformedJudgeOutput(f"invalid JSON ({exc})") from None


def _one(entry: Any, labels: set[str]) -> tuple[str, Score]:
    if not isinstance(entry, dict):
        raise MalformedJudgeOutput(f"a score entry is not an object: {entry!r:.80}")
    label, score = str(entry.get("id", "")), entry.get("score")
    if label not in labels:
        raise MalformedJudgeOutput(f"unknown trajectory id {label!r} (expected one of {sorted(labels)})")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise MalformedJudgeOutput(f"the score of {label!r} is not a number: {score!r:.40}")
    if not 0.0 <= score <= 1.0:
        raise MalformedJudgeOutput(f"the score of {label!r} is {score}, outside 0..1")
    return label, Score(float(score), str(entry.get("reason", ""))[:500])


def parse_scores(text: str, labels: Sequence[str]) -> dict[str, Score]:
    """``label -> Score`` for exactly ``labels``, or :class:`MalformedJudgeOutput` saying why not."""
    obj = _json_object(text or "")
    entries = obj.get("scores") if isinstance(obj, dict) else None
    if not isinstance(entries, list):
        raise MalformedJudgeOutput('no "scores" list in the reply')
    wanted, out = set(labels), {}
    for entry in entries:
        label, score = _one(entry, wanted)
        if label in out:
            raise MalformedJudgeOutput(f"trajectory {label!r} is scored twice")
        out[label] = score
    missing = [lbl for lbl in labels if lbl not in out]
    if missing:
        raise MalformedJudgeOutput(f"no score for trajectory {', '.join(missing)}")
    return out
