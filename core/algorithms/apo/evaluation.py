"""Running candidates: publish a candidate's prompts as a resources version, run tasks pinned to it
through the store and the runners, and read back each rollout's reward.

Every rollout is enqueued with the candidate's ``resources_version`` and metadata
``apo = {label, candidate, round, prompt_versions}``, so the store says which prompt version each
rollout used (and the agent's ``agl.prompt`` span says so again from inside the rollout).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Sequence
from typing import Any

from agl import semconv as sc
from agl.algorithms.apo.beam import Candidate, mean
from agl.algorithms.apo.environment import Environment
from agl.algorithms.apo.settings import RunSettings
from agl.types import LLM, NewRollout, PromptTemplate, Rollout, Span, Task

__all__ = ["Evaluator", "Result", "TrainBatches"]

log = logging.getLogger("agl.apo")

#: one finished rollout: the candidate it ran (None: the agent's defaults), its task, rollout, reward
Result = tuple[Candidate | None, Task, Rollout, float]


class Evaluator:
    """Runs (candidate, task) jobs on the agent's store and scores them."""

    def __init__(self, env: Environment, settings: RunSettings, progress: Any = None) -> None:
        self.env = env
        self.settings = settings
        self.progress = progress  #: a tqdm bar whose postfix shows the current phase's rollouts

    def publish(self, prompts: dict[str, str] | None) -> int:
        """A resources version with the agent's LLM and ``prompts``; returns its number."""
        env = self.env
        items: dict[str, Any] = {
            "main": LLM(
                base_url=env.agent_url,
                model=env.model_name,
                sampling=dict(self.settings.sampling),
                api_key=env.api_key,
            )
        }
        for name, text in (prompts or {}).items():
            items[name] = PromptTemplate(template=text)
        return env.store.add_resources(items).version

    def run(self, jobs: Sequence[tuple[Candidate | None, int, Task]], label: str) -> list[Result]:
        """Enqueue (candidate, resources version, task) jobs, wait for all, return their rewards.

        With the run's ``round_timeout_s``, rollouts still running at the deadline are cancelled
        (and score 0) so one stuck agent cannot hold the run forever."""
        store = self.env.store
        news = []
        for cand, version, task in jobs:
            meta: dict[str, Any] = {"apo": {"label": label}}
            if cand is not None:
                meta["apo"].update(
                    {"candidate": cand.id, "round": cand.round, "prompt_versions": cand.versions}
                )
            news.append(
                NewRollout.from_task(
                    task,
                    group_id=f"apo-{label}-{cand.id if cand else 'base'}",
                    resources_version=version,
                    config=self.settings.rollout_config,
                    metadata=meta,
                )
            )
        stored = store.enqueue(news) if news else []
        ids = [r.id for r in stored]
        pending = set(ids)
        done: dict[str, Rollout] = {}
        timeout = self.settings.round_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        shown = -1
        while pending:
            for r in store.wait_for_rollouts(sorted(pending), timeout_s=0.5):
                if r.id in pending:
                    pending.discard(r.id)
                    done[r.id] = r
            if self.progress is not None and len(done) != shown:
                shown = len(done)
                self.progress.set_postfix_str(f"{label}: {len(done)}/{len(ids)} rollouts", refresh=True)
            if deadline is not None and pending and time.monotonic() > deadline:
                log.warning(
                    "agl apo: %s: %d rollouts did not finish in time; cancelling them", label, len(pending)
                )
                for rid in list(pending):
                    with contextlib.suppress(Exception):
                        store.cancel(rid)
                deadline = None
        return [
            (cand, task, done[rid], self.reward(done[rid]))
            for (cand, _, task), rid in zip(jobs, ids, strict=True)
        ]

    def evaluate(self, cands: Sequence[Candidate], tasks: Sequence[Task], label: str) -> None:
        """Score each candidate on every task (its ``val_reward`` and ``val_rollouts``)."""
        results = self.run([(c, c.resources_version, t) for c in cands for t in tasks], label)
        for c in cands:
            rs = [rew for cand, _, _, rew in results if cand is c]
            c.val_reward, c.val_rollouts = mean(rs), len(rs)

    def attempt_spans(self, rollout: Rollout) -> list[Span]:
        """The spans of the attempt that finished ``rollout`` (what the optimiser is shown)."""
        from agl.adapter import finishing_attempt

        att = finishing_attempt(rollout)
        if att is None:
            return []
        return self.env.store.query_spans(rollout_id=rollout.id, attempt=att, include_stale=False)

    def reward(self, rollout: Rollout) -> float:
        """The attempt's last primary reward; 0 for a rollout that failed without one or was cancelled."""
        if rollout.status == "cancelled":
            return 0.0
        from agl.adapter import finishing_attempt

        att = finishing_attempt(rollout)
        if att is None:
            return 0.0
        spans = self.env.store.query_spans(
            rollout_id=rollout.id, attempt=att, name=sc.SPAN_REWARD, include_stale=False
        )
        values = [
            s.attributes.get(sc.AGL_REWARD_VALUE)
            for s in spans
            if s.attributes.get(sc.AGL_REWARD_PRIMARY, True)
        ]
        values = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
        return values[-1] if values else 0.0

    def discover_prompts(self, results: Sequence[Result]) -> dict[str, str]:
        """The agent's default prompts, from the ``agl.prompt`` spans of a run without prompt resources."""
        found: dict[str, str] = {}
        for _, _, rollout, _ in results:
            for s in self.env.store.query_spans(rollout_id=rollout.id, name=sc.SPAN_PROMPT):
                name, text = s.attributes.get(sc.AGL_PROMPT_NAME), s.attributes.get(sc.AGL_PROMPT_TEMPLATE)
                if isinstance(name, str) and isinstance(text, str) and name not in found:
                    found[name] = text
        return found


class TrainBatches:
    """Training batches of a fixed size drawn without replacement in a seeded order, reshuffled each
    pass, so every task is used before any repeats and a seed reproduces the run."""

    def __init__(self, tasks: Sequence[Task], size: int, seed: int) -> None:
        self.tasks, self.size = list(tasks), size
        self.rng = random.Random(seed)
        self._order: list[int] = []

    def next(self) -> list[Task]:
        batch = []
        while len(batch) < self.size:
            if not self._order:
                self._order = list(range(len(self.tasks)))
                self.rng.shuffle(self._order)
            batch.append(self.tasks[self._order.pop()])
        return batch
