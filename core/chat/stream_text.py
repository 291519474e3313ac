"""The text of a streamed reply from the transformers backend: what each token's delta may send (text
that later tokens can no longer change or cut), and the last delta with what was held back."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["StreamText", "safe_prefix", "tail_delta", "token_logprobs"]

log = logging.getLogger("agl.gateway")

_TOOL_TAG = "<tool_call>"


def safe_prefix(text: str, stops: Sequence[str], tools: bool) -> str:
    """The part of the text decoded so far that later tokens cannot change or cut."""
    if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence
        text = text.rstrip("\ufffd")
    if stops:  # the reply is cut before a stop string: never send one, nor the start of one
        cuts = [k for k in (text.find(x) for x in stops if x) if k >= 0]
        if cuts:
            text = text[: min(cuts)]
        else:
            text = text[: max(0, len(text) - (max(len(x) for x in stops) - 1))]
    if tools:
        cut = text.find(_TOOL_TAG)
        if cut >= 0:
            text = text[:cut]
        else:  # a tag may be starting at the end
            for k in range(len(_TOOL_TAG) - 1, 0, -1):
                if text.endswith(_TOOL_TAG[:k]):
                    text = text[:-k]
                    break
        text = text.rstrip()  # the parsed content is stripped around calls
        if not text.strip():
            return ""
    return text


class StreamText:
    """The text a streamed reply has sent so far: each new token's delta holds only text that can no
    longer change (see :func:`safe_prefix`); nothing after an end-of-sequence token, and no text at all
    for a reply forced to open with a tool call."""

    def __init__(self, tok: Any, request: Any, eos: set[int], *, forced: bool) -> None:
        self.tok, self.request, self.eos = tok, request, eos
        self.tools = bool(request.messages is not None and request.tools and request.tool_choice != "none")
        self.forced = forced
        self.sent = ""
        self.done = False
        self.first = True

    def delta(self, ids: list[int], tid: int) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if self.first else {}
        self.first = False
        if tid in self.eos:
            self.done = True
        elif not self.forced:
            text = self.tok.decode([t for t in ids if t not in self.eos])
            safe = safe_prefix(text, self.request.stop, self.tools)
            if len(safe) > len(self.sent) and safe.startswith(self.sent):
                delta["content"] = safe[len(self.sent) :]
                self.sent = safe
        return delta


def token_logprobs(tok: Any, tid: int, lp: float) -> list[dict[str, Any]]:
    piece = tok.decode([tid])
    return [{"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}]


def tail_delta(choice: Any, sent: str) -> dict[str, Any]:
    """The last delta: the text held back so far, and the parsed tool calls."""
    content = choice.content or ""
    tail: dict[str, Any] = {}
    if content.startswith(sent) and len(content) > len(sent):
        tail["content"] = content[len(sent) :]
    elif not content.startswith(sent):
        log.warning("agl gateway: streamed text diverged from the final reply (stop string or tool call)")
    if choice.tool_calls:
        tail["tool_calls"] = [{"index": k, **tc.to_openai()} for k, tc in enumerate(choice.tool_calls)]
    return tail


def hand_over(drawn: list[tuple[Any, Any, Any]]) -> None:
    """Put each ``(loop, queue, item)``'s item on its asyncio queue, one ``call_soon_threadsafe`` per
    event loop (from the engine's worker thread, once per decode step): a cross-thread wake-up is a
    syscall, and one per streamed row made a step's overhead grow with the batch. Order is kept."""
    by_loop: dict[Any, list[tuple[Any, Any]]] = {}
    for loop, queue, item in drawn:
        by_loop.setdefault(loop, []).append((queue, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


def _put_all(items: list[tuple[Any, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
