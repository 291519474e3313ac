"""Named LoRAs the embedded engine serves beside its base model (a LoRA per agent, ``agl gateway serve
--adapter writer=DIR``): checked before anything loads, then loaded by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agl.lora import check_lora_dirs

__all__ = ["AgentLoras", "load_named_loras", "with_loras"]


def with_loras(model: Any, paths: dict[str, str]) -> Any:
    """``model`` wrapped by peft with each named LoRA loaded from its folder."""
    from peft import PeftModel

    items = list(paths.items())
    name, path = items[0]
    model = PeftModel.from_pretrained(model, path, name)
    for name, path in items[1:]:
        model.load_adapter(path, name)
    return model


def load_named_loras(model: Any, paths: dict[str, str], device: Any) -> Any:
    """``model`` serving each named LoRA's weights from its folder: a LoRA it already has gets the
    folder's tensors in place (no new modules), a new one is loaded beside the others."""
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


class AgentLoras:
    """The engine's agent-LoRA swaps and batched-LoRA stacks (a mixin: it uses the engine's ``model``,
    ``device``, ``lora_names``, ``settings.batched_lora``, ``_swap`` and ``_bump_version``, which drops
    ``_lora_stack`` after every swap)."""

    model: Any
    #: the named LoRAs served beside the base model (one per agent)
    lora_names: list[str]
    settings: Any
    _lora_stack: Any

    async def load_agent_loras(self, paths: dict[str, str], *, version: int | None = None) -> int:
        """New weights for agent LoRAs (``{name: peft folder}``, checked first), swapped together once
        the running batch drained, as one version: a served LoRA gets the tensors in place, a new one
        is added beside the others."""
        check_lora_dirs(paths)

        def swap() -> int:
            self.model = load_named_loras(self.model, paths, self.device)  # type: ignore[attr-defined]
            self.lora_names += [n for n in paths if n not in self.lora_names]
            return int(self._bump_version(version))  # type: ignore[attr-defined]

        return int(await self._swap(swap))  # type: ignore[attr-defined]

    def _stacked_loras(self) -> Any:
        """The agent LoRAs stacked for the batched LoRA product, or None (off, no agent LoRAs, or
        layers it cannot stack: peft's per-row path); built on first use after each swap."""
        if not (self.settings.batched_lora and self.lora_names):
            return None
        if self._lora_stack is None:
            from agl.engine.batched_lora import batched_lora

            self._lora_stack = batched_lora(self.model, self.lora_names)
        return self._lora_stack
