"""Continuous batching for the transformers backend: one running batch that requests join between
decode steps and leave when they finish.

Why not ``transformers``' own continuous batching (``generate_batch`` / ``init_continuous_batching``,
present in the installed 5.x)? It samples every row with one ``torch.multinomial`` on the process-wide
RNG, seeded once per manager: a request's ``seed`` cannot be honoured, a seeded request's tokens depend
on who else is in the batch, and the RNG a trainer in the same process uses is consumed. It is also
built around a paged cache and CUDA graphs, which buy nothing on CPU. agl needs per-request generators
and the exact logprob of each drawn token, so it keeps a small scheduler of its own over the model's
regular forward pass:

- The running batch is a left-padded ``DynamicCache`` with a 2-D attention mask and explicit per-row
  position ids (what ``generate`` itself does for a padded batch), so a row computes what it would
  compute alone, up to float rounding.
- New requests are prefilled together (one left-padded forward pass), draw their first token, and
  their cache rows are concatenated to the running batch (both left-padded to the longer one).
- Each decode step runs the model once on every row's last token; each row then draws its next token
  with its own sampling settings and generator (:func:`sample`); rows that end (EOS, ``max_tokens``, a
  stop string, cancellation) leave the batch and columns no row uses any more are cut off the left.

A seeded request draws from a fresh generator of its own, one uniform number per step (:func:`draw`),
exactly as when it is alone, so batching changes its tokens only through float rounding in the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl.engine.prefix_cache import MIN_HIT
from agl.lora import PEFT_ROW_ADAPTERS

__all__ = ["Batch", "BusyClock", "Row", "contiguous_head", "draw", "sample", "truncate"]


@dataclass
class Row:
    """One request's sequence in the running batch."""

    prompt_ids: list[int]
    max_new: int
    temperature: float
    top_p: float
    top_k: int | None
    generator: Any
    eos: frozenset[int] = frozenset()
    stops: Sequence[str] = ()
    #: strings that end the reply with them kept (a forced tool call's closing tag): ``ended="closed"``
    closers: Sequence[str] = ()
    #: token ids -> text, to find stop strings in the tail of the reply
    decode: Callable[[list[int]], str] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    #: the model's own logits processors (its generation config), applied to this row alone
    processors: Any = None
    #: called with (token id, logprob) as each token is drawn (streaming)
    on_token: Callable[[int, float], None] | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: why the row left: "eos", "length", "stop", "closed" or "cancelled"; None while it runs
    ended: str | None = None
    #: the caller's own record (the backend's job)
    payload: Any = None
    #: the named LoRA adapter this row decodes with (None: the base model), on a model with adapters
    adapter: str | None = None
    #: the weight version that drew each token, run-length: ``[[version, n_tokens], ...]`` in order (a
    #: weight swap between decode steps starts a new run: the rest of the reply comes from the new weights)
    versions: list[list[int]] = field(default_factory=list)
    #: the prefix cache's epoch when the row was admitted (its KV is stored when it ends only if no
    #: weight swap came between)
    kv_epoch: int = -1


def truncate(logp: Any, top_p: float, top_k: int | None) -> Any:
    """Restrict log-probs to the top-k and the nucleus ``top_p`` tokens and renormalise them."""
    import torch

    if top_k is not None and top_k < logp.size(-1):
        kth = torch.topk(logp, top_k, dim=-1).values[:, -1:]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
        cum = sorted_lp.exp().cumsum(dim=-1)
        # keep a token when the mass before it is below top_p (the top token always stays)
        drop_sorted = (cum - sorted_lp.exp()) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logp = logp.masked_fill(drop, float("-inf"))
    if top_p < 1.0 or top_k is not None:
        logp = torch.log_softmax(logp, dim=-1)
    return logp


def sample(rows: Sequence[Row], logits: Any) -> tuple[list[int], list[float]]:
    """Draw each row's next token from ``logits`` (rows x vocab) under the row's own settings.

    The recorded logprob is that of the distribution the token was drawn from: ``log_softmax(logits /
    temperature)`` after the model's processors, truncated and renormalised under ``top_p``/``top_k``;
    a greedy row (``temperature == 0``) records ``log_softmax(logits)`` and takes the argmax.

    This is the one place a next token is drawn. Each sampled row draws one uniform number from its own
    generator (:func:`draw`), so a row's tokens do not depend on the other rows of the batch; the
    softmax, the cumulative sums and the look-ups run once for the whole batch (the per-row loop of
    ``multinomial`` calls was a tenth of a decode step at batch 8, bench/README.md).
    """
    import torch

    scores = logits.float()
    if any(r.processors for r in rows):
        scores = scores.clone()
        for i, r in enumerate(rows):
            if r.processors:
                ids = torch.tensor([r.prompt_ids + r.ids], dtype=torch.long, device=scores.device)
                scores[i : i + 1] = r.processors(ids, scores[i : i + 1])
    temps = [r.temperature if r.temperature > 0 else 1.0 for r in rows]
    if all(t == 1.0 for t in temps):
        logp = torch.log_softmax(scores, dim=-1)
    else:
        logp = torch.log_softmax(scores / torch.tensor(temps, device=scores.device)[:, None], dim=-1)
    if any(r.temperature > 0 and (r.top_p < 1.0 or r.top_k is not None) for r in rows):
        logp = logp.clone()
        for i, r in enumerate(rows):
            if r.temperature > 0 and (r.top_p < 1.0 or r.top_k is not None):
                logp[i : i + 1] = truncate(logp[i : i + 1], r.top_p, r.top_k)
    drawn = [i for i, r in enumerate(rows) if r.temperature > 0]
    tokens = None if len(drawn) == len(rows) else logp.argmax(dim=-1)
    if len(drawn) == len(rows):
        tokens = draw(logp, [r.generator for r in rows])
    elif drawn:
        index = torch.tensor(drawn, device=logp.device)
        tokens[index] = draw(logp[index], [rows[i].generator for i in drawn])
    lps = logp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), lps.tolist()


def draw(logp: Any, generators: Sequence[Any]) -> Any:
    """One token per row of ``logp`` (rows x vocab log-probs), row ``i`` drawn with ``generators[i]``.

    Inverse-CDF sampling: a uniform ``u`` from the row's generator picks the first token whose
    cumulative probability exceeds ``u`` times the row's total. A token of probability zero never
    covers an interval, so it is never drawn (``right=True``: ties go past it)."""
    import torch

    cdf = logp.exp().cumsum(dim=-1)
    u = torch.cat(
        [torch.rand(1, generator=g, device=g.device) if g is not None else torch.rand(1) for g in generators]
    )
    target = (u.to(cdf.device) * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target, right=True)[:, 0]
    over = picked >= cdf.size(-1)  # u * total rounded up to the total: the last token with mass
    if bool(over.any()):
        last = cdf.size(-1) - 1 - (logp > float("-inf")).flip(-1).int().argmax(dim=-1)
        picked = torch.where(over, last, picked)
    return picked


def _cache_kwarg(model: Any) -> str:
    """The forward argument that takes the KV cache: ``cache`` in recent transformers (which warns on
    ``past_key_values``), ``past_key_values`` before."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    try:
        params = inspect.signature(type(base).forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def contiguous_head(model: Any) -> None:
    """Make the LM head's input contiguous (once per model object).

    With ``logits_to_keep=1`` the head gets ``hidden[:, -1:, :]``, a strided view. For such an input and
    a weight that does not require grad (an engine's, always), ``torch.matmul`` does not fold the batch
    into one ``mm`` but expands the weight to every row and runs ``bmm`` — for SmolLM2's 49k x 576 head in
    bf16 at 8 rows a 450 MB copy that was 60% of the prefill's time (an 8-row bf16 prefill 4x slower,
    a one-row one 2x; bench/README.md, "The engine's LoRA cost"). Copying the ``rows x hidden`` input
    instead costs nothing measurable."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "_agl_contiguous", False):
        return
    head.register_forward_pre_hook(_dense_input)
    head._agl_contiguous = True


def _dense_input(_module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The head's input with dense strides (``matmul`` folds the rows into one ``mm`` only when each
    stride is the next one's times its size; ``is_contiguous`` ignores size-1 dimensions, so a one-row
    ``hidden[:, -1:, :]`` passes it and still fails the fold)."""
    import torch

    x = args[0]
    if all(x.stride(i) == x.stride(i + 1) * x.size(i + 1) for i in range(x.dim() - 1)):
        return args
    return (x.clone(memory_format=torch.contiguous_format), *args[1:])


def _position_ids(mask: Any) -> Any:
    """Per-row positions of a left-padded batch (as ``generate`` computes them)."""
    pos = mask.long().cumsum(-1) - 1
    pos.masked_fill_(mask == 0, 1)
    return pos


class Batch:
    """The running batch: rows, their left-padded KV cache and attention mask, and their next input
    token (drawn, not yet fed to the model)."""

    def __init__(
        self, model: Any, pad_id: int, *, per_row_adapters: bool = False, lora: Any = None, prefix: Any = None
    ) -> None:
        self.model = model
        self.pad_id = pad_id
        #: a peft model with named adapters: every forward names each row's adapter (peft's per-row
        #: selection, ``PEFT_ROW_ADAPTERS``), so rows of one batch decode with different adapters
        self.per_row_adapters = per_row_adapters
        #: a :class:`~agl.engine.batched_lora.BatchedLora`: rows' adapters in two batched
        #: matmuls per LoRA layer instead of peft's per-adapter loop (None: peft's per-row selection)
        self.lora = lora
        #: a :class:`~agl.engine.prefix_cache.PrefixCache` (None: every prompt prefilled whole)
        self.prefix = prefix
        self.rows: list[Row] = []
        self.cache: Any = None
        self.mask: Any = None  # (rows, cached length) long
        self.next_tokens: list[int] = []
        self.lengths: list[int] = []  # real tokens in each row's cache
        #: the weight version the model serves now (the backend sets it after a swap between steps)
        self.version = 0
        self._logits_to_keep = True
        self._cache_arg = _cache_kwarg(model)
        contiguous_head(model)

    def __len__(self) -> int:
        return len(self.rows)

    def _forward(self, rows: Sequence[Row], input_ids: Any, mask: Any, positions: Any, cache: Any) -> Any:
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": positions,
            self._cache_arg: cache,
            # a policy trained with gradient checkpointing has use_cache=False in its config
            "use_cache": True,
        }
        if self.lora is not None:
            with self.lora.rows([r.adapter for r in rows]):
                return self._call(kwargs)
        if self.per_row_adapters:
            from agl.semconv import BASE_ADAPTER

            kwargs[PEFT_ROW_ADAPTERS] = [r.adapter or BASE_ADAPTER for r in rows]
        return self._call(kwargs)

    def _call(self, kwargs: dict[str, Any]) -> Any:
        """The model's last-position logits for ``kwargs``."""
        if self._logits_to_keep:
            try:
                return self.model(**kwargs, logits_to_keep=1).logits[:, -1, :]
            except TypeError:  # a model without logits_to_keep: all positions, keep the last
                self._logits_to_keep = False
        return self.model(**kwargs).logits[:, -1, :]

    def _new_cache(self) -> Any:
        """A ``DynamicCache`` whose full-attention layers write in place (:mod:`._kv`)."""
        from transformers import DynamicCache

        from agl.engine.kv import preallocate

        try:
            return preallocate(DynamicCache(config=self.model.config))
        except Exception:  # noqa: BLE001 - a config the cache cannot read: plain full-attention layers
            return DynamicCache()

    def joinable(self) -> bool:
        """Whether rows can join a running batch: every cache layer a plain full-attention layer
        (a sliding-window or linear-attention cache cannot be left-padded and concatenated)."""
        return self.cache is None or _plain(self.cache)

    def admit(self, rows: Sequence[Row]) -> list[Row]:
        """Prefill ``rows`` together, draw their first token, and join the ones still running to the
        batch. Returns the rows that ended on their first token (they never join).

        Rows with the same prompt and adapter are prefilled once (their cache rows and logits are
        copied), and with a :attr:`prefix` cache each distinct prompt is run from the end of its longest
        cached prefix (:mod:`._prefix_cache`)."""
        import torch

        device = next(self.model.parameters()).device
        cache = self._new_cache()
        prefix = self.prefix if self.prefix is not None and _plain(cache) else None
        where, unique = _unique(rows)
        hits = [prefix.lookup(r.adapter, r.prompt_ids) if prefix else (0, None) for r in unique]
        ids, mask, positions = self._prefill_inputs(unique, hits, cache, device)
        logits = self._forward(unique, ids, mask, positions, cache)
        if prefix is not None:
            computed = sum(len(r.prompt_ids) - n for r, (n, _) in zip(unique, hits, strict=True))
            prefix.count(sum(len(r.prompt_ids) for r in rows), computed)
            self._remember(unique, cache, mask, prefix)
            for r in rows:
                r.kv_epoch = prefix.epoch
        if len(unique) < len(rows):
            index = torch.tensor(where, device=device)
            cache.batch_select_indices(index)
            mask, logits = mask[index], logits[index]
        tokens, lps = sample(rows, logits)
        keep = [i for i, r in enumerate(rows) if not _append(r, tokens[i], lps[i], self.version)]
        ended = [r for i, r in enumerate(rows) if i not in keep]
        if not keep:
            return ended
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask = mask[index]
        new_rows = [rows[i] for i in keep]
        if self.rows:
            self._concat(cache, mask)
        else:
            self.cache, self.mask = cache, mask
        self.rows.extend(new_rows)
        self.next_tokens.extend(tokens[i] for i in keep)
        self.lengths.extend(len(r.prompt_ids) for r in new_rows)
        self._trim()
        return ended

    def _prefill_inputs(
        self, rows: Sequence[Row], hits: Sequence[tuple[int, Any]], cache: Any, device: Any
    ) -> tuple[Any, Any, Any]:
        """The prefill's input ids, attention mask and positions for ``rows``, and ``cache`` loaded with
        each row's cached prefix (``hits``: its length and entry, ``(0, None)`` for none).

        Layout, per row: ``P`` cache columns holding its prefix right-aligned (``P`` the longest hit),
        then ``S`` input columns holding the rest of its prompt right-aligned (``S`` the longest rest);
        the columns between are padding, masked out, and positions count real tokens only, so each row
        computes what its own full prefill would. Without hits, ``P`` is 0: the plain left-padded batch."""
        import torch

        longest = max(n for n, _ in hits)
        width = max(len(r.prompt_ids) - n for r, (n, _) in zip(rows, hits, strict=True))
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest + width), dtype=torch.long)
        for i, (r, (n, _)) in enumerate(zip(rows, hits, strict=True)):
            rest = r.prompt_ids[n:]
            ids[i, width - len(rest) :] = torch.tensor(rest, dtype=torch.long)
            mask[i, longest + width - len(rest) :] = 1
            mask[i, longest - n : longest] = 1
        if longest:
            _load_prefixes(cache, hits, longest)
        ids, mask = ids.to(device), mask.to(device)
        return ids, mask, _position_ids(mask)[:, longest:]

    def _remember(self, rows: Sequence[Row], cache: Any, mask: Any, prefix: Any) -> None:
        """Store each prefilled row's prompt KV in the prefix cache."""
        for i, r in enumerate(rows):
            if len(r.prompt_ids) > MIN_HIT and not prefix.has(r.adapter, r.prompt_ids):
                prefix.store(r.adapter, r.prompt_ids, _row_kv(cache, mask, i))

    def _concat(self, cache: Any, mask: Any) -> None:
        """Append another batch's cache rows to this one, left-padding the shorter one."""
        import torch
        import torch.nn.functional as F

        have, new = self.mask.shape[1], mask.shape[1]
        width = max(have, new)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            for name in ("keys", "values"):
                a, b = getattr(mine, name), getattr(theirs, name)
                a = F.pad(a, (0, 0, width - have, 0)) if have < width else a
                b = F.pad(b, (0, 0, width - new, 0)) if new < width else b
                setattr(mine, name, torch.cat([a, b], dim=0))
        self.mask = torch.cat([F.pad(self.mask, (width - have, 0)), F.pad(mask, (width - new, 0))], dim=0)

    def step(self) -> list[Row]:
        """One decode step for every row; returns the rows that ended (they have left the batch)."""
        import torch

        device = self.mask.device
        ids = torch.tensor(self.next_tokens, dtype=torch.long, device=device)[:, None]
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=1)
        positions = torch.tensor(self.lengths, dtype=torch.long, device=device)[:, None]
        logits = self._forward(self.rows, ids, self.mask, positions, self.cache)
        self.lengths = [n + 1 for n in self.lengths]
        tokens, lps = sample(self.rows, logits)
        done = [_append(r, t, lp, self.version) for r, t, lp in zip(self.rows, tokens, lps, strict=True)]
        self.next_tokens = tokens
        return self._drop([i for i, d in enumerate(done) if d])

    def cancel_ended(self) -> list[Row]:
        """Remove the rows whose request was cancelled (before spending a step on them)."""
        gone = [i for i, r in enumerate(self.rows) if r.cancel.is_set()]
        for i in gone:
            self.rows[i].ended = "cancelled"
        return self._drop(gone)

    def fail(self) -> list[Row]:
        """Empty the batch (after an error); returns the rows it held."""
        rows, self.rows = self.rows, []
        self.cache = self.mask = None
        self.next_tokens, self.lengths = [], []
        return rows

    def _drop(self, indices: list[int]) -> list[Row]:
        import torch

        if not indices:
            return []
        gone = [self.rows[i] for i in indices]
        if self.prefix is not None:
            self._remember_ended(indices)
        keep = [i for i in range(len(self.rows)) if i not in set(indices)]
        if not keep:
            self.fail()
            return gone
        index = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.rows = [self.rows[i] for i in keep]
        self.next_tokens = [self.next_tokens[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        self._trim()
        return gone

    def _remember_ended(self, indices: Sequence[int]) -> None:
        """Store the KV of rows that ended normally (prompt + reply but the last token, which was never
        fed), when every token came from the weights the cache holds (the next turn of a conversation
        starts with them)."""
        prefix = self.prefix
        for i in indices:
            r = self.rows[i]
            if r.ended not in ("eos", "length", "stop", "closed") or r.kv_epoch != prefix.epoch:
                continue
            if len(r.versions) != 1 or r.versions[0][0] != self.version:
                continue
            seq = r.prompt_ids + r.ids[:-1]
            if prefix.has(r.adapter, seq):
                continue
            kv = _row_kv(self.cache, self.mask, i)
            if kv and kv[0][0].shape[-2] == len(seq):
                prefix.store(r.adapter, seq, kv)

    def _trim(self) -> None:
        """Cut the leading cache columns that are padding in every row (plain layers only: a
        sliding-window layer keeps fewer columns than the mask has)."""
        if not self.joinable():
            return
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0, 0]) if used.numel() else 0
        if first > 0:
            for layer in self.cache.layers:
                layer.keys = layer.keys[..., first:, :]
                layer.values = layer.values[..., first:, :]
            self.mask = self.mask[:, first:]


def _unique(rows: Sequence[Row]) -> tuple[list[int], list[Row]]:
    """Rows with distinct (adapter, prompt), and for each row the index of its distinct one."""
    first: dict[tuple[Any, tuple[int, ...]], int] = {}
    unique: list[Row] = []
    where: list[int] = []
    for r in rows:
        key = (r.adapter, tuple(r.prompt_ids))
        if key not in first:
            first[key] = len(unique)
            unique.append(r)
        where.append(first[key])
    return where, unique


def _plain(cache: Any) -> bool:
    """Whether every layer of ``cache`` is a plain full-attention layer: rows can be padded,
    concatenated and given a cached prefix (a sliding-window or linear-attention layer keeps other
    state)."""
    from transformers.cache_utils import DynamicLayer

    from agl.engine.kv import SlackLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) in (DynamicLayer, SlackLayer) for layer in layers)


def _load_prefixes(cache: Any, hits: Sequence[tuple[int, Any]], width: int) -> None:
    """Fill each layer of a fresh ``cache`` with ``width`` columns: row ``i``'s cached prefix of
    ``hits[i][0]`` tokens right-aligned, zeros elsewhere (masked out)."""
    import torch

    sample_entry = next(e for n, e in hits if n)
    for j, layer in enumerate(cache.layers):
        k0, v0 = sample_entry.layers[j]
        keys = torch.zeros((len(hits), k0.shape[1], width, k0.shape[3]), dtype=k0.dtype, device=k0.device)
        values = torch.zeros((len(hits), v0.shape[1], width, v0.shape[3]), dtype=v0.dtype, device=v0.device)
        for i, (n, entry) in enumerate(hits):
            if n:
                k, v = entry.layers[j]
                keys[i, :, width - n :] = k[0, :, :n]
                values[i, :, width - n :] = v[0, :, :n]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values


def _row_kv(cache: Any, mask: Any, i: int) -> list[tuple[Any, Any]]:
    """Row ``i``'s keys and values at its real (unmasked) columns, per layer, as new tensors."""
    cols = mask[i].nonzero()[:, 0]
    out = []
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        if keys is None or keys.dim() != 4 or keys.shape[-2] != mask.shape[1]:
            return []
        out.append((keys[i : i + 1].index_select(2, cols), values[i : i + 1].index_select(2, cols)))
    return out


def _append(row: Row, token: int, logprob: float, version: int = 0) -> bool:
    """Record a drawn token, drawn by weight ``version`` (and stream it); returns whether the row has
    ended."""
    row.ids.append(token)
    row.logprobs.append(logprob)
    if row.versions and row.versions[-1][0] == version:
        row.versions[-1][1] += 1
    else:
        row.versions.append([version, 1])
    if row.on_token is not None:
        row.on_token(token, logprob)
    end: str | None = None
    if token in row.eos:
        end = "eos"
    elif row.cancel.is_set():
        end = "cancelled"
    elif len(row.ids) >= row.max_new:
        end = "length"
    elif (row.stops or row.closers) and row.decode is not None:
        tail = row.decode(row.ids[-32:])
        if any(s in tail for s in row.stops):
            end = "stop"
        elif any(c in tail for c in row.closers):
            end = "closed"
    row.ended = end
    return end is not None


class BusyClock:
    """Seconds an engine spent generating, the running pass counted up to now.

    Under continuous load one scheduler pass can last a whole training run; counted only when it ends,
    all of it would go to the step it ends in, and a step's busy share could exceed its wall time."""

    def __init__(self) -> None:
        self._done_s = 0.0
        self._since: float | None = None  # perf_counter() at the start of the running pass

    def start(self) -> None:
        self._since = time.perf_counter()

    def stop(self) -> None:
        since, self._since = self._since, None
        if since is not None:
            self._done_s += time.perf_counter() - since

    @property
    def seconds(self) -> float:
        since = self._since
        return self._done_s + (time.perf_counter() - since if since is not None else 0.0)
