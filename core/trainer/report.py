"""What ``Trainer.dev`` prints: each rollout's status, reward and the transitions a training run
would use (prompt tail, response, rewards), then a one-line total."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

from agl.types import Rollout, Transition

__all__ = ["print_dev_run", "print_rollout"]


def print_dev_run(
    ids: Sequence[str],
    finished: Sequence[Rollout],
    transitions: dict[str, list[Transition]],
    rewards: dict[str, float],
    tokenizer: Any = None,
) -> None:
    """Print the rollouts ``ids`` in order (``tokenizer`` decodes each prompt's tail), then the totals."""
    by_id = {r.id: r for r in finished}
    n = 0
    for rid in ids:
        ts = transitions.get(rid, [])
        n += len(ts)
        print_rollout(by_id.get(rid), ts, rewards.get(rid), tokenizer)
    rs = [rewards[r] for r in ids if r in rewards]
    mean = sum(rs) / len(rs) if rs else float("nan")
    print(f"\n{len(ids)} rollouts, {n} transitions, mean reward {mean:.3f}")


def print_rollout(
    rollout: Rollout | None, ts: list[Transition], reward: float | None, tokenizer: Any = None
) -> None:
    """One rollout and its transitions."""
    if rollout is None:
        return
    err = rollout.attempts[-1].error if rollout.attempts else None
    print(
        f"\n=== rollout {rollout.id} [{rollout.status}] reward={reward} input={json.dumps(rollout.input)[:120]}"
    )
    if err is not None:
        print(f"    error: {err.type}: {err.message}")
    for t in ts:
        prompt_tail = ""
        if tokenizer is not None:
            with contextlib.suppress(Exception):
                prompt_tail = tokenizer.decode(list(t.prompt_ids)[-40:])
        print(
            f"  [{t.index}] agent={t.agent} prompt={len(t.prompt_ids)} tok response={len(t.response_ids)} tok "
            f"exact={t.exact} reward={t.reward:g} (final {t.final_reward:g}, intermediate {t.intermediate_reward:g})"
        )
        if prompt_tail:
            print("      prompt …" + prompt_tail.replace("\n", "\\n")[-160:])
        print("      response: " + (t.response_text or "").replace("\n", "\\n")[:200])
