"""A batched LoRA product for mixed-adapter batches (``TransformersBackend(batched_lora=True)``).

peft's per-row selection (``adapter_names=[...]`` on the forward) runs, in every LoRA layer, one small
matmul per distinct adapter over that adapter's rows. Here every LoRA layer's adapters are stacked once
(``A``: ``(k + 1, r, in)``, ``B``: ``(k + 1, out, r)``, index 0 all zeros for rows the base model
serves), and a forward gathers each row's A and B and computes every row's delta in two batched
matmuls: ``delta = scaling[row] * (x @ A[row]^T) @ B[row]^T``, added to the frozen base layer's output.
The result is peft's to within float rounding (``lora_dropout`` is the identity in eval).

What holds: the stacks are copies, built on first use from the model's current LoRA tensors, so the
backend drops them at every weight swap (``AgentAdapters._bump_version``) and rebuilds them before the
next forward, the running batch's included after an in-place swap between two decode steps. Layers this does not cover (DoRA, LoRA bias, embeddings, adapters of
different ranks) make :func:`batched_lora` return None, and the backend keeps peft's per-row path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["BatchedLora", "batched_lora"]


class _Stack:
    """One LoRA Linear's adapters, stacked (row 0: zeros, the base model)."""

    def __init__(self, module: Any, names: Sequence[str]) -> None:
        import torch

        a = [module.lora_A[n].weight for n in names]
        b = [module.lora_B[n].weight for n in names]
        self.module = module
        self.a = torch.stack([torch.zeros_like(a[0]), *a]).detach()  # (k + 1, r, in)
        self.b = torch.stack([torch.zeros_like(b[0]), *b]).detach()  # (k + 1, out, r)
        self.scaling = torch.tensor([0.0, *(float(module.scaling[n]) for n in names)], device=self.a.device)

    def forward(self, index: Any) -> Any:
        """``module.forward`` for rows whose adapters are ``index`` (a long tensor, one per row)."""
        import torch

        a, b, scale = self.a[index], self.b[index], self.scaling[index].to(self.a.dtype)
        base = self.module.base_layer

        def run(x: Any, *args: Any, **kwargs: Any) -> Any:
            out = base(x, *args, **kwargs)
            h = x.to(a.dtype).reshape(x.shape[0], -1, x.shape[-1])  # (rows, tokens, in)
            delta = torch.bmm(torch.bmm(h, a.transpose(1, 2)), b.transpose(1, 2)) * scale[:, None, None]
            return out + delta.reshape(out.shape).to(out.dtype)

        return run


class BatchedLora:
    """The stacked adapters of a peft model; :meth:`rows` runs a forward with one adapter per row."""

    def __init__(self, stacks: list[_Stack], names: Sequence[str]) -> None:
        self.stacks = stacks
        self.index = {name: i + 1 for i, name in enumerate(names)}

    @contextlib.contextmanager
    def rows(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Inside: the model's forward applies ``adapters[i]`` (None or an unknown name: the base model)
        to row ``i`` of its input."""
        import torch

        device = self.stacks[0].a.device
        index = torch.tensor([self.index.get(a or "", 0) for a in adapters], device=device)
        for s in self.stacks:
            s.module.forward = s.forward(index)
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
