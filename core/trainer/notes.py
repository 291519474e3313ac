"""What a training or dev run tells its user beyond the metrics: steps that made no update, and the
commands that look inside a finished run.

A step whose groups all had the same reward in every rollout has no advantage and so no gradient: the
policy is unchanged, which with a small model and a real function-calling agent is the first thing a
new user meets. Left silent it looks like training; :func:`no_update_note` marks the step's record
(``no_update`` in ``metrics.jsonl``, TensorBoard and the progress bar) and says why, and after two such
steps in a row what to do about it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["ADVICE", "inspect_commands", "no_update_note"]

#: what to do when steps keep making no update (every group's rollouts got the same reward)
ADVICE = (
    "warm-start the model from a teacher (record demonstrations with Trainer.dev(agent, tasks, "
    "base_url=<any OpenAI-compatible teacher>) or `agl dev --base-url`, then `agl sft`), give more "
    "tasks per step (tasks_per_step) or a larger group_size, turn on dynamic sampling "
    "(dynamic_sampling=True: redraws until groups differ), or use an easier mix of tasks"
)


def _why(record: dict[str, Any]) -> str:
    groups, flat = record.get("groups"), record.get("zero_variance_groups")
    if not record.get("transitions"):
        return "the rollouts gave no transitions (see the adapter's warnings above)"
    if groups and flat == groups:
        return f"every one of its {groups} group(s) had the same reward in all its rollouts (no advantage)"
    return "no transition had a non-zero advantage"


def no_update_note(record: dict[str, Any], history: Sequence[dict[str, Any]]) -> str | None:
    """For a training step that updated nothing: set ``record["no_update"]`` and return the message to
    log (with the advice when the step before made no update either); None for a step that trained.
    A step that only measured the held-out reward (no ``rollouts``) is not a training step."""
    if "rollouts" not in record:
        return None
    trained = record.get("trained_transitions") or 0
    record["no_update"] = trained == 0
    if trained:
        return None
    step = record.get("step")
    note = f"agl trainer: step {step} made no update: {_why(record)}; the policy is unchanged"
    previous = history[-1] if history else None
    if previous is not None and previous.get("no_update"):
        note += f". Two steps in a row without an update: {_learnt(record, history) or ADVICE}"
    return note


def _learnt(record: dict[str, Any], history: Sequence[dict[str, Any]]) -> str | None:
    """The advice for flat groups that are flat because the run learnt its tasks: every rollout gets the
    best training reward of the run, which earlier steps fell short of (a run that starts there gets
    :data:`ADVICE`: its tasks were too easy, or the reward does not vary)."""
    reward = record.get("train_reward")
    earlier = [h["train_reward"] for h in history if h.get("train_reward") is not None]
    if reward is None or not earlier or reward < max(earlier) or min(earlier) >= reward:
        return None
    return (
        f"every rollout now gets the run's best reward ({reward:.3f}, up from {min(earlier):.3f}): these "
        "tasks look learnt, and harder or more varied tasks would give the update more to learn from"
    )


def inspect_commands(run_dir: str | Path, store_url: str | None) -> str:
    """The commands that look inside a run's store and directory, printed once when fit()/dev() finish
    (an example's own script prints none of its own: the run's output says each command once)."""
    lines = ["Look inside the run:"]
    if store_url:
        lines += [
            f"  agl rollouts list --store {store_url}",
            f"  agl rollouts show ROLLOUT_ID --store {store_url}",
            f"  agl spans ROLLOUT_ID --store {store_url}",
            f"  agl transitions ROLLOUT_ID --store {store_url}",
        ]
    else:
        lines.append("  (an in-memory store: nothing is kept; give store=... to keep the run)")
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.exists():
        board = f"  agl dashboard --store {store_url} --run-dir {run_dir}" if store_url else None
        lines += [line for line in (board, f"  agl plot {run_dir}") if line]
    return "\n".join(lines)
