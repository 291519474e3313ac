"""Loading the embedded engine's model and tokenizer, and reading weight files for a swap.

:func:`load` turns what a user gave (None for the default SmolLM2-135M-Instruct, a local path or hub id
in the offline cache, or a loaded ``PreTrainedModel``; a tokenizer or None) into a :class:`Loaded`: the
model in eval mode on its device and dtype, a :class:`~agl.chat.tokenizer.ChatTokenizer`, the model's
name, its context limit and the ids that end or pad a row. It runs in the engine's worker thread (a
model from files) or in the constructor (a model object), never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl.chat.tokenizer import ChatTokenizer, load_default_tokenizer
from agl.engine.dtype import resolve_dtype
from agl.engine.loras import with_loras

__all__ = ["Loaded", "load", "read_weights", "trainable"]


@dataclass
class Loaded:
    """A model ready to serve and what the engine derives from it once."""

    model: Any
    tokenizer: ChatTokenizer
    model_name: str
    #: the longest prompt plus reply (the smallest of the limit asked, the model's and the tokenizer's)
    max_context: int | None
    #: every id that ends a row (the tokenizer's EOS and the generation config's)
    eos_ids: list[int]
    pad_id: int


def load(
    model: Any,
    tokenizer: Any,
    *,
    model_name: str | None = None,
    chat_template: str | None = None,
    device: str | None = None,
    dtype: Any = None,
    cast: bool = True,
    loras: dict[str, str] | None = None,
    max_context: int | None = None,
) -> Loaded:
    """Load (or take) the model and its chat tokenizer. ``dtype`` (an ``EngineSettings.dtype``) casts a
    model object only when ``cast`` (a policy's copy is cast by :mod:`agl.engine.merged_lora`
    instead); ``loras`` are named LoRA folders wrapped around the model by peft."""
    if model is None or isinstance(model, (str, Path)):
        model, tokenizer, model_name = _from_files(model, tokenizer, model_name, device, dtype)
    elif dtype is not None and cast:  # a model object, cast as asked
        model = model.to(resolve_dtype(dtype, str(next(model.parameters()).device)))
    tok = _chat_tokenizer(tokenizer, chat_template)
    if loras:
        model = with_loras(model, loras)
    model.eval()
    name = model_name or getattr(getattr(model, "config", None), "_name_or_path", None) or "model"
    limits = [
        x for x in (max_context, getattr(model.config, "max_position_embeddings", None), tok.max_context) if x
    ]
    eos = {tok.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        eos.add(gen_eos)
    elif isinstance(gen_eos, (list, tuple)):
        eos.update(gen_eos)
    eos_ids = sorted(e for e in eos if e is not None)
    tok.max_token_chars  # noqa: B018 - computed once here (a worker thread), not during a request
    pad_id = tok.token_to_id(tok.pad_token) if tok.pad_token else None
    return Loaded(
        model=model,
        tokenizer=tok,
        model_name=name,
        max_context=min(limits) if limits else None,
        eos_ids=eos_ids,
        pad_id=eos_ids[0] if pad_id is None else pad_id,
    )


def _from_files(
    model: str | Path | None, tokenizer: Any, model_name: str | None, device: str | None, dtype: Any
) -> tuple[Any, Any, str | None]:
    """The model from a folder or hub id (None: the default model, prepared on first use), on
    ``device`` (default: CUDA when there is one) in ``dtype`` (default: bf16 on CUDA, fp32 on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model is None:
        from agl.chat.models import DEFAULT_MODEL, prepare_default_model

        path = str(prepare_default_model())
        model_name = model_name or DEFAULT_MODEL
    else:
        path = str(model)
        model_name = model_name or Path(path).name
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(dtype, device) or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(path)
    return loaded, tokenizer, model_name


def _chat_tokenizer(tok: Any, chat_template: str | None) -> ChatTokenizer:
    """``tok`` as a :class:`ChatTokenizer` (None: the shipped SmolLM2 one), with ``chat_template`` when
    given, else its own, else SmolLM2's."""
    if tok is None:
        tok = load_default_tokenizer()
    if not isinstance(tok, ChatTokenizer):
        return ChatTokenizer.from_hf(
            tok,
            chat_template=chat_template
            or getattr(tok, "chat_template", None)
            or load_default_tokenizer().chat_template,
        )
    if chat_template:
        tok.chat_template = chat_template
    return tok


def read_weights(source: Any, device: Any) -> Any:
    """A state dict from ``source``: itself when it is one, else a ``.safetensors`` file or a folder of
    them, read onto ``device``."""
    if not isinstance(source, (str, Path)):
        return source
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors file in {path}")
    else:
        files = [path]
        if not path.exists():
            raise FileNotFoundError(f"no weights at {path}")
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(str(f), device=str(device)))
    return state


def trainable(model: Any, reference: Any) -> list[tuple[str, Any]]:
    """``model``'s parameters that are trainable in ``reference`` (by name, in a fixed order)."""
    wanted = {name for name, p in reference.named_parameters() if p.requires_grad}
    return [(name, p) for name, p in model.named_parameters() if name in wanted]
