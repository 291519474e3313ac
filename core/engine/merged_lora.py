"""An engine copy of a LoRA policy with its adapter merged into the base weights.

Through peft, every LoRA'd linear layer of a forward pass runs its base matmul plus four more small
ops (dropout, A, B, the scaled add). On this project's CPU that made SmolLM2's decode step at 8 rows
1.5x slower in fp32 and its 8-row prefill 2.5x slower in bf16 than the same model without the
adapter (bench/README.md, "The engine's LoRA cost"). An engine serving in another dtype than the
policy's holds a copy of every weight anyway (:func:`agl.engine.dtype.engine_copy`), so it
can hold them merged at no memory cost: ``W = W0 + scaling * B @ A``, computed in the policy's
(fp32) precision and cast once, which is no further from the policy than running the adapter in bf16.
Each push recomputes the merged weights of the LoRA'd layers in place (the base weights never
change under LoRA training).

Only a plain single-adapter LoRA is merged: several adapters (an adapter per agent: rows pick theirs),
DoRA, LoRA on biases or ``modules_to_save``, and non-Linear LoRA layers keep the unmerged copy.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["Merged", "merged_copy", "policy_copy"]

_PREFIX = "base_model.model."


class Merged:
    """The merged engine model and, per LoRA'd layer, the engine's linear and the policy's LoRA layer."""

    def __init__(self, model: Any, pairs: list[tuple[Any, Any, str]]) -> None:
        self.model = model
        self.pairs = pairs

    def refresh(self) -> None:
        """Recompute every merged weight from the policy's current adapter (in place, cast)."""
        import torch

        with torch.no_grad():
            for dst, lora, adapter in self.pairs:
                base = lora.get_base_layer().weight
                dst.weight.copy_(base + lora.get_delta_weight(adapter).to(base.dtype))


def _mergeable(source: Any) -> str | None:
    """The adapter name of a plain single-adapter LoRA peft model, else None."""
    try:
        from peft import PeftModel
    except ImportError:
        return None
    if not isinstance(source, PeftModel) or len(getattr(source, "peft_config", {})) != 1:
        return None
    name, cfg = next(iter(source.peft_config.items()))
    if (
        getattr(cfg, "peft_type", None) is None
        or str(getattr(cfg.peft_type, "value", cfg.peft_type)) != "LORA"
    ):
        return None
    if getattr(cfg, "use_dora", False) or getattr(cfg, "bias", "none") != "none" or cfg.modules_to_save:
        return None
    return str(name)


def merged_copy(source: Any, dtype: Any) -> Merged | None:
    """A copy of the peft model ``source`` in ``dtype`` with its adapter merged (no peft modules left),
    or None when ``source`` is not a mergeable LoRA model (see the module docstring)."""
    import torch
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    adapter = _mergeable(source)
    if adapter is None:
        return None
    layers = [(n, m) for n, m in source.named_modules() if isinstance(m, LoraLayer)]
    if not layers or any(type(m) is not LoraLinear for _, m in layers):
        return None
    base = source.get_base_model()
    with torch.no_grad():
        engine = copy.deepcopy(base)
        # the copy's LoRA layers become plain linears holding the base weights (to be merged below)
        for name, _ in layers:
            inner = name[len(_PREFIX) :] if name.startswith(_PREFIX) else name
            parent_name, _, child = inner.rpartition(".")
            parent = engine.get_submodule(parent_name) if parent_name else engine
            setattr(parent, child, getattr(parent, child).get_base_layer())
        engine = engine.to(dtype)
    pairs = []
    for name, lora in layers:
        inner = name[len(_PREFIX) :] if name.startswith(_PREFIX) else name
        dst = engine.get_submodule(inner)
        if not isinstance(dst, torch.nn.Linear) or dst.weight.shape != lora.get_base_layer().weight.shape:
            return None
        pairs.append((dst, lora, adapter))
    merged = Merged(engine, pairs)
    merged.refresh()
    return merged


def policy_copy(policy: Any, dtype: Any) -> tuple[Any, Merged | None]:
    """The engine's model for ``policy``: in another dtype than the policy's and with one plain LoRA
    adapter, a copy with the adapter merged (and its :class:`Merged` to refresh on each push); else
    :func:`~agl.engine.dtype.engine_copy` (frozen weights shared when the dtype is the
    policy's)."""
    from agl.engine.dtype import engine_copy, inference_only

    source = policy.model
    if (
        dtype is not None
        and dtype != next(source.parameters()).dtype
        and not getattr(policy, "adapters", None)
    ):
        merged = merged_copy(source, dtype)
        if merged is not None:
            merged.model = inference_only(merged.model)
            return merged.model, merged
    return engine_copy(source, dtype), None
