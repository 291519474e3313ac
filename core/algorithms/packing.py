"""Micro-batches of a policy update: sequences grouped under a token budget.

Agent prompts vary from tens to thousands of tokens, so an update packs rows by padded size
(rows x (max prompt + max completion)) rather than by a fixed row count; gradients accumulate across
the micro-batches of a step.

With prefix sharing (``share_cost``, :mod:`agl.algorithms.prefix_tree`), sequences that share a
prefix where it pays are first packed into tree rows, and those micro-batches are sized by their tree
tokens (rows x longest tree row), not by the tokens their sequences would have flat: a step then fits
the same memory budget in fewer passes. Sequences that share with no one pack flat, as without it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agl.adapter.trajectories import Trajectory
from agl.algorithms.prefix_tree import PrefixTree, TreeRow, plan_rows

if TYPE_CHECKING:
    from agl.types import Transition

__all__ = ["MicroBatch", "pack_micro_batches"]

log = logging.getLogger("agl.algorithms.update")


@dataclass
class MicroBatch:
    """Rows of one forward/backward pass: indices into the step's sequences. A tree-packed micro-batch
    (``tree``) runs its sequences through the model as the tree's rows; the loss still sees one row
    per sequence (``rows``, in the tree's member order)."""

    rows: list[int]
    prompt_len: int
    response_len: int
    has_logprobs: bool
    #: tokens through the model, padding excluded (the tree's tokens when tree-packed)
    tokens: int = 0
    tree: PrefixTree | None = None

    @property
    def padded_tokens(self) -> int:
        if self.tree is not None:
            return len(self.tree.rows) * self.tree.width
        return len(self.rows) * (self.prompt_len + self.response_len)


def _lengths(item: Transition | Trajectory) -> tuple[int, int, bool]:
    """(prompt tokens, tokens after the prompt, has behaviour log-probs) of a transition or trajectory."""
    if isinstance(item, Trajectory):
        return len(item.prompt_ids), len(item.completion_ids), item.logprobs is not None
    return len(item.prompt_ids), len(item.response_ids), item.response_logprobs is not None


def _full_ids(item: Transition | Trajectory) -> tuple[int, ...]:
    if isinstance(item, Trajectory):
        return item.prompt_ids + item.completion_ids
    return tuple(item.prompt_ids) + tuple(item.response_ids)


def pack_micro_batches(
    items: Sequence[Transition | Trajectory],
    budget_tokens: int,
    *,
    indices: Sequence[int] | None = None,
    share_cost: float | None = None,
) -> list[MicroBatch]:
    """Group transitions (or merged trajectories) into micro-batches whose padded size (rows x (max
    prompt + max completion)) fits ``budget_tokens``. Longest first, so padding stays small; a sequence
    longer than the budget goes alone (it cannot be split without changing the loss). Rows with and
    without engine log-probs are never mixed: TRL chooses the behaviour log-probs per batch.

    With ``share_cost`` (the model's attention-to-token cost ratio,
    :func:`agl.algorithms.prefix_tree.pair_cost`), sequences sharing a prefix where it pays are
    tree-packed first, in micro-batches of rows x longest tree row within the budget."""
    if budget_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {budget_tokens}")
    idx = list(range(len(items))) if indices is None else list(indices)
    lens = {i: _lengths(items[i]) for i in idx}
    out: list[MicroBatch] = []
    for has_lp in (True, False):
        rows = [i for i in idx if lens[i][2] == has_lp]
        if share_cost is not None:
            # a sequence without prompt tokens has no position before its first response token to share
            seqs = {i: _full_ids(items[i]) for i in rows if lens[i][0] > 0}
            trees, alone = plan_rows(seqs, budget_tokens, share_cost)
            out.extend(_tree_batches(trees, lens, has_lp, budget_tokens))
            flat = set(alone)
            rows = [i for i in rows if i not in seqs or i in flat]
        out.extend(_flat_batches(rows, lens, has_lp, budget_tokens))
    return out


def _flat_batches(
    rows: list[int], lens: dict[int, tuple[int, int, bool]], has_lp: bool, budget_tokens: int
) -> list[MicroBatch]:
    """Flat micro-batches of ``rows`` (one sequence per row), longest first within the padded budget."""
    rows = sorted(rows, key=lambda i: lens[i][0] + lens[i][1], reverse=True)
    out: list[MicroBatch] = []
    cur: MicroBatch | None = None
    for i in rows:
        p, r, _ = lens[i]
        if cur is not None:
            mp, mr = max(cur.prompt_len, p), max(cur.response_len, r)
            if (len(cur.rows) + 1) * (mp + mr) <= budget_tokens:
                cur.rows.append(i)
                cur.prompt_len, cur.response_len = mp, mr
                cur.tokens += p + r
                continue
        cur = MicroBatch(rows=[i], prompt_len=p, response_len=r, has_logprobs=has_lp, tokens=p + r)
        out.append(cur)
        if p + r > budget_tokens:
            log.warning(
                "a sequence of %d tokens exceeds micro_batch_tokens=%d; it runs as its own micro-batch",
                p + r,
                budget_tokens,
            )
    return out


def _tree_batches(
    trees: list[TreeRow], lens: dict[int, tuple[int, int, bool]], has_lp: bool, budget_tokens: int
) -> list[MicroBatch]:
    """Micro-batches of tree rows, longest first, rows x longest row within the budget (a row is at
    most the budget: :func:`agl.algorithms.prefix_tree.joins` keeps it so)."""
    groups: list[list[TreeRow]] = []
    for row in sorted(trees, key=lambda r: r.tokens, reverse=True):
        if groups and (len(groups[-1]) + 1) * groups[-1][0].tokens <= budget_tokens:
            groups[-1].append(row)
        else:
            groups.append([row])
    out = []
    for group in groups:
        tree = PrefixTree(group)
        members = tree.members
        out.append(
            MicroBatch(
                rows=members,
                prompt_len=max(lens[i][0] for i in members),
                response_len=max(lens[i][1] for i in members),
                has_logprobs=has_lp,
                tokens=tree.tokens,
                tree=tree,
            )
        )
    return out
