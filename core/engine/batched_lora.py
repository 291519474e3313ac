"""A batched LoRA product for mixed-adapter batches (``TransformersBackend(batched_lora=True)``).

peft's per-row selection (:data:`agl.lora.PEFT_ROW_ADAPTERS` on the forward) runs, in every LoRA layer, one small
matmul per distinct adapter over that adapter's rows. Here every LoRA layer's ``k`` adapters are
concatenated once (``A``: ``(k·r, in)``, ``B``: ``(k·r, out)``), and a forward computes every row's
delta in two dense matmuls over the whole batch, with a per-row mask that keeps only the row's own
adapter's ``r`` columns, scaled::

    delta = ((x @ A^T) * mask[row]) @ B        # mask[row]: scaling on the row's block, 0 elsewhere

Rows the base model serves get an all-zero mask. The result is peft's to within float rounding
(``lora_dropout`` is the identity in eval). Why not gather each row's A and B (a batched matmul per
row)? Decoding is memory-bound: the gather copies ``rows × (r·in + out·r)`` floats per layer and
step, 8 rows × 4 adapters read each adapter twice over; the concatenation reads each adapter's
weights once per step, in GEMMs the BLAS runs well. Only the block range spanning the adapters
present in the batch is used (a view), so a batch of one adapter costs what that adapter alone does.

What holds: the concatenations are copies, built on first use from the model's current LoRA tensors,
so the backend drops them at every weight swap (``Engine._bump_version``) and rebuilds them
before the next forward, the running batch's included after an in-place swap between two decode
steps. Layers this does not cover (DoRA, LoRA bias, embeddings, adapters of different ranks) make
:func:`batched_lora` return None, and the backend keeps peft's per-row path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["BatchedLora", "batched_lora"]


class _Stack:
    """One LoRA Linear's adapters, concatenated along the rank (block ``i`` is adapter ``i``)."""

    def __init__(self, module: Any, names: Sequence[str]) -> None:
        import torch

        self.module = module
        self.r = int(module.r[names[0]])
        self.a = torch.cat([module.lora_A[n].weight for n in names]).detach()  # (k·r, in)
        self.b = torch.cat([module.lora_B[n].weight.t() for n in names]).detach().contiguous()  # (k·r, out)
        self.scaling = tuple(float(module.scaling[n]) for n in names)

    def forward(self, mask: Any, lo: int, hi: int) -> Any:
        """``module.forward`` for rows masked by ``mask`` (``(rows, (hi - lo)·r)``), blocks lo..hi-1."""
        import torch

        a, b = self.a[lo * self.r : hi * self.r], self.b[lo * self.r : hi * self.r]
        base = self.module.base_layer

        def run(x: Any, *args: Any, **kwargs: Any) -> Any:
            out = base(x, *args, **kwargs)
            h = x.to(a.dtype).reshape(x.shape[0], -1, x.shape[-1])  # (rows, tokens, in)
            delta = torch.matmul(torch.matmul(h, a.t()) * mask[:, None, :], b)
            return out + delta.reshape(out.shape).to(out.dtype)

        return run

    def base_only(self) -> Any:
        """``module.forward`` for a batch with no adapter row: the frozen layer alone (a function,
        not the layer itself: assigning a module would register it as a submodule)."""
        base = self.module.base_layer

        def run(x: Any, *args: Any, **kwargs: Any) -> Any:
            return base(x, *args, **kwargs)

        return run


class BatchedLora:
    """The concatenated adapters of a peft model; :meth:`rows` runs a forward with one adapter per row."""

    def __init__(self, stacks: list[_Stack], names: Sequence[str]) -> None:
        self.stacks = stacks
        self.index = {name: i for i, name in enumerate(names)}

    def _masks(self, blocks: list[int | None], lo: int, hi: int) -> dict[tuple[float, ...], Any]:
        """One ``(rows, (hi - lo)·r)`` mask per distinct scaling vector (usually one for all layers)."""
        import torch

        first = self.stacks[0].a
        r, masks = self.stacks[0].r, {}
        for scaling in {s.scaling for s in self.stacks}:
            mask = torch.zeros(len(blocks), (hi - lo) * r, dtype=first.dtype, device=first.device)
            for row, block in enumerate(blocks):
                if block is not None:
                    mask[row, (block - lo) * r : (block - lo + 1) * r] = scaling[block]
            masks[scaling] = mask
        return masks

    @contextlib.contextmanager
    def rows(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Inside: the model's forward applies ``adapters[i]`` (None or an unknown name: the base model)
        to row ``i`` of its input."""
        blocks = [self.index.get(a or "") for a in adapters]
        present = [b for b in blocks if b is not None]
        if present:
            lo, hi = min(present), max(present) + 1
            masks = self._masks(blocks, lo, hi)
            for s in self.stacks:
                s.module.forward = s.forward(masks[s.scaling], lo, hi)
        else:  # every row on the base model: the frozen layers alone, whatever peft has active
            for s in self.stacks:
                s.module.forward = s.base_only()
        try:
            yield
        finally:
            for s in self.stacks:
                s.module.__dict__.pop("forward", None)


def batched_lora(model: Any, names: Sequence[str]) -> BatchedLora | None:
    """The stacked adapters ``names`` of ``model`` (a peft model), or None where a layer cannot be
    stacked (see the module docstring) or the model has no LoRA layer."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora.layer import LoraLayer

    if not names:
        return None
    stacks = []
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        if not isinstance(module, LoraLinear) or not all(n in module.lora_A for n in names):
            return None
        if any(module.use_dora.get(n) for n in names) or any(
            getattr(module, "lora_bias", {}).get(n) for n in names
        ):
            return None
        if len({module.r[n] for n in names}) != 1:
            return None
        stacks.append(_Stack(module, names))
    return BatchedLora(stacks, names) if stacks else None
