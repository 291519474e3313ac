"""``MetricsLog``: a run's metrics, one record per step, where the tools read them.

Each record is appended to ``run_dir/metrics.jsonl`` (what ``agl plot``, the dashboard and a resumed
run read) and its numbers to the experiment trackers ``report_to`` names (:mod:`agl.run.trackers`:
TensorBoard under ``run_dir/tb``, trackio, W&B, MLflow; by default TensorBoard when it is installed,
and the JSONL is written either way). ``history`` keeps the records in memory; :func:`bar_postfix` is
the progress bar's summary of a step, :func:`mean` the records' mean. The Trainer and SFT both write
through it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "bar_postfix", "engine_share", "mean", "rollouts_postfix"]

log = logging.getLogger("agl.metrics")


def mean(xs: Sequence[float]) -> float | None:
    """The mean of a record's values, or None for none (a step without held-out rewards has no
    ``val_reward``, not a zero one); the one definition the trainer's records and monitors use."""
    return float(sum(xs) / len(xs)) if xs else None


class MetricsLog:
    """``metrics.jsonl`` + the ``report_to`` trackers for the run in ``run_dir``; ``history``: records so
    far. ``start(config)`` opens the trackers with the run's resolved configuration (the first
    ``write`` opens them without one), ``log_plot`` hands them the reward curve, ``close`` finishes them."""

    def __init__(
        self,
        run_dir: str | Path,
        history: Sequence[dict[str, Any]] = (),
        *,
        report_to: Any = None,
        project: str | None = None,
        run_name: str | None = None,
    ) -> None:
        from agl.run.trackers import check_installed, check_settings, resolve_report_to

        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = list(history)
        #: the tracker names (None: TensorBoard when installed); a missing package, or a setting the
        #: tracker would refuse mid-run (MLflow's file store), is refused here
        self.report_to = resolve_report_to(report_to)
        check_installed(self.report_to)
        check_settings(self.report_to)
        self.project, self.run_name = project, run_name
        self._trackers: list[Any] | None = None  # opened by start(), or by the first write()

    def start(self, config: dict[str, Any] | None = None, *, resume: bool = False) -> None:
        """Open the trackers and record the run's resolved ``config`` in them (a no-op once open)."""
        if self._trackers is not None:
            return
        from agl.run.trackers import open_trackers

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._trackers = []
        try:
            trackers = open_trackers(
                self.report_to, self.run_dir, project=self.project, run_name=self.run_name, resume=resume
            )
        except Exception as exc:  # noqa: BLE001 - by default TensorBoard is optional, as it always was
            if self.report_to is not None:
                raise
            log.debug("agl: TensorBoard not written: %s", exc)
            return
        for tracker in trackers:
            tracker.start(config or {})
            self._trackers.append(tracker)

    def reset(self) -> None:
        """Start a fresh log: remove an earlier run's ``metrics.jsonl`` and forget the history."""
        self.path.unlink(missing_ok=True)
        self.history.clear()

    def load(self) -> list[dict[str, Any]]:
        """Read the records already in ``metrics.jsonl`` into ``history`` (a resumed run); returns them."""
        text = self.path.read_text() if self.path.exists() else ""
        self.history[:] = [json.loads(line) for line in text.splitlines() if line.strip()]
        return self.history

    def truncate(self, before_step: int) -> None:
        """Keep only the records of steps before ``before_step`` (in ``history`` and, rewritten
        atomically, in ``metrics.jsonl``): a resumed run drops the steps its checkpoint does not hold."""
        keep = [h for h in self.history if h.get("step", 0) < before_step]
        if len(keep) == len(self.history):
            return
        self.history[:] = keep
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(h) + "\n" for h in keep))
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (it has a ``step``) to the history, the JSONL file and every tracker."""
        self.history.append(record)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._trackers is None:
            self.start()
        from agl.run.trackers import numeric_metrics

        metrics = numeric_metrics(record)
        for tracker in self._trackers or ():
            tracker.log(metrics, int(record["step"]))

    def log_plot(self, path: str | Path) -> None:
        """The run's reward-curve PNG, to every tracker (a tracker that cannot take it logs why)."""
        for tracker in self._trackers or ():
            try:
                tracker.log_plot(Path(path))
            except Exception as exc:  # noqa: BLE001 - a plot a tracker refuses must not fail the run
                log.warning("agl: %s did not take the reward plot: %s", tracker.name, exc)

    def summary(self, steps: int) -> dict[str, Any]:
        """A finished run's summary: its held-out reward before and after, the run's steps and history."""
        checks = [h for h in self.history if h.get("val_reward") is not None]
        after = checks[-1] if checks else None
        # the held-out reward before any update: the step-0 check (None when val_before=False skipped
        # it), and only when it was given as many held-out tasks as the last check -- a resumed run
        # re-checked on a larger held-out set must not be compared with the smaller set's figure. The
        # tasks given, not the rollouts that finished with a reward: a held-out rollout the step timeout
        # cancelled must not hide the comparison (histories written before val_tasks existed fall back).
        before = next((h for h in checks if h["step"] == 0), None)
        # Likewise a check decoded otherwise (a resumed run given another val_samples).
        if before is not None and after is not None and _val_set_size(before) != _val_set_size(after):
            before = None
        if before is not None and after is not None and _decoded(before) != _decoded(after):
            before = None
        return {
            "run_dir": str(self.run_dir),
            "steps": steps,
            "val_reward_before": before["val_reward"] if before else None,
            "val_reward_after": after["val_reward"] if after else None,
            **held_out_decoding(before, after),
            "history": self.history,
        }

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Finish every tracker (``summary``: the held-out reward before and after, for their run
        summaries); the JSONL needs no closing. Writing again opens them anew."""
        trackers, self._trackers = self._trackers or [], None
        for tracker in trackers:
            try:
                tracker.finish(summary or {})
            except Exception as exc:  # noqa: BLE001 - one tracker failing to close must not hide the rest
                log.warning("agl: closing %s failed: %s", tracker.name, exc)


def _decoded(record: dict[str, Any]) -> tuple[Any, Any]:
    """How a check was decoded; records older than ``val_decoding`` were sampled once per task."""
    return record.get("val_decoding", "sampled"), record.get("val_samples", 1)


def held_out_decoding(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """The summary's word on how its held-out figures were decoded (agl.trainer.heldout):
    ``val_decoding``, ``val_samples`` and, sampled, ``val_pass_at_k_before``/``after``."""
    last = after or before
    if last is None:
        return {}
    decoding, k = _decoded(last)
    out: dict[str, Any] = {"val_decoding": decoding, "val_samples": k}
    if decoding == "sampled" and "val_pass_at_k" in last:
        out["val_pass_at_k_before"] = before.get("val_pass_at_k") if before else None
        out["val_pass_at_k_after"] = after.get("val_pass_at_k") if after else None
    return out


def _val_set_size(record: dict[str, Any]) -> int | None:
    """How many held-out tasks a check was given (``val_rollouts`` for records older than ``val_tasks``)."""
    return record.get("val_tasks", record.get("val_rollouts"))


def bar_postfix(record: dict[str, Any], history: Sequence[dict[str, Any]]) -> dict[str, str]:
    """A progress bar's postfix after a step: its training reward, its held-out reward only when the step
    measured one (an older ``val=`` would read as this step's), and ``update=none`` for a step that
    trained nothing."""
    reward = record.get("train_reward")
    post = {"reward": f"{reward:.3f}" if reward is not None else "-"}
    if record.get("val_reward") is not None:
        post["val"] = f"{record['val_reward']:.3f}"
        if record.get("val_decoding") == "greedy":
            post["val"] += " greedy"
    if record.get("no_update"):
        post["update"] = "none"
    for key, short in _FLAGGED:  # shown only when the step had any: a failure or a reward for nothing
        if record.get(key):
            post[short] = str(record[key])
    if record.get("dropped_groups"):
        post["dropped"] = str(record["dropped_groups"])
    return post


#: step metrics the bar shows when non-zero, and their short names there
_FLAGGED = (
    ("errored_rollouts/infra", "infra"),
    ("errored_rollouts/agent", "agent_err"),
    ("requeued_rollouts", "requeued"),
    ("rewarded_without_calls", "no_calls"),
    ("rewarded_truncated", "truncated"),
    ("default_rewards", "defaults"),
)


def rollouts_postfix(total: int, finished: Sequence[Any], rewards: dict[str, float]) -> dict[str, str]:
    """A progress bar's postfix while a step's rollouts finish: how many of ``total``, and the mean
    training and held-out reward of those that have one."""
    post = {"rollouts": f"{len(finished)}/{total}"}
    for mode, key in (("train", "reward"), ("val", "val")):
        rs = [rewards[r.id] for r in finished if r.mode == mode and r.id in rewards]
        if rs:
            post[key] = f"{sum(rs) / len(rs):.3f}"
    return post


def engine_share(busy0: float | None, env: Any, step_s: float) -> dict[str, float]:
    """``engine_busy_s``/``engine_idle_s`` of a step that began with the in-process engine's busy
    clock at ``busy0`` (nothing without such an engine: a remote or scripted one reports no clock), and
    ``engine_restarts``, the engine restarts of the run so far, once there was one."""
    restarts = env.engine_restarts() if env is not None and hasattr(env, "engine_restarts") else 0
    out: dict[str, float] = {"engine_restarts": restarts} if restarts else {}  # a dead engine came back
    busy1 = env.engine_busy_s() if env is not None else None
    if busy0 is None or busy1 is None:
        return out
    busy = busy1 - busy0
    return {**out, "engine_busy_s": busy, "engine_idle_s": max(step_s - busy, 0.0)}
