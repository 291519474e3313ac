"""Shared-prefix (tree) packing: a step's sequences that share a token prefix go through the model once.

Every member of a GRPO group starts from the same system prompt, tool descriptions and task, and an
agent's later calls re-send its earlier ones. Packed flat, each sequence re-encodes that prefix. Tree
packing puts the sequences that share a prefix into one row: the shared tokens once, each sequence's
remaining tokens after them as a branch, with

- an attention mask under which every token sees exactly its own sequence's earlier tokens (its
  ancestors in the tree and itself), and
- position ids that continue the prefix's in each branch (a token's position is its index in its own
  sequence),

so each token's hidden state is the one the unshared sequence gives it, and so are its log-prob, the
loss and the gradients (the tree is a re-layout of the same computation, exact up to float summation
order). Nesting is free: members are laid out in lexicographic order of their tokens, so each one
shares with the row exactly its longest common prefix with the member before it, however deep
(a prompt shared by a group, a longer one by the turns of one conversation, identical sequences whole).

**Where it pays.** A row's attention costs grow with the square of its length while the rest of the
model's work grows linearly, so a member joins a row only when that costs less than running it alone
(:func:`joins`, with the model's attention-to-token cost ratio from :func:`pair_cost`) and the row
stays within the micro-batch token budget. A handful of template tokens shared by otherwise unrelated
sequences do not pay; a group's 1,000-token prompt does.

This module plans rows (pure Python); :class:`PackedInputs` turns a micro-batch's rows into the
model's inputs (torch, imported where used). The forward that consumes them is
:meth:`agl.algorithms.scoring.TransitionGRPOTrainer._get_per_token_logps_and_entropies`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


__all__ = [
    "DEFAULT_PAIR_COST",
    "PackedInputs",
    "PrefixTree",
    "TreeRow",
    "common_prefix",
    "joins",
    "pair_cost",
    "plan_rows",
]

#: the attention-to-token cost ratio when a model's config does not say its shape (SmolLM2-135M's)
DEFAULT_PAIR_COST = 1.0 / 3072


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    lo, hi = 0, n  # binary search on slice equality: compares in C, O(n log n) at worst
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def pair_cost(model_config: Any) -> float:
    """The forward/backward cost of one attended (query, key) pair relative to one token through the
    layers' projections, from the model's shape: per layer a pair costs ``2 q`` multiply-adds (QK^T
    and AV over all heads, ``q`` = heads x head size) and a token ``2 h q + 2 h kv + 3 h f`` (the
    Q/O, K/V and gated-MLP projections; ``h`` hidden size, ``kv`` key/value width, ``f`` MLP width).
    SmolLM2-135M: 1/3072, so attention over a 3,072-token row costs as much as the rest of the layers."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    h = int(getattr(cfg, "hidden_size", 0) or 0)
    f = int(getattr(cfg, "intermediate_size", 0) or 0)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    if not (h and f and heads):
        return DEFAULT_PAIR_COST
    head_dim = int(getattr(cfg, "head_dim", 0) or h // heads)
    q = heads * head_dim
    kv = int(getattr(cfg, "num_key_value_heads", 0) or heads) * head_dim
    return 2.0 * q / (2 * h * q + 2 * h * kv + 3 * h * f)


def joins(row_tokens: int, length: int, shared: int, budget: int, cost: float) -> bool:
    """Whether a sequence of ``length`` tokens sharing ``shared`` of them with a row of ``row_tokens``
    joins it: some tokens are shared, the row stays within ``budget``, and the work added to the row
    (its new tokens, and the attention pairs the longer row adds) is less than the sequence's alone."""
    if shared <= 0:
        return False
    new = length - shared
    if row_tokens + new > budget:
        return False
    joined = new + cost * ((row_tokens + new) ** 2 - row_tokens**2)
    return joined < length + cost * length**2


@dataclass
class TreeRow:
    """One packed row: its members' tokens, each shared prefix once.

    ``members`` are sequence indices in lexicographic order of their tokens; ``shared[k]`` is how many
    leading tokens member k shares with member k-1 (0 for the first), so its tokens after those follow
    at the row's end as a new branch. ``paths[k][i]`` is the row position of member k's i-th token
    and ``positions[j]`` the position id of row position j (its index in its own sequence)."""

    members: list[int] = field(default_factory=list)
    shared: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    paths: list[list[int]] = field(default_factory=list)

    def add(self, index: int, tokens: Sequence[int], shared: int) -> None:
        """Append sequence ``index`` (its full ``tokens``), sharing its first ``shared`` tokens with
        the last member (the whole common prefix with it, which the row already holds)."""
        if shared and not self.paths:
            raise ValueError("the first member of a row shares nothing")
        start = len(self.ids)
        self.ids.extend(tokens[shared:])
        self.positions.extend(range(shared, len(tokens)))
        prefix = self.paths[-1][:shared] if shared else []
        self.members.append(index)
        self.shared.append(shared)
        self.paths.append(prefix + list(range(start, start + len(tokens) - shared)))

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def allowed(self, width: int) -> torch.Tensor:
        """The (width, width) boolean mask, True where row position i may attend to j: j is i itself or
        an earlier token of i's own sequence. Padding positions attend to themselves only (a fully
        masked query row would give NaN), and no real token attends to them."""
        import torch

        m = torch.zeros(width, width, dtype=torch.bool)
        for path, shared in zip(self.paths, self.shared, strict=True):
            new = len(path) - shared
            if new == 0:
                continue
            s = path[shared]
            m[s : s + new, s : s + new] = torch.ones(new, new, dtype=torch.bool).tril()
            if shared:
                m[s : s + new, torch.tensor(path[:shared], dtype=torch.long)] = True
        pad = torch.arange(self.tokens, width)
        m[pad, pad] = True
        return m


@dataclass
class PrefixTree:
    """A tree-packed micro-batch: its rows, and its member sequences in row order (``members``: the
    micro-batch's ``rows``)."""

    rows: list[TreeRow]

    @property
    def members(self) -> list[int]:
        return [i for row in self.rows for i in row.members]

    @property
    def tokens(self) -> int:
        """Tokens through the model (padding excluded)."""
        return sum(row.tokens for row in self.rows)

    @property
    def width(self) -> int:
        return max(row.tokens for row in self.rows)

    def locate(self) -> list[tuple[int, list[int]]]:
        """Each member's (row, path), in :attr:`members` order."""
        return [(r, path) for r, row in enumerate(self.rows) for path in row.paths]


def plan_rows(
    sequences: dict[int, Sequence[int]], budget: int, cost: float
) -> tuple[list[TreeRow], list[int]]:
    """Tree rows of the sequences (``{index: full tokens}``) that share a prefix where sharing pays
    (:func:`joins`), and the indices of those that share with no one (they pack flat). Sequences are
    taken in lexicographic order, so the longest common prefix with the row is the one with the
    previous sequence; a sequence that does not join the open row opens the next one."""
    order = sorted(sequences, key=lambda i: tuple(sequences[i]))
    rows: list[TreeRow] = []
    prev: Sequence[int] | None = None
    for i in order:
        toks = sequences[i]
        shared = common_prefix(prev, toks) if prev is not None else 0
        if rows and joins(rows[-1].tokens, len(toks), shared, budget, cost):
            rows[-1].add(i, toks, shared)
        else:
            row = TreeRow()
            row.add(i, toks, 0)
            rows.append(row)
        prev = toks
    shared_rows = [r for r in rows if len(r.members) > 1]
    alone = [r.members[0] for r in rows if len(r.members) == 1]
    return shared_rows, alone


@dataclass
class PackedInputs:
    """The model inputs of a tree-packed micro-batch, and where each flat (unshared) input lands.

    The loss is TRL's, on the flat micro-batch (``flat_ids``: left-padded prompts + right-padded
    completions, one row per sequence); only the forward runs on the tree. ``valid`` lists the flat
    response positions the loss uses (``b x keep + j`` for completion token j of flat row b, where
    its mask is 1: padding and context such as tool results are not scored), and ``gather[k]`` the
    tree index (row x width + position) of the hidden state that predicts ``valid[k]``'s token: the
    row position of the token before it in b's own sequence."""

    flat_ids: torch.Tensor
    keep: int
    ids: torch.Tensor
    positions: torch.Tensor
    allowed: torch.Tensor  # (rows, 1, width, width) bool
    valid: torch.Tensor
    gather: torch.Tensor

    @classmethod
    def build(
        cls,
        tree: PrefixTree,
        flat_ids: torch.Tensor,
        prompt_lens: Sequence[int],
        completion_lens: Sequence[int],
        pad_id: int,
        scored: Sequence[Sequence[int]] | None = None,
    ) -> PackedInputs:
        """The inputs for ``tree`` whose members are ``flat_ids``'s rows in order, with the given
        prompt and completion lengths (the flat layout's left/right padding is implied). ``scored``:
        each row's completion mask of the tokens the loss uses (default: every completion token)."""
        import torch

        width, dev = tree.width, flat_ids.device
        keep = flat_ids.size(1) - max(prompt_lens)
        ids = torch.full((len(tree.rows), width), pad_id, dtype=torch.long)
        pos = torch.zeros((len(tree.rows), width), dtype=torch.long)
        for r, row in enumerate(tree.rows):
            ids[r, : row.tokens] = torch.tensor(row.ids, dtype=torch.long)
            pos[r, : row.tokens] = torch.tensor(row.positions, dtype=torch.long)
        valid: list[int] = []
        gather: list[int] = []
        for b, (r, path) in enumerate(tree.locate()):
            p, n = prompt_lens[b], completion_lens[b]
            js = range(n) if scored is None else [j for j in range(n) if scored[b][j]]
            valid.extend(b * keep + j for j in js)
            gather.extend(path[p - 1 + j] + r * width for j in js)
        allowed = torch.stack([row.allowed(width) for row in tree.rows])[:, None]
        return cls(
            flat_ids,
            keep,
            ids.to(dev),
            pos.to(dev),
            allowed.to(dev),
            torch.tensor(valid, dtype=torch.long, device=dev),
            torch.tensor(gather, dtype=torch.long, device=dev),
        )

    def matches(self, input_ids: torch.Tensor, logits_to_keep: int) -> bool:
        """Whether a scoring call is for exactly this micro-batch's flat inputs."""
        import torch

        return (
            logits_to_keep == self.keep
            and input_ids.shape == self.flat_ids.shape
            and bool(torch.equal(input_ids, self.flat_ids))
        )

    def attention_mask(self, attn_implementation: str | None, dtype: torch.dtype) -> torch.Tensor:
        """The 4D mask in the form the attention takes it: transformers passes a 4D mask through as is
        (``masking_utils._preprocess_mask_arguments``); eager attention adds it to the scores, so it
        must be additive floats (0 / the dtype's minimum), while SDPA takes booleans (True: attend)."""
        import torch

        if attn_implementation == "eager":
            additive = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
            return additive.masked_fill_(~self.allowed, torch.finfo(dtype).min)
        return self.allowed
