"""Chat requests rendered by agl and sent to an upstream engine as prompt token ids.

One rendering on every engine: the embedded engine renders a conversation with agl's chat renderer
(:mod:`agl.chat.format`, which lowers tools into the system prompt where the template ignores
them) and tokenises the text; a vLLM server must see the same ids, so the vLLM backend renders here
too and sends the ids as a completion's prompt (``POST /v1/completions {"prompt": [ids...]}``),
never the messages. The reply's text is decoded from the engine's token ids by the same tokenizer,
cut at stop strings and parsed for tool calls exactly as the embedded engine does
(:meth:`agl.gateway.backends.transformers.TransformersBackend._result`); ``tool_choice`` is honoured by
appending the tool-call opening to the prompt (:func:`~agl.chat.format.forced_tool_prefix`),
whose tokens are context, outside the loss. vLLM's own tool-call parser and chat template are not
used on this path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agl.chat.format import ParsedReply, forced_tool_prefix, parse_reply
from agl.chat.stream_text import StreamText, tail_delta, token_logprobs
from agl.gateway.backends.base import (
    BackendError,
    Choice,
    ContextWindowError,
    GenerationRequest,
    GenerationResult,
    UpstreamError,
)

__all__ = ["Rendered", "completion_body", "rendered_choice", "rendered_result", "render", "RenderedStream"]

#: vLLM sampling fields a client may send beside the OpenAI ones; forwarded as they are
_EXTRA_SAMPLING = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "ignore_eos",
    "logit_bias",
)
_TOOL_CLOSE = "</tool_call>"


@dataclass
class Rendered:
    """A request's prompt as agl renders it: the text, its ids (the forced opening's included), the
    forced tool-call opening and how many of the ids it takes, and the tokens left for the reply."""

    text: str
    ids: list[int]
    forced: str
    forced_tokens: int
    max_new: int | None

    def result(self, request: GenerationRequest, choices: list[Choice], **more: Any) -> GenerationResult:
        """The call's result: ``choices`` sampled after this prompt (``more``: the result's other fields)."""
        return GenerationResult(
            model=request.model,
            choices=choices,
            prompt_ids=list(self.ids),
            prompt_tokens=len(self.ids),
            prompt_text=self.text,
            forced_tokens=self.forced_tokens,
            **more,
        )


def forced_prefix(request: GenerationRequest) -> str:
    """The opening ``tool_choice`` forces (``""``: none); an unsupported value is a 400."""
    if request.messages is None:
        return ""
    try:
        return forced_tool_prefix(request.tool_choice, request.tools)
    except ValueError as exc:
        raise UpstreamError(400, str(exc), {"error": {"message": str(exc), "param": "tool_choice"}}) from None


async def render(tok: Any, request: GenerationRequest, max_context: int | None) -> Rendered:
    """Render and tokenise ``request`` as the embedded engine does; ContextWindowError when it does
    not fit ``max_context``."""
    forced = forced_prefix(request)
    if request.messages is not None:
        tools = None if request.tool_choice == "none" else request.tools
        text, ids = await tok.aencode_chat(request.messages, tools)
    else:
        text, ids = request.prompt or "", await tok.aencode(request.prompt or "")
    forced_ids = tok.encode(forced) if forced else []
    ids = [*ids, *forced_ids]
    if not ids:
        raise BackendError("the prompt is empty")
    max_new = request.max_tokens
    if max_context is not None:
        if len(ids) >= max_context:
            raise ContextWindowError(len(ids), max_context)
        max_new = min(max_new or max_context, max_context - len(ids))
    return Rendered(text + forced, ids, forced, len(forced_ids), max_new)


def completion_body(request: GenerationRequest, rendered: Rendered, model: str) -> dict[str, Any]:
    """The ``/v1/completions`` body that generates ``request``'s reply from the rendered ids."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": rendered.ids,
        "n": request.n,
        "return_token_ids": True,
        "logprobs": 0,  # the sampled token's log-prob (vLLM's logprobs mode decides which distribution)
        "stream": False,
    }
    for key, value in (
        ("max_tokens", rendered.max_new),
        ("temperature", request.temperature),
        ("top_p", request.top_p),
        ("seed", request.seed),
        ("stop", [*request.stop, *([_TOOL_CLOSE] if rendered.forced else [])] or None),
        ("response_format", request.response_format),
    ):
        if value is not None:
            body[key] = value
    raw = request.raw if isinstance(request.raw, dict) else {}
    for key in _EXTRA_SAMPLING:
        if raw.get(key) is not None:
            body[key] = raw[key]
    return body


def rendered_choice(
    tok: Any,
    request: GenerationRequest,
    rendered: Rendered,
    ids: list[int],
    logprobs: list[float] | None,
    finish: str | None,
    stop_reason: Any,
    eos: set[int],
) -> Choice:
    """One reply from the engine's ids: decoded, cut at a stop string and parsed for tool calls as the
    embedded engine does; the forced opening leads the text."""
    hit_eos = bool(ids) and ids[-1] in eos
    text = tok.decode(ids[:-1] if hit_eos else ids)
    finish = finish or "stop"
    if rendered.forced and stop_reason == _TOOL_CLOSE and not text.endswith(_TOOL_CLOSE):
        cut = text.find(_TOOL_CLOSE)
        text = text[: cut + len(_TOOL_CLOSE)] if cut >= 0 else text + _TOOL_CLOSE
    for s in request.stop:
        cut = text.find(s) if s else -1
        if cut >= 0:
            text, finish = text[:cut], "stop"
    if finish == "abort":
        finish = "cancelled"
    text = rendered.forced + text
    parsed = ParsedReply(text, [])
    if request.messages is not None and request.tools and request.tool_choice != "none" and finish == "stop":
        parsed = parse_reply(text)
        if parsed.tool_calls:
            finish = "tool_calls"
    return Choice(
        text=text,
        content=parsed.content,
        tool_calls=parsed.tool_calls,
        response_ids=list(ids),
        logprobs=logprobs if logprobs is not None and len(logprobs) == len(ids) else None,
        finish_reason=finish,
        tool_call_repairs=parsed.repairs,
    )


def _logprobs(raw: dict[str, Any]) -> list[float] | None:
    lp = raw.get("logprobs")
    if isinstance(lp, dict) and isinstance(lp.get("token_logprobs"), list):
        return [float(x) if x is not None else 0.0 for x in lp["token_logprobs"]]
    return None


def rendered_result(
    tok: Any, request: GenerationRequest, rendered: Rendered, data: dict[str, Any], eos: set[int]
) -> GenerationResult:
    """The result of a non-streamed rendered call from vLLM's completion body ``data``."""
    choices = []
    for raw in sorted(data["choices"], key=lambda c: c.get("index", 0)):
        ids = raw.get("token_ids")
        if not isinstance(ids, list):
            raise BackendError("the vLLM upstream returned no token ids (needs vLLM >= 0.10.2)")
        check_prompt(raw.get("prompt_token_ids"), rendered)
        choices.append(
            rendered_choice(
                tok,
                request,
                rendered,
                ids,
                _logprobs(raw),
                raw.get("finish_reason"),
                raw.get("stop_reason"),
                eos,
            )
        )
    return rendered.result(request, choices, raw={"usage": data.get("usage")} if data.get("usage") else None)


def check_prompt(engine_ids: Any, rendered: Rendered) -> None:
    """The engine must have seen exactly the ids agl sent (a server that re-tokenised, or added a BOS,
    would train a prompt no one rendered): a mismatch is a backend error, never a silent drift."""
    if isinstance(engine_ids, list) and engine_ids != rendered.ids:
        raise BackendError(
            f"the vLLM upstream saw prompt ids other than those agl rendered ({len(engine_ids)} ids, sent "
            f"{len(rendered.ids)}): it must take prompt token ids as they are"
        )


class RenderedStream:
    """A streamed rendered call: vLLM's completion chunks in, the gateway's chat stream events out.

    Each token's text delta comes from :class:`~agl.chat.stream_text.StreamText` (what
    the embedded engine streams: text that can no longer change, tool calls held back), the last delta
    holds what was held back and the parsed tool calls, and the ``end`` result is the one
    :func:`rendered_result` would give for the same ids."""

    def __init__(self, tok: Any, request: GenerationRequest, rendered: Rendered, eos: set[int]) -> None:
        self.tok, self.request, self.rendered, self.eos = tok, request, rendered, eos
        self.text = StreamText(tok, request, eos, forced=bool(rendered.forced))
        self.want_lp = bool(isinstance(request.raw, dict) and request.raw.get("logprobs"))
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.finish: str | None = None
        self.stop_reason: Any = None

    def chunk(self, raw: dict[str, Any]) -> dict[str, Any] | None:
        """The delta event of one upstream chunk's choice (None when it carries nothing)."""
        check_prompt(raw.get("prompt_token_ids"), self.rendered)
        new = raw.get("token_ids") or []
        if raw.get("token_ids") is None and raw.get("text"):
            raise BackendError("the vLLM upstream streamed no token ids (needs vLLM >= 0.10.2)")
        lps = _logprobs(raw) or []
        delta: dict[str, Any] = {}
        for tid in new:
            self.ids.append(tid)
            for key, value in self.text.delta(self.ids, tid).items():
                delta[key] = delta.get(key, "") + value if key == "content" else value
        self.lps.extend(lps)
        if raw.get("finish_reason"):
            self.finish, self.stop_reason = raw["finish_reason"], raw.get("stop_reason")
        if not new:
            return None
        entries = (
            [e for t, lp in zip(new, lps, strict=False) for e in token_logprobs(self.tok, t, lp)]
            if self.want_lp
            else None
        )
        return {
            "type": "delta",
            "index": 0,
            "delta": delta,
            "token_ids": new,
            "logprobs": entries,
            "finish_reason": None,
        }

    def end(self) -> list[dict[str, Any]]:
        """The last delta and the ``end`` event."""
        choice = rendered_choice(
            self.tok, self.request, self.rendered, self.ids, self.lps, self.finish, self.stop_reason, self.eos
        )
        result = GenerationResult(
            model=self.request.model,
            choices=[choice],
            prompt_ids=list(self.rendered.ids),
            prompt_tokens=len(self.rendered.ids),
            prompt_text=self.rendered.text,
            forced_tokens=self.rendered.forced_tokens,
        )
        last = {
            "type": "delta",
            "index": 0,
            "delta": tail_delta(choice, self.text.sent),
            "token_ids": [],
            "logprobs": [] if self.want_lp else None,
            "finish_reason": choice.finish_reason,
        }
        return [last, {"type": "end", "result": result}]
