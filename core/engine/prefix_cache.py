"""Recent sequences' KV cache, so a prompt that starts like an earlier one is prefilled from there.

An agent's prompts repeat themselves: every member of a GRPO group sends the same prompt, every task of
a run shares the system prompt and the few-shot turns, and each turn of a conversation extends the one
before. On CPU a prompt's prefill is the largest part of a short call (the main job's calls: a 96-token
prefill took 2-4 decode steps' time, and prefills were ~60% of the engine's busy time,
bench/README.md). :class:`PrefixCache` keeps the keys and values of recent prompts (and of finished
rows: prompt + reply), per adapter; a new row takes the longest cached prefix of its prompt and the model
runs on the rest only (:meth:`agl.engine.batching.Batch.admit`).

What holds:

- A token's keys and values depend only on the tokens before it (causal attention) and on the weights,
  so a cached prefix is what the row's own prefill would compute, up to float rounding (the same
  rounding a different batch composition already gives). Sampling and the recorded log-probs are
  unchanged in kind: the log-prob of the distribution the token was drawn from.
- Entries are only reused under the weights that computed them: every weight swap clears the cache
  (:meth:`clear`, from the backend's version bump), and a row whose tokens span a swap is not stored.
- At least the prompt's last token is always recomputed (its logits draw the first token).
- Memory is bounded by ``budget_bytes`` (least recently used entries go first); an entry whose
  tokens extend another's replaces it (the shorter is a prefix of the longer, so nothing is lost).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MIN_HIT", "Entry", "PrefixCache"]

#: shorter common prefixes are not worth the extra padded columns
MIN_HIT = 8


@dataclass
class Entry:
    """One cached sequence: its token ids and, per layer, its keys and values ``(1, heads, n, dim)``."""

    ids: tuple[int, ...]
    layers: list[tuple[Any, Any]]
    nbytes: int


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """An LRU of sequences' KV tensors, looked up by longest common prefix (see the module docstring).

    Used from the engine's worker thread only (admission, rows ending, and weight swaps all run
    there), so it takes no lock."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes!r}")
        self.budget_bytes = int(budget_bytes)
        self._entries: OrderedDict[tuple[Any, tuple[int, ...]], Entry] = OrderedDict()
        self.nbytes = 0
        #: bumped by every :meth:`clear`: a row admitted in another epoch is not stored
        self.epoch = 0
        #: prompt tokens admitted, and of those not run through the model (a cached prefix, or a row with
        #: the same prompt as another row of its admission)
        self.prompt_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every entry (the weights changed)."""
        self._entries.clear()
        self.nbytes = 0
        self.epoch += 1

    def lookup(self, adapter: Any, ids: Sequence[int]) -> tuple[int, Entry | None]:
        """The longest cached prefix of ``ids`` under ``adapter``, at most ``len(ids) - 1`` tokens (the
        last is always computed) and at least :data:`MIN_HIT`; ``(0, None)`` when there is none."""
        best, found = 0, None
        cap = len(ids) - 1
        for (who, _), entry in self._entries.items():
            if who != adapter or not entry.ids or entry.ids[0] != ids[0]:
                continue
            n = min(_common(entry.ids, ids), cap)
            if n > best:
                best, found = n, entry
        if best < MIN_HIT or found is None:
            return 0, None
        self._entries.move_to_end((adapter, found.ids))
        return best, found

    def count(self, prompt_tokens: int, computed: int) -> None:
        """Record an admission: ``prompt_tokens`` prompt tokens, of which the model ran on ``computed``."""
        self.prompt_tokens += prompt_tokens
        self.hit_tokens += prompt_tokens - computed

    def has(self, adapter: Any, ids: Sequence[int]) -> bool:
        """Whether exactly ``ids`` is cached under ``adapter`` (then marked recently used)."""
        key = (adapter, tuple(ids))
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        return False

    def store(self, adapter: Any, ids: Sequence[int], layers: list[tuple[Any, Any]]) -> None:
        """Keep ``layers`` (per layer ``(keys, values)``, ``(1, heads, len(ids), dim)``, owned by the
        cache) as the KV of ``ids`` under ``adapter``."""
        key = (adapter, tuple(ids))
        if len(key[1]) < MIN_HIT + 1:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        for who, other in list(self._entries):  # a cached prefix of ids: superseded
            if who == adapter and len(other) < len(key[1]) and key[1][: len(other)] == other:
                self._drop((who, other))
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if nbytes > self.budget_bytes:
            return
        while self._entries and self.nbytes + nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = Entry(key[1], layers, nbytes)
        self.nbytes += nbytes

    def _drop(self, key: tuple[Any, tuple[int, ...]]) -> None:
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes

    def stats(self) -> dict[str, float]:
        """Prompt tokens admitted, those taken from the cache, and the cache's size now."""
        return {
            "prompt_tokens": float(self.prompt_tokens),
            "prefix_hit_tokens": float(self.hit_tokens),
            "prefix_entries": float(len(self._entries)),
            "prefix_bytes": float(self.nbytes),
        }
