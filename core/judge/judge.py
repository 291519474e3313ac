"""``agl.Judge``: rewards from an LLM judge for agents without a grader.

``mode="relative"`` (RULER-style) makes one call per group: the judge sees the task and every
trajectory of the group, rendered from their spans, and scores each against the others — relative
scores are what a group-relative advantage needs. ``mode="absolute"`` makes one call per rollout
against the rubric, with a reference answer from the task when ``reference`` names one.

A reply that is not the JSON asked for gets one repair request; if that fails too, the group is
skipped (its rollouts get no judge score, and the skip is counted) — a made-up score would be
trained on. A judge endpoint that keeps failing raises :class:`JudgeUnavailable` after retries with
backoff. Verdicts are cached (:mod:`agl.judge.cache`) and every call is recorded in the judge store
(:mod:`agl.judge.record`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import agl.judge.protocol as protocol
from agl.errors import UsageError
from agl.judge.cache import JudgeCache, cache_key
from agl.judge.protocol import MODES, MalformedJudgeOutput
from agl.judge.record import JudgeRecorder
from agl.judge.render import render_spans, render_task

__all__ = ["DEFAULT_RUBRIC", "Judge", "JudgeReport"]

DEFAULT_RUBRIC = (
    "A trajectory scores high when its final answer correctly and completely solves the task; tool errors "
    "that were recovered from cost little, wrong or missing answers cost everything."
)


@dataclass
class JudgeReport:
    """What one :meth:`Judge.score` produced: a score, a reason and the judge rollout per judged rollout,
    the groups skipped (malformed twice) and the cost (calls, tokens, seconds, cache hits)."""

    scores: dict[str, float] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    judge_rollouts: dict[str, str] = field(default_factory=dict)
    groups: int = 0
    groups_skipped: int = 0
    skipped_rollouts: list[str] = field(default_factory=list)
    calls: int = 0
    repairs: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cache_hits: int = 0
    seconds: float = 0.0

    def metrics(self) -> dict[str, Any]:
        """The report as a step's ``judge_*`` metrics."""
        return {
            "judge_groups": self.groups,
            "judge_groups_skipped": self.groups_skipped,
            "judge_calls": self.calls,
            "judge_repairs": self.repairs,
            "judge_prompt_tokens": self.prompt_tokens,
            "judge_completion_tokens": self.completion_tokens,
            "judge_cache_hits": self.cache_hits,
            "judge_s": self.seconds,
        }


class Judge:
    """An LLM judge over an OpenAI-compatible endpoint (``base_url``/``model``/``api_key``) or a given
    gateway ``backend`` (e.g. a scripted one). ``store``: where judge calls are recorded (a Store or a
    URL; default ``<run_dir>/judge.db`` once :meth:`open` is given a run directory). ``reference``: a
    key of the task's input dict (kept out of the task text), or ``input -> str``, giving a reference
    answer shown to the judge in either mode.
    ``token_budget``: per trajectory, content beyond it is clipped."""

    def __init__(
        self,
        base_url: str | None = None,
        model: str = "judge",
        rubric: str = DEFAULT_RUBRIC,
        mode: str = "relative",
        reference: str | Callable[[Any], str | None] | None = None,
        *,
        api_key: str | None = None,
        backend: Any = None,
        store: Any = None,
        cache: bool | str | Path = True,
        token_budget: int = 1500,
        retries: int = 3,
        backoff_s: float = 1.0,
        timeout_s: float = 120.0,
    ) -> None:
        if mode not in MODES:
            raise UsageError(f"Judge mode must be one of {', '.join(MODES)}, got {mode!r}")
        if (base_url is None) == (backend is None):
            raise UsageError("Judge needs exactly one of base_url (an OpenAI-compatible endpoint) or backend")
        if not isinstance(rubric, str) or not rubric.strip():
            raise UsageError("Judge rubric must be a non-empty string")
        if not isinstance(model, str) or not model:
            raise UsageError("Judge model must be a non-empty string")
        if reference is not None and not (isinstance(reference, str) or callable(reference)):
            raise UsageError("Judge reference must be a task input key or a function of the task input")
        for name, value in (("token_budget", token_budget), ("retries", retries)):
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (1 if name == "token_budget" else 0)
            ):
                raise UsageError(f"Judge {name} must be a positive integer, got {value!r}")
        self.base_url, self.model, self.rubric, self.mode = base_url, model, rubric, mode
        self.reference, self.api_key, self.backend_arg = reference, api_key, backend
        self.store_arg, self.cache_arg, self.token_budget = store, cache, token_budget
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        self._recorder: JudgeRecorder | None = None
        self._cache: JudgeCache | None = None
        self._owns_store = False

    # ------------------------------------------------------------------------------ lifecycle
    def open(self, run_dir: str | Path | None = None) -> Judge:
        """Start the judge's gateway and open its store and cache (under ``run_dir`` unless given)."""
        if self._recorder is not None:
            return self
        import agl.store

        base = Path(run_dir) if run_dir is not None else Path(".")
        store = self.store_arg
        if store is None or isinstance(store, Path):
            path = (store or base / "judge.db").resolve()
            path.parent.mkdir(parents=True, exist_ok=True)
            store = f"sqlite:///{path}"
        if isinstance(store, str):
            store = agl.store.open(store)
            self._owns_store = True
        if self.cache_arg:
            path = base / "judge_cache.sqlite" if self.cache_arg is True else Path(self.cache_arg)
            self._cache = JudgeCache(path)
        self._recorder = JudgeRecorder(store, self._backend(), retries=self.retries, backoff_s=self.backoff_s)
        return self

    def _backend(self) -> Any:
        if self.backend_arg is not None:
            return self.backend_arg
        from agl.gateway import OpenAIBackend

        return OpenAIBackend(self.base_url or "", api_key=self.api_key, models=[self.model])

    @property
    def store(self) -> Any:
        """The judge store (after :meth:`open`)."""
        return None if self._recorder is None else self._recorder.store

    def close(self) -> None:
        if self._recorder is not None:
            self._recorder.close()
            if self._owns_store:
                self._recorder.store.close()
            self._recorder = None
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    # -------------------------------------------------------------------------------- scoring
    def score(self, store: Any, rollouts: Sequence[Any]) -> JudgeReport:
        """Judge ``rollouts`` (read from ``store``): by group in relative mode, one by one in absolute."""
        self.open()
        t0 = time.perf_counter()
        report = JudgeReport()
        hits0 = self._cache.hits if self._cache else 0
        for group in self._groups(rollouts):
            report.groups += 1
            self._score_group(store, group, report)
        report.cache_hits = (self._cache.hits if self._cache else 0) - hits0
        report.seconds = time.perf_counter() - t0
        return report

    def _groups(self, rollouts: Sequence[Any]) -> list[list[Any]]:
        if self.mode == "absolute":
            return [[r] for r in rollouts]
        groups: dict[str, list[Any]] = {}
        for r in rollouts:
            groups.setdefault(r.group_id or r.id, []).append(r)
        return list(groups.values())

    def _reference(self, task_input: Any) -> str | None:
        if self.reference is None:
            return None
        if callable(self.reference):
            value = self.reference(task_input)
        else:
            value = task_input.get(self.reference) if isinstance(task_input, dict) else None
        return None if value is None else str(value)

    def _task_shown(self, task_input: Any) -> Any:
        """The task as the judge sees it: without the reference key, which is shown on its own."""
        if isinstance(self.reference, str) and isinstance(task_input, dict):
            return {k: v for k, v in task_input.items() if k != self.reference}
        return task_input

    def _texts(self, store: Any, group: Sequence[Any]) -> list[str]:
        from agl.adapter import finishing_attempt

        texts = []
        for r in group:
            attempt = finishing_attempt(r)
            spans = [] if attempt is None else store.query_spans(rollout_id=r.id, attempt=attempt)
            texts.append(render_spans(spans, token_budget=self.token_budget))
        return texts

    def _score_group(self, store: Any, group: list[Any], report: JudgeReport) -> None:
        task = render_task(self._task_shown(group[0].input))
        reference = self._reference(group[0].input)
        texts = self._texts(store, group)
        labels = [f"t{i + 1}" for i in range(len(group))]
        key = cache_key(self.mode, self.model, self.rubric, task, texts, reference)
        cached = self._cache.get(key) if self._cache else None
        if cached is None:
            cached = self._ask(group, task, reference, list(zip(labels, texts, strict=True)), report)
            if cached is not None and self._cache:
                self._cache.put(key, cached)
        if cached is None:
            report.groups_skipped += 1
            report.skipped_rollouts += [r.id for r in group]
            return
        for r, (score, reason) in zip(group, cached["scores"], strict=True):
            report.scores[r.id] = float(score)
            report.reasons[r.id] = reason
            report.judge_rollouts[r.id] = cached["judge_rollout_id"]

    def _ask(
        self,
        group: list[Any],
        task: str,
        reference: str | None,
        items: list[tuple[str, str]],
        report: JudgeReport,
    ) -> dict[str, Any] | None:
        """One judge rollout: the request, at most one repair, the record. None when malformed twice."""
        assert self._recorder is not None
        if self.mode == "relative":
            messages = protocol.relative_messages(self.rubric, task, items, reference)
        else:
            messages = protocol.absolute_messages(self.rubric, task, *items[0], reference)
        labels = [label for label, _ in items]
        call = self._recorder.start({"mode": self.mode, "model": self.model, "judged": [r.id for r in group]})
        scores, error, reply = None, "", ""
        try:
            for round_ in range(2):
                reply = self._recorder.chat(call, self.model, messages, self.timeout_s)
                try:
                    scores = protocol.parse_scores(reply, labels)
                    break
                except MalformedJudgeOutput as exc:
                    error = str(exc)
                    if round_ == 0:
                        report.repairs += 1
                        messages = [
                            *messages,
                            {"role": "assistant", "content": reply},
                            protocol.repair_message(error),
                        ]
        finally:
            report.calls += call.requests
            report.prompt_tokens += call.prompt_tokens
            report.completion_tokens += call.completion_tokens
        judged = [r.id for r in group]
        if scores is None:
            self._recorder.finish(call, {"judged": judged, "error": error, "reply": reply[:2000]}, ok=False)
            return None
        ordered = [[scores[lbl].score, scores[lbl].reason] for lbl in labels]
        record = {
            "judged": judged,
            "labels": labels,
            "scores": ordered,
            "rubric": self.rubric,
            "model": self.model,
        }
        self._recorder.finish(call, record, ok=True)
        return {"scores": ordered, "judge_rollout_id": call.rollout_id}
