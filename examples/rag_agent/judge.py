"""Stand-in judges for measuring the judge path on this CPU, where no capable judge model runs.

Both are agl's scripted backend answering the judge's real requests through the judge's own gateway
(every call recorded in the run's judge store), so the whole path — rendering from spans, the
prompt, parsing, caching, reward assembly — is the one a hosted judge goes through; only the model
is replaced by a function of what the judge was shown:

- ``noisy_f1_judge(sigma, seed)``: relative mode; each trajectory's score is the task reward (answer
  F1 with the format bonus, :func:`examples.rag_agent.reward.reward`) of the answer in its last
  assistant message plus Gaussian noise of standard deviation ``sigma``, clipped to [0, 1]. The noise
  is seeded by ``seed`` and the trajectory's text, so a re-run gives the same scores;
- ``rubric_judge()``: absolute mode against the rubric :data:`RUBRIC` with the task's gold answer as
  reference; it scores 1 / 0.5 / 0 as the rubric says (F1 ≥ 0.8 / > 0 / 0), i.e. a judge that follows
  a coarse rubric exactly.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

__all__ = ["RUBRIC", "noisy_f1_judge", "rubric_judge"]

RUBRIC = (
    "Score 1 when the final <answer> names the reference answer, 0.5 when it is partly right (some of "
    "the reference's words), 0 otherwise. Searching is expected; the answer must be inside <answer> tags."
)

_BLOCK = re.compile(r"=== trajectory (t\d+) ===\n(.*?)(?=\n\n=== trajectory |\n\nCompare |\Z)", re.S)
_REFERENCE = re.compile(r"Reference answer:\n(.*?)\n\n", re.S)


def _final_output(text: str) -> str:
    """The last assistant message of a rendered trajectory."""
    parts = re.split(r"^assistant: ", text, flags=re.M)
    return parts[-1] if len(parts) > 1 else ""


def _reply(scores: list[tuple[str, float]]) -> str:
    import json

    return json.dumps(
        {"scores": [{"id": lbl, "score": round(s, 4), "reason": "stand-in"} for lbl, s in scores]}
    )


class _NoisyF1:
    def __init__(self, sigma: float, seed: int) -> None:
        self.sigma, self.seed = sigma, seed

    def __call__(self, request: Any) -> str:
        from examples.rag_agent.reward import reward

        prompt = request.messages[1]["content"]
        gold = _REFERENCE.search(prompt).group(1).strip()
        scores = []
        for label, text in _BLOCK.findall(prompt):
            digest = hashlib.sha256(f"{self.seed}:{text}".encode()).hexdigest()
            noise = random.Random(digest).gauss(0.0, self.sigma) if self.sigma else 0.0
            scores.append((label, min(1.0, max(0.0, reward(_final_output(text), gold) + noise))))
        return _reply(scores)


def _rubric(request: Any) -> str:
    from examples.rag_agent.reward import answer_f1, extract_answer

    prompt = request.messages[1]["content"]
    gold = _REFERENCE.search(prompt).group(1).strip()
    scores = []
    for label, text in _BLOCK.findall(prompt):
        f1 = answer_f1(extract_answer(_final_output(text)), gold)
        scores.append((label, 1.0 if f1 >= 0.8 else 0.5 if f1 > 0 else 0.0))
    return _reply(scores)


def _judge(script: Any, mode: str, model: str, rubric: str) -> Any:
    import agl
    from agl.gateway.testing import ScriptedBackend

    backend = ScriptedBackend(script, accept_any_model=True, on_exhausted="repeat")
    return agl.Judge(backend=backend, model=model, rubric=rubric, mode=mode, reference="answer")


def noisy_f1_judge(sigma: float, seed: int = 0) -> Any:
    """The relative stand-in: F1 + N(0, sigma²) noise, seeded."""
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    return _judge(_NoisyF1(sigma, seed), "relative", f"stand-in-f1-noise-{sigma}-seed-{seed}", RUBRIC)


def rubric_judge() -> Any:
    """The absolute stand-in: the coarse rubric applied exactly against the gold answer."""
    return _judge(_rubric, "absolute", "stand-in-rubric", RUBRIC)
