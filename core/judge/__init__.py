"""``agl.judge``: rewards from an LLM judge (:class:`Judge`), for agents with no programmatic reward.

- :mod:`agl.judge.judge` — :class:`Judge` (relative / absolute), :class:`JudgeReport`;
- :mod:`agl.judge.render` — a rollout rendered as text from its spans;
- :mod:`agl.judge.protocol` — the prompts and the strict parser of the judge's JSON;
- :mod:`agl.judge.cache` — verdicts cached by task, trajectory content, rubric and judge model;
- :mod:`agl.judge.record` — the judge's gateway and its calls recorded as rollouts in a judge store;
- :mod:`agl.trainer.rewarding` — the trainer's reward assembly (``reward="judge"|"task"|{...}``).
"""

from __future__ import annotations

from agl.judge.judge import DEFAULT_RUBRIC, Judge, JudgeReport
from agl.judge.record import JudgeUnavailable

__all__ = ["DEFAULT_RUBRIC", "Judge", "JudgeReport", "JudgeUnavailable"]
