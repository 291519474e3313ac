"""The files an APO run leaves in its run directory, written as the run goes so a crash keeps what
was measured:

- ``metrics.jsonl``: one record per round (``"algorithm": "apo"``; ``agl plot`` draws it);
- ``candidates.jsonl``: every candidate with its prompts, versions, scores, parent and critique;
- ``optimizer_failures.jsonl``: every optimiser call that produced nothing usable, and why;
- ``prompts/round-N.json``: the best prompts after round N;
- ``best_prompts.json``: the run's summary (best prompts, before/after rewards, optimiser usage);
- ``reward_curve.png``: the plot of ``metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from agl.algorithms.apo.beam import Candidate

__all__ = ["RunFiles"]

METRICS = "metrics.jsonl"
CANDIDATES = "candidates.jsonl"
FAILURES = "optimizer_failures.jsonl"
BEST = "best_prompts.json"


class RunFiles:
    """Writes the run directory's files (see the module docstring)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def reset(self) -> None:
        """Start clean: a rerun in the same directory must not append to the last run's records."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for name in (METRICS, CANDIDATES, FAILURES, BEST):
            with contextlib.suppress(FileNotFoundError):
                (self.run_dir / name).unlink()
        prompts_dir = self.run_dir / "prompts"
        if prompts_dir.is_dir():
            for p in prompts_dir.glob("round-*.json"):
                p.unlink()

    def append(self, name: str, record: dict[str, Any]) -> None:
        with open(self.run_dir / name, "a") as f:
            f.write(json.dumps(record) + "\n")

    def write_json(self, path: Path, data: Any) -> None:
        """Whole or not at all: written to a temporary file, then renamed over ``path``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)

    def candidate(self, cand: Candidate) -> None:
        self.append(CANDIDATES, cand.record())

    def failure(self, record: dict[str, Any]) -> None:
        self.append(FAILURES, record)

    def round(self, record: dict[str, Any], best: Candidate) -> None:
        """A round's metrics record and the best prompts after it."""
        self.append(METRICS, record)
        rnd = record["round"]
        self.write_json(
            self.run_dir / "prompts" / f"round-{rnd}.json",
            {
                "round": rnd,
                "candidate": best.id,
                "val_reward": best.val_reward,
                "prompts": best.prompts,
                "versions": best.versions,
            },
        )

    def summary(self, summary: dict[str, Any]) -> None:
        """``best_prompts.json`` and the reward curve (a plot that fails never fails the run)."""
        self.write_json(self.run_dir / BEST, {k: v for k, v in summary.items() if k != "history"})
        with contextlib.suppress(Exception):
            from agl.run.plot import plot_run

            plot_run(self.run_dir)
