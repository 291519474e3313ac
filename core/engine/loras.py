"""Named LoRA adapters the transformers backend serves beside its base model (an adapter per agent,
``agl gateway serve --adapter writer=DIR``): checked before anything loads, then loaded by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agl.lora import check_lora_dirs

__all__ = ["AgentAdapters", "load_named_adapters", "with_adapters"]


def with_adapters(model: Any, paths: dict[str, str]) -> Any:
    """``model`` wrapped by peft with each named adapter loaded from its folder."""
    from peft import PeftModel

    items = list(paths.items())
    name, path = items[0]
    model = PeftModel.from_pretrained(model, path, name)
    for name, path in items[1:]:
        model.load_adapter(path, name)
    return model


def load_named_adapters(model: Any, paths: dict[str, str], device: Any) -> Any:
    """``model`` serving each named adapter's weights from its folder: an adapter it already has gets
    the folder's tensors in place (no new modules), a new one is loaded beside the others."""
    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    for name, path in paths.items():
        if isinstance(model, PeftModel) and name in model.peft_config:
            state = load_file(str(Path(path) / "adapter_model.safetensors"), device=str(device))
            set_peft_model_state_dict(model, state, name)
        elif isinstance(model, PeftModel):
            model.load_adapter(path, name)
        else:
            model = PeftModel.from_pretrained(model, path, name)
    model.eval()
    return model


class AgentAdapters:
    """The transformers backend's agent-adapter swaps and batched-LoRA stacks (a mixin: it uses the
    backend's ``model``, ``device``, ``agent_adapters``, ``batched_lora``, ``_swap`` and
    ``_bump_version``)."""

    model: Any
    agent_adapters: list[str]
    batched_lora: bool
    _lora_stack: Any

    async def load_agent_adapters(self, paths: dict[str, str], *, version: int | None = None) -> int:
        """New weights for agent adapters (``{adapter: peft folder}``, checked first), swapped together
        once the running batch drained, as one version: a served adapter gets the tensors in place, a
        new one is added beside the others."""
        check_lora_dirs(paths)

        def swap() -> int:
            self.model = load_named_adapters(self.model, paths, self.device)  # type: ignore[attr-defined]
            self.agent_adapters += [n for n in paths if n not in self.agent_adapters]
            return int(self._bump_version(version))  # type: ignore[attr-defined]

        return int(await self._swap(swap))  # type: ignore[attr-defined]

    def _stacked_adapters(self) -> Any:
        """The agent adapters stacked for the batched LoRA product, or None (off, no agent adapters, or
        layers it cannot stack: peft's per-row path); built on first use after each swap."""
        if not (self.batched_lora and self.agent_adapters):
            return None
        if self._lora_stack is None:
            from agl.engine.batched_lora import batched_lora

            self._lora_stack = batched_lora(self.model, self.agent_adapters)
        return self._lora_stack

    def _bump_version(self, version: int | None) -> int:
        """Every swap ends here, in the worker thread, after the tensors changed: the stacks (copies)
        are dropped, so the next forward (or the running batch, after an in-place swap) rebuilds them."""
        self._lora_stack = None
        return int(super()._bump_version(version))  # type: ignore[misc]
