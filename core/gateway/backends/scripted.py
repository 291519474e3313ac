"""Deterministic replies from a script, tokenised with a real tokenizer: the backend for tests.

The prompt is rendered and tokenised exactly as the transformers backend would (same chat template,
same tokenizer), and the reply is the text a model would have generated — tool calls in the
canonical ``<tool_call>`` form, ending with EOS — so spans, transitions and drift detection behave as
with a real model while every reply is known in advance. Logprobs are 0.0: a script is a
deterministic policy.

A script is a list of replies, consumed in order *per conversation* (per rollout attempt; calls with
no rollout share one cursor), or a function ``(GenerationRequest) -> reply`` for replies that depend
on the request (e.g. on the agent's system prompt). A reply is a string, a :class:`Reply`, or a dict
``{"content": ..., "tool_calls": [{"name": ..., "arguments": {...}}]}``. With ``n > 1`` every choice
gets the same reply. Text replied to a request that offers tools is parsed for tool calls as the
engine parses what a model wrote (:func:`agl.chat.format.parse_reply`), so a script can also say what a
model writes, ``<tool_call>`` blocks, trailing prose and all.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from agl.chat.format import new_tool_call_id, parse_reply, render_tool_call
from agl.chat.tokenizer import ChatTokenizer, load_default_tokenizer
from agl.gateway.backends.base import (
    Backend,
    BackendError,
    Choice,
    ContextWindowError,
    GenerationRequest,
    GenerationResult,
    ToolCall,
    UnknownModelError,
)

__all__ = ["Reply", "ScriptedBackend", "ScriptedToolCall", "reply", "tool_call"]


@dataclass(frozen=True)
class ScriptedToolCall:
    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)
    id: str | None = None


@dataclass(frozen=True)
class Reply:
    """One scripted model turn: text, tool calls, or both.

    ``delay_s`` makes the backend take that long (to test concurrency and cancellation); ``error``
    makes it fail (the gateway answers 502 and records an ERROR span).
    """

    content: str | None = None
    tool_calls: tuple[ScriptedToolCall, ...] = ()
    delay_s: float = 0.0
    error: str | None = None


ReplyLike = Union[str, Reply, dict]
Script = Union[Sequence[ReplyLike], Callable[[GenerationRequest], Any]]


def reply(content: str | None = None, *tool_calls: ScriptedToolCall, **kw: Any) -> Reply:
    """``reply("hi")``, ``reply(None, tool_call("add", a=1, b=2))``, ``reply(error="boom")``."""
    return Reply(content=content, tool_calls=tuple(tool_calls), **kw)


def tool_call(
    name: str, arguments: dict[str, Any] | str | None = None, /, *, id: str | None = None, **kw: Any
) -> ScriptedToolCall:
    """A scripted tool call: ``tool_call("add", {"a": 1})`` or ``tool_call("add", a=1)``."""
    args: dict[str, Any] | str = dict(kw) if arguments is None else arguments
    return ScriptedToolCall(name=name, arguments=args, id=id)


def _as_reply(value: Any) -> Reply:
    if isinstance(value, Reply):
        return value
    if isinstance(value, str):
        return Reply(content=value)
    if isinstance(value, ScriptedToolCall):
        return Reply(tool_calls=(value,))
    if isinstance(value, dict):
        calls = []
        for tc in value.get("tool_calls") or ():
            if isinstance(tc, ScriptedToolCall):
                calls.append(tc)
            else:
                fn = tc.get("function", tc)
                calls.append(ScriptedToolCall(fn["name"], fn.get("arguments", {}), tc.get("id")))
        return Reply(
            content=value.get("content"),
            tool_calls=tuple(calls),
            delay_s=float(value.get("delay_s", 0.0)),
            error=value.get("error"),
        )
    raise TypeError(f"a scripted reply must be a str, Reply or dict, got {type(value).__name__}")


class ScriptedBackend(Backend):
    """Replies from ``script``; see the module docstring.

    ``on_exhausted`` says what happens when a conversation has used every reply of a list script:
    ``"error"`` (502, the default: an agent that calls the model more often than planned is a bug
    worth seeing), ``"cycle"`` (start again) or ``"repeat"`` (keep giving the last reply).
    ``cancellable=True`` makes the gateway watch for client disconnects (replies with ``delay_s``);
    off by default because a script answers at once.
    """

    name = "scripted"
    cancellable = False

    def __init__(
        self,
        script: Script,
        *,
        models: Sequence[str] = ("scripted",),
        accept_any_model: bool = False,
        tokenizer: ChatTokenizer | None = None,
        on_exhausted: Literal["error", "cycle", "repeat"] = "error",
        cancellable: bool = False,
    ) -> None:
        super().__init__()
        self.cancellable = cancellable
        if not callable(script):
            script = [_as_reply(r) for r in script]
            if not script:
                raise ValueError("a scripted backend needs at least one reply")
        self._script = script
        self._models = list(models)
        self.accept_any_model = accept_any_model
        self.tokenizer = tokenizer or load_default_tokenizer()
        self.on_exhausted = on_exhausted
        self._cursor: dict[tuple[str, int] | None, int] = {}
        self._lock = threading.Lock()
        self.calls = 0

    def models(self) -> list[str]:
        return list(self._models)

    def max_prompt_chars(self) -> int | None:
        return self.tokenizer.max_prompt_chars()

    def check_model(self, model: str) -> None:
        if not self.accept_any_model and model not in self._models:
            raise UnknownModelError(model, self._models)

    def _next_reply(self, request: GenerationRequest) -> Reply:
        script = self._script
        assert isinstance(script, list)
        with self._lock:
            i = self._cursor.get(request.rollout, 0)
            self._cursor[request.rollout] = i + 1
        if i >= len(script):
            if self.on_exhausted == "cycle":
                i %= len(script)
            elif self.on_exhausted == "repeat":
                i = len(script) - 1
            else:
                who = (
                    f"rollout {request.rollout[0]} attempt {request.rollout[1]}"
                    if request.rollout
                    else "this gateway"
                )
                raise BackendError(f"the script has {len(script)} replies and {who} asked for reply {i + 1}")
        return script[i]

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.calls += 1
        if isinstance(self._script, list):
            rep = self._next_reply(request)
        else:
            value = self._script(request)
            if inspect.isawaitable(value):
                value = await value
            rep = _as_reply(value)
        if rep.delay_s:
            await asyncio.sleep(rep.delay_s)
        if rep.error is not None:
            raise BackendError(rep.error)
        tok = self.tokenizer
        if request.messages is not None:  # off the event loop when long
            prompt_text, prompt_ids = await tok.aencode_chat(request.messages, request.tools)
        else:
            prompt_text = request.prompt or ""
            prompt_ids = await tok.aencode(prompt_text)
        if tok.max_context is not None and len(prompt_ids) >= tok.max_context:
            raise ContextWindowError(len(prompt_ids), tok.max_context)
        choice = self._choice(rep, request)
        return GenerationResult(
            model=request.model,
            choices=[choice] * request.n,
            prompt_ids=prompt_ids,
            prompt_tokens=len(prompt_ids),
            weight_version=self.weight_version,
            prompt_text=prompt_text,
        )

    def _choice(self, rep: Reply, request: GenerationRequest) -> Choice:
        tok = self.tokenizer
        calls = [
            ToolCall(
                name=tc.name,
                arguments=tc.arguments
                if isinstance(tc.arguments, str)
                else json.dumps(tc.arguments, ensure_ascii=False),
                id=tc.id or new_tool_call_id(),
            )
            for tc in rep.tool_calls
        ]
        text = rep.content or ""
        if calls:
            rendered = "\n".join(render_tool_call(c.name, c.arguments) for c in calls)
            text = (text + "\n" if text else "") + rendered
        finish = "tool_calls" if calls else "stop"
        for stop in request.stop:
            cut = text.find(stop)
            if cut >= 0:
                text, calls, finish = text[:cut], [], "stop"
        ids = tok.encode(text) + [tok.eos_token_id]
        if request.max_tokens is not None and len(ids) > request.max_tokens:
            ids = ids[: request.max_tokens]
            text = tok.decode(ids)
            calls, finish = [], "length"
        content: str | None = rep.content if calls else text
        repairs = 0
        offered = request.messages is not None and request.tools and request.tool_choice != "none"
        if not rep.tool_calls and finish == "stop" and offered:  # the text a model wrote, parsed as such
            parsed = parse_reply(text)
            if parsed.tool_calls:
                content, calls, finish, repairs = (
                    parsed.content,
                    parsed.tool_calls,
                    "tool_calls",
                    parsed.repairs,
                )
        return Choice(
            text=text,
            content=content,
            tool_calls=calls,
            response_ids=ids,
            logprobs=[0.0] * len(ids),
            finish_reason=finish,
            tool_call_repairs=repairs,
        )
