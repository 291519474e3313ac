"""Which dtype the embedded engine serves in.

``dtype="auto"`` serves in bfloat16 where the hardware computes it natively — a CUDA device, or a CPU
with AVX512-BF16 or AMX tiles, where a bf16 matmul runs about twice as fast as an fp32 one (the
engine's profile in bench/README.md) — and in float32 elsewhere (emulated bf16 on a CPU without those
units is slower than fp32). ``None`` keeps the previous rule: bf16 on CUDA, fp32 on CPU, and a model
object (a policy the engine shares) served in its own dtype.

Serving in another dtype than the trainer's changes the log-probs the engine records (bf16 rounding),
never which distribution a token was drawn from: the recorded log-prob is still that of the
distribution sampled. The trainer sees the difference (:func:`serves_other_dtype`) and trains by
decoupled PPO against its own log-probs, as it does for vLLM (``Steps.update``).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DTYPE_NAMES",
    "cpu_has_native_bf16",
    "engine_copy",
    "inference_only",
    "resolve_dtype",
    "serves_other_dtype",
]

#: the dtype names the engine takes (``"auto"`` besides), each to its torch name
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), as torch detects it."""
    import torch

    cpu = getattr(torch, "cpu", None)
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        fn = getattr(cpu, probe, None)
        try:
            if fn is not None and fn():
                return True
        except Exception:  # noqa: BLE001 - a torch without the probe: assume not
            continue
    return False


def resolve_dtype(spec: Any, device: str) -> Any:
    """The torch dtype for ``spec`` (None, ``"auto"``, a dtype name or a ``torch.dtype``) on ``device``;
    None when a model object should keep its own (``spec`` None)."""
    import torch

    if spec is None:
        return None
    if isinstance(spec, torch.dtype):
        return spec
    name = str(spec).lower()
    if name == "auto":
        native = device.startswith("cuda") or cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPE_NAMES)}, got {spec!r}")
    return getattr(torch, DTYPE_NAMES[name])


def serves_other_dtype(backend: Any, policy: Any) -> bool:
    """Whether ``backend`` (the in-process engine) computes in another dtype than ``policy``'s model:
    its recorded log-probs then carry that dtype's rounding, and the update corrects for it."""
    engine = getattr(backend, "serving_dtype", None)
    model = getattr(policy, "model", None)
    if engine is None or model is None:
        return False
    try:
        return next(model.parameters()).dtype != engine
    except (StopIteration, TypeError, AttributeError):
        return False


def engine_copy(source: Any, dtype: Any = None) -> Any:
    """A copy of ``source`` for inference that shares its frozen parameters and copies the rest; in
    ``dtype`` when that is not ``source``'s (then nothing is shared: every tensor is cast)."""
    import copy

    import torch

    if dtype is not None and dtype != next(source.parameters()).dtype:
        with torch.no_grad():
            engine = copy.deepcopy(source).to(dtype)
        return inference_only(engine)
    memo: dict[int, Any] = {id(p): p for p in source.parameters() if not p.requires_grad}
    # buffers of frozen modules (e.g. rotary tables) are shared too; they never change
    memo.update({id(b): b for b in source.buffers()})
    with torch.no_grad():
        engine = copy.deepcopy(source, memo)
    return inference_only(engine)


def inference_only(engine: Any) -> Any:
    """``engine`` without the training model's patched forwards or trainable flags, in eval mode."""
    for module in engine.modules():
        # TRL patches ``forward`` on the training model's instance (its fused LM head); the copy must run
        # its own class's forward, not a closure bound to the training model
        module.__dict__.pop("forward", None)
    for p in engine.parameters():
        if p.requires_grad:
            p.requires_grad_(False)
    engine.eval()
    return engine
