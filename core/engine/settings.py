"""``EngineSettings``: every setting of the embedded transformers engine, with its default, in one place.

One value travels whole from where a user states it to the engine that honours it: ``Serving.engine``
(:class:`agl.run.settings.Serving`) in a run, the Trainer's ``Serving`` to the run environment, then
:func:`agl.gateway.backends.from_spec` and ``TransformersBackend(settings=...)``. The flags of ``agl
train`` and ``agl gateway serve`` (and the examples' ``train``) are generated from these fields
(:func:`agl.cli.config_args.add_engine_arguments`), so a flag, a config file key and a field share one
name and one help text. Each default is a module constant written once here; the values are checked
once, in ``__post_init__``, with one error type (:class:`agl.errors.UsageError`) naming the field.

A backend other than the embedded engine (vLLM, scripted, a hosted endpoint) honours none of them: a
non-default value asked of it is refused by name (:meth:`EngineSettings.check_backend`), never ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from agl.engine.dtype import DTYPE_NAMES
from agl.errors import UsageError

__all__ = [
    "DEFAULT_BATCHED_LORA",
    "DEFAULT_DETERMINISTIC",
    "DEFAULT_DTYPE",
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_PREFIX_CACHE_MB",
    "DEFAULT_THREADS",
    "ENGINE_BACKEND",
    "EngineSettings",
]

#: None: a model loaded from files in bf16 on CUDA and fp32 on CPU; a policy's copy in its own dtype
DEFAULT_DTYPE: str | None = None
#: MB of recent prompts' KV kept for prompts that start alike (agl.engine.prefix_cache)
DEFAULT_PREFIX_CACHE_MB = 128.0
DEFAULT_BATCHED_LORA = False
DEFAULT_DETERMINISTIC = False
#: rows generated together (continuous batching, agl.engine.batching)
DEFAULT_MAX_BATCH_SIZE = 8
#: torch's intra-op threads (0: torch's own choice)
DEFAULT_THREADS = 0

#: the one backend that honours these settings
ENGINE_BACKEND = "transformers"


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class EngineSettings:
    """The embedded transformers engine's settings (see the field help texts); frozen, so the value a
    run was configured with is the value its engine serves with."""

    dtype: str | None = field(
        default=DEFAULT_DTYPE,
        metadata=_help(
            "the dtype the embedded engine computes in: auto (bf16 where the hardware has native bf16: "
            f"CUDA, a CPU with AMX/AVX512-BF16; fp32 elsewhere) or {', '.join(DTYPE_NAMES)}; default: "
            "bf16 on CUDA, fp32 on CPU, and a trained policy's own dtype (its frozen weights shared). "
            "Another dtype than the policy's trains by decoupled PPO against the update's own log-probs"
        ),
    )
    prefix_cache_mb: float = field(
        default=DEFAULT_PREFIX_CACHE_MB,
        metadata=_help(
            "MB of recent prompts' (and finished turns') KV the embedded engine keeps, so a prompt "
            "starting like an earlier one (a group's members, a shared system prompt, a conversation's "
            "next turn) is prefilled from there; 0: off"
        ),
    )
    batched_lora: bool = field(
        default=DEFAULT_BATCHED_LORA,
        metadata=_help(
            "an adapter per agent: rows of one batch that use different adapters share one batched LoRA "
            "product (two bmm per LoRA layer) instead of peft's per-adapter loop"
        ),
    )
    deterministic: bool = field(
        default=DEFAULT_DETERMINISTIC,
        metadata=_help(
            "batch-invariant generation (one row at a time), so a seeded run reproduces token for token "
            "whatever the runners' timing; slower (see the training guide)"
        ),
    )
    max_batch_size: int = field(
        default=DEFAULT_MAX_BATCH_SIZE,
        metadata=_help("the most requests the embedded engine generates together"),
    )
    threads: int = field(
        default=DEFAULT_THREADS,
        metadata=_help("torch CPU threads (0: torch's choice; 1 is best on a busy CPU)"),
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        mb = self.prefix_cache_mb
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not (math.isfinite(mb) and mb >= 0):
            raise UsageError(
                f"EngineSettings.prefix_cache_mb must be a finite number >= 0 (0: off), got {mb!r}"
            )
        object.__setattr__(self, "prefix_cache_mb", float(mb))
        for name in ("batched_lora", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"EngineSettings.{name} must be True or False, got {getattr(self, name)!r}")
        for name, lo in (("max_batch_size", 1), ("threads", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise UsageError(f"EngineSettings.{name} must be an integer >= {lo}, got {value!r}")

    @property
    def rows(self) -> int:
        """The most rows a batch runs: one under ``deterministic`` (a padded batch's logits differ in
        the last bits), else ``max_batch_size``."""
        return 1 if self.deterministic else self.max_batch_size

    @property
    def prefix_cache_bytes(self) -> int:
        """The prefix cache's budget; 0 (off) under ``deterministic``: a cached prefix was computed in
        another batch, so its last bits may differ from the row's own prefill."""
        return 0 if self.deterministic else int(self.prefix_cache_mb * 2**20)

    def changed(self) -> dict[str, Any]:
        """The settings that differ from their defaults, ``{name: value}``."""
        default = EngineSettings()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }

    def check_backend(self, backend: Any) -> None:
        """Refuse, by name, a setting that ``backend`` (a backend's name, or a backend instance, which is
        built already) cannot honour: every non-default one, on anything but the transformers engine
        that is made from these settings."""
        if isinstance(backend, str) and backend == ENGINE_BACKEND:
            return
        changed = self.changed()
        if not changed:
            return
        what = (
            f"backend={backend!r}"
            if isinstance(backend, str)
            else f"a {type(backend).__name__} built already"
        )
        asked = ", ".join(f"{k}={v!r}" for k, v in changed.items())
        note = (
            "; vLLM honours each call's seed, and its own batch invariance is a vLLM setting"
            if "deterministic" in changed
            else ""
        )
        raise UsageError(
            f"EngineSettings {asked}: options of the embedded transformers engine, which {what} "
            f"cannot honour (serve with backend='transformers', or leave them at their defaults){note}"
        )


def _dtype_name(value: Any) -> str | None:
    """``value`` as the engine's dtype name: None, ``"auto"``, or the torch name of a known dtype name
    (``bf16`` is bfloat16) or of a ``torch.dtype``; anything else is refused, naming the field."""
    if value is None:
        return None
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        value = str(value).removeprefix("torch.")
    name = value.lower() if isinstance(value, str) else None
    if name == "auto":
        return name
    if name not in DTYPE_NAMES:
        raise UsageError(
            f"EngineSettings.dtype must be None, 'auto' or one of {', '.join(DTYPE_NAMES)}, got {value!r}"
        )
    return DTYPE_NAMES[name]
