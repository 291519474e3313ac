"""The APO loop: round 0 scores the initial prompts, then each round

1. runs every beam candidate on ``rollouts_per_candidate`` training tasks
   (:class:`~agl.algorithms.apo.evaluation.Evaluator`);
2. picks its failures (:func:`~agl.algorithms.apo.beam.pick_failures`);
3. asks the optimiser for a critique then a rewrite, ``branch_factor`` children per beam candidate
   (:class:`~agl.algorithms.apo.optimizer.OptimizerClient`);
4. scores each child on every validation task; 5. keeps the ``beam_width`` best
   (:func:`~agl.algorithms.apo.beam.select_beam`),

writing the round's record and best prompts (:class:`~agl.algorithms.apo.artifacts.RunFiles`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from agl.algorithms.apo.artifacts import RunFiles
from agl.algorithms.apo.beam import Candidate, Failure, mean, pick_failures, select_beam
from agl.algorithms.apo.environment import Environment
from agl.algorithms.apo.evaluation import Evaluator, Result, TrainBatches
from agl.algorithms.apo.optimizer import BudgetExhausted, OptimizerClient
from agl.algorithms.apo.settings import RunSettings
from agl.algorithms.apo.text import OptimizerError
from agl.errors import UsageError
from agl.types import Task

if TYPE_CHECKING:
    from agl.algorithms.apo.algorithm import APO

__all__ = ["ApoRun"]

log = logging.getLogger("agl.apo")


class ApoRun:
    """One APO run: the loop of the module docstring and its bookkeeping."""

    def __init__(
        self,
        apo: APO,
        settings: RunSettings,
        agent: Any,
        train: list[Task],
        val: list[Task],
        test: list[Task],
    ) -> None:
        self.apo, self.settings, self.agent = apo, settings, agent
        self.train, self.val, self.test = train, val, test
        self.files = RunFiles(settings.run_dir)
        self.batches = TrainBatches(train, apo.rollouts_per_candidate, settings.seed)
        self.history: list[dict[str, Any]] = []
        self.candidates: list[Candidate] = []
        self._known: set[tuple[tuple[str, str], ...]] = set()
        self._next_id = 1
        self._bar: Any = None

    # ------------------------------------------------------------------------------ candidates
    def _add(self, cand: Candidate) -> None:
        self.candidates.append(cand)
        self.files.candidate(cand)

    def _initial(self, ev: Evaluator) -> Candidate:
        """Round 0: the initial prompts scored on the validation set — ``APO(prompts=)``, or the
        agent's defaults, learnt from the ``agl.prompt`` spans of a run without prompt resources."""
        apo = self.apo
        if apo.prompts is not None:
            c0 = Candidate(id="c0", prompts=dict(apo.prompts), round=0)
            c0.resources_version = ev.publish(c0.prompts)
            ev.evaluate([c0], self.val, "round0-val")
            return c0
        base_version = ev.publish(None)
        results = ev.run([(None, base_version, t) for t in self.val], "round0-val")
        initial = ev.discover_prompts(results)
        if not initial:
            raise UsageError(
                "the agent read no prompt through agl.prompt(): make it read its prompt with "
                "agl.prompt(name, default=...) or pass APO(prompts={name: template})"
            )
        c0 = Candidate(id="c0", prompts=initial, round=0)
        rs = [rew for *_, rew in results]
        c0.val_reward, c0.val_rollouts = mean(rs), len(rs)
        c0.resources_version = ev.publish(c0.prompts)
        return c0

    def _selected(self, prompts: dict[str, str]) -> list[str]:
        """The prompt names to rewrite: ``APO(agents=)``, else the Trainer's ``agents``, else all."""
        wanted = self.apo.agents if self.apo.agents is not None else self.settings.agents
        if wanted is None:
            return sorted(prompts)
        if isinstance(wanted, str):
            wanted = [wanted]
        names = [str(n) for n in wanted]
        missing = [n for n in names if n not in prompts]
        if missing:
            raise UsageError(
                f"APO agents {missing} have no prompt (prompts: {', '.join(sorted(prompts)) or 'none'}); "
                "the agent must read them with agl.prompt(name, default=...), or pass APO(prompts=...)"
            )
        return names

    def _expand(
        self, opt: OptimizerClient, parent: Candidate, failures: list[Failure], names: list[str], rnd: int
    ) -> list[Candidate]:
        """Up to ``branch_factor`` rewrites of ``parent``; a failed optimiser call costs one child,
        a rewrite already tried is dropped, an exhausted budget stops the expansion."""
        children: list[Candidate] = []
        for b in range(self.apo.branch_factor):
            name = names[(rnd + b + len(self.candidates)) % len(names)]
            meta = {"round": rnd, "parent": parent.id, "branch": b, "prompt": name}
            try:
                critique = opt.critique(parent, name, failures, meta)
                new = opt.rewrite(parent, name, critique, meta)
            except BudgetExhausted:
                break
            except OptimizerError as exc:
                opt.note_failure(exc, meta)
                continue
            child = Candidate(
                id=f"c{self._next_id}",
                prompts={**parent.prompts, name: new},
                round=rnd,
                parent=parent.id,
                edited=name,
                critique=critique,
            )
            if child.key in self._known:
                opt.note_failure(
                    OptimizerError("duplicate", "the rewrite repeats a prompt already tried"), meta
                )
                continue
            self._known.add(child.key)
            self._next_id += 1
            children.append(child)
        return children

    # ---------------------------------------------------------------------------------- rounds
    def _round(
        self, rnd: int, beam: list[Candidate], ev: Evaluator, opt: OptimizerClient, names: list[str]
    ) -> tuple[list[Candidate], list[Candidate], float | None]:
        """One round; returns the new beam, the round's children and the beam's training reward."""
        apo = self.apo
        batch = self.batches.next()
        results = ev.run([(c, c.resources_version, t) for c in beam for t in batch], f"round{rnd}-train")
        children: list[Candidate] = []
        train_all: list[float] = []
        for parent in beam:
            mine = [(task, r, rew) for cand, task, r, rew in results if cand is parent]
            parent.train_rewards = [rew for *_, rew in mine]
            train_all.extend(parent.train_rewards)
            failures = pick_failures(mine, apo.failure_below, apo.max_failures)
            if not failures:
                continue
            children.extend(self._expand(opt, parent, failures, names, rnd))
            if opt.budget_exhausted:
                break
        for child in children:
            child.resources_version = ev.publish(child.prompts)
        if children:
            ev.evaluate(children, self.val, f"round{rnd}-val")
        for child in children:
            self._add(child)
        age = {c.id: i for i, c in enumerate(self.candidates)}
        return select_beam(beam + children, apo.beam_width, age), children, mean(train_all)

    def _log_round(
        self,
        rnd: int,
        beam: list[Candidate],
        new: list[Candidate],
        round_s: float,
        train_reward: float | None,
        opt: OptimizerClient,
    ) -> None:
        best = beam[0]
        record: dict[str, Any] = {
            "step": rnd,
            "round": rnd,
            "algorithm": "apo",
            "val_reward": best.val_reward,
            "train_reward": train_reward,
            "best_candidate": best.id,
            "beam": [c.id for c in beam],
            "beam_val_rewards": [c.val_reward for c in beam],
            "new_candidates": [c.id for c in new],
            "candidate_val_rewards": [c.val_reward for c in new],
            "candidates_total": len(self.candidates),
            "optimizer_calls": opt.calls,
            "optimizer_tokens": opt.tokens_used,
            "optimizer_failures": sum(opt.failures.values()),
            "budget_exhausted": opt.budget_exhausted,
            "resources_version": best.resources_version,
            "round_s": round_s,
        }
        self.history.append(record)
        self.files.round(record, best)
        if self._bar is not None:
            self._bar.set_postfix(
                {
                    "best_val": f"{best.val_reward:.3f}" if best.val_reward is not None else "-",
                    "opt_tokens": opt.tokens_used,
                },
                refresh=True,
            )

    def _summary(self, c0: Candidate, best: Candidate, opt: OptimizerClient, ev: Evaluator) -> dict[str, Any]:
        summary: dict[str, Any] = {
            "run_dir": str(self.settings.run_dir),
            "rounds": len(self.history) - 1,
            "val_reward_before": c0.val_reward,
            "val_reward_after": best.val_reward,
            "best_candidate": best.id,
            "best_prompts": best.prompts,
            "best_versions": best.versions,
            "best_resources_version": best.resources_version,
            "candidates": len(self.candidates),
            "optimizer_calls": opt.calls,
            "optimizer_tokens": opt.tokens_used,
            "optimizer_failures": dict(opt.failures),
            "budget_exhausted": opt.budget_exhausted,
        }
        if self.test:  # held out from selection: the honest before/after
            ends = [c0] if best is c0 else [c0, best]
            results: list[Result] = ev.run(
                [(c, c.resources_version, t) for c in ends for t in self.test], "test"
            )
            for c, key in ((c0, "test_reward_before"), (best, "test_reward_after")):
                summary[key] = mean([rew for cand, _, _, rew in results if cand is c])
            summary["test_tasks"] = len(self.test)
        return summary

    def run(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        apo, t_start = self.apo, time.perf_counter()
        self.files.reset()
        env = Environment(apo, self.settings, self.agent)
        try:
            self._bar = tqdm(
                total=apo.rounds + 1,
                desc="agl apo",
                unit="round",
                disable=not self.settings.progress,
                dynamic_ncols=True,
            )
            ev = Evaluator(env, self.settings, self._bar)
            opt = OptimizerClient(apo, env, self.files, ev.attempt_spans)
            t0 = time.perf_counter()
            c0 = self._initial(ev)
            names = self._selected(c0.prompts)
            self._add(c0)
            self._known.add(c0.key)
            beam = [c0]
            self._bar.update(1)
            self._log_round(0, beam, [c0], time.perf_counter() - t0, None, opt)
            for rnd in range(1, apo.rounds + 1):
                if opt.budget_exhausted:
                    break
                t0 = time.perf_counter()
                beam, children, train_reward = self._round(rnd, beam, ev, opt, names)
                self._bar.update(1)
                self._log_round(rnd, beam, children, time.perf_counter() - t0, train_reward, opt)
            summary = self._summary(c0, beam[0], opt, ev)
            summary["wall_s"] = time.perf_counter() - t_start
            self._bar.close()
        finally:
            env.close()
        self.files.summary(summary)
        summary["history"] = self.history
        return summary
