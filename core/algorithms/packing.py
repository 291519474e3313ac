"""Micro-batches of a policy update: sequences grouped under a padded-token budget.

Agent prompts vary from tens to thousands of tokens, so an update packs rows by padded size
(rows x (max prompt + max completion)) rather than by a fixed row count; gradients accumulate across
the micro-batches of a step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agl.adapter.trajectories import Trajectory

if TYPE_CHECKING:
    from agl.types import Transition

__all__ = ["MicroBatch", "pack_micro_batches"]

log = logging.getLogger("agl.algorithms.update")


@dataclass
class MicroBatch:
    """Rows of one forward/backward pass: indices into the step's sequences."""

    rows: list[int]
    prompt_len: int
    response_len: int
    has_logprobs: bool

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * (self.prompt_len + self.response_len)


def _lengths(item: Transition | Trajectory) -> tuple[int, int, bool]:
    """(prompt tokens, tokens after the prompt, has behaviour log-probs) of a transition or trajectory."""
    if isinstance(item, Trajectory):
        return len(item.prompt_ids), len(item.completion_ids), item.logprobs is not None
    return len(item.prompt_ids), len(item.response_ids), item.response_logprobs is not None


def pack_micro_batches(
    items: Sequence[Transition | Trajectory], budget_tokens: int, *, indices: Sequence[int] | None = None
) -> list[MicroBatch]:
    """Group transitions (or merged trajectories) into micro-batches whose padded size (rows x (max
    prompt + max completion)) fits ``budget_tokens``. Longest first, so padding stays small; a sequence
    longer than the budget goes alone (it cannot be split without changing the loss). Rows with and
    without engine log-probs are never mixed: TRL chooses the behaviour log-probs per batch."""
    if budget_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {budget_tokens}")
    idx = list(range(len(items))) if indices is None else list(indices)
    lens = {i: _lengths(items[i]) for i in idx}
    out: list[MicroBatch] = []
    for has_lp in (True, False):
        rows = [i for i in idx if lens[i][2] == has_lp]
        rows.sort(key=lambda i: lens[i][0] + lens[i][1], reverse=True)
        cur: MicroBatch | None = None
        for i in rows:
            p, r, _ = lens[i]
            if cur is not None:
                mp, mr = max(cur.prompt_len, p), max(cur.response_len, r)
                if (len(cur.rows) + 1) * (mp + mr) <= budget_tokens:
                    cur.rows.append(i)
                    cur.prompt_len, cur.response_len = mp, mr
                    continue
            cur = MicroBatch(rows=[i], prompt_len=p, response_len=r, has_logprobs=has_lp)
            out.append(cur)
            if p + r > budget_tokens:
                log.warning(
                    "a sequence of %d tokens exceeds micro_batch_tokens=%d; it runs as its own micro-batch",
                    p + r,
                    budget_tokens,
                )
    return out
