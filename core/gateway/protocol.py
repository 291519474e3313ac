"""The OpenAI wire format: request validation, Responses-API conversion, response bodies.

Requests are validated with pydantic so a bad field is refused with an OpenAI-style 400 naming the
parameter; unknown extra fields are accepted and ignored (clients send many optional fields), except
where they change the meaning of the call (``previous_response_id``: the gateway is stateless).
"""

from __future__ import annotations

import random
import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agl.chat.format import flatten_content
from agl.errors import ApiError
from agl.gateway.backends.base import Choice, GenerationRequest, GenerationResult

__all__ = [
    "ApiError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "ResponsesRequest",
    "chat_completion_body",
    "completion_body",
    "parse_request",
    "responses_body",
    "responses_to_generation",
]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Function(_Open):
    name: str = Field(min_length=1, max_length=128)
    arguments: Union[str, dict[str, Any], None] = None


class _ToolCallIn(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: _Function


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[Any], None] = None
    name: str | None = None
    tool_calls: list[_ToolCallIn] | None = None
    tool_call_id: str | None = None


class _FunctionDef(_Open):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _ToolDef(_Open):
    type: Literal["function"]
    function: _FunctionDef


class _SamplingFields(_Open):
    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False


def _stop_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[_ToolDef] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=16)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: Union[str, list[str], None] = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("stop")
    @classmethod
    def _v_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def to_generation(self, rollout: tuple[str, int] | None, body: dict[str, Any]) -> GenerationRequest:
        """``body`` is the validated JSON body: its messages and tools are used as the client sent them."""
        messages = []
        for m in body["messages"]:
            content = m.get("content")
            if isinstance(content, list):
                m = {**m, "content": flatten_content(content)}
            messages.append(m)
        return GenerationRequest(
            model=self.model,
            messages=messages,
            tools=body.get("tools") or None,
            tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self.response_format,
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.max_completion_tokens or self.max_tokens,
            stop=_stop_list(self.stop),
            seed=self.seed,
            rollout=rollout,
            api="chat",
            raw=body,
        )


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str]]
    n: int = Field(default=1, ge=1, le=16)
    max_tokens: int | None = Field(default=16, ge=1)
    stop: Union[str, list[str], None] = None
    logprobs: int | None = Field(default=None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _v_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("the gateway takes one prompt per request")
        return v

    def to_generation(self, rollout: tuple[str, int] | None, body: dict[str, Any]) -> GenerationRequest:
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return GenerationRequest(
            model=self.model,
            prompt=prompt,
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.max_tokens,
            stop=_stop_list(self.stop),
            seed=self.seed,
            rollout=rollout,
            api="completions",
            raw=body,
        )


class ResponsesRequest(_SamplingFields):
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _v_stateless(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError(
                "the gateway is stateless and keeps no earlier responses or conversations; send the whole "
                "conversation as input items"
            )
        return v


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in _UNION_TAGS and not str(part).startswith(
            ("function-", "list[", "dict[", "literal[", "union[")
        ):  # pydantic names a union member by its type: not a field ("stream" is one, "str" is not)
            out += ("." if out else "") + str(part)
    return out


def parse_request(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; a problem becomes a 400 naming the parameter."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        # strict: "10" is not a number, 1 is not a boolean; a wrong type is the client's bug to hear of
        return model.model_validate(body, strict=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _loc(tuple(err.get("loc", ())))
        msg = err.get("msg", "invalid value")
        if err.get("type") == "missing":
            message = f"missing required parameter: {param!r}"
        else:
            message = f"invalid value for {param!r}: {msg}"
        raise ApiError(
            400,
            message,
            param=param or None,
            code="missing_required_parameter" if err.get("type") == "missing" else "invalid_value",
        ) from None


# ------------------------------------------------------------------------------ Responses API input


def responses_to_generation(req: ResponsesRequest, rollout: tuple[str, int] | None) -> GenerationRequest:
    """Responses-API input items → chat messages (the gateway renders both APIs the same way)."""
    tool_choice: Any = req.tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    return GenerationRequest(
        model=req.model,
        messages=_responses_messages(req),
        tools=_responses_tools(req.tools),
        tool_choice=tool_choice,
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_responses_format(req.text),
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_output_tokens,
        seed=req.seed,
        rollout=rollout,
        api="responses",
        raw=req.model_dump(exclude_unset=True),
    )


def _responses_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and ``input``. Consecutive ``function_call`` items join one
    assistant message (as do calls right after an assistant message without calls); reasoning items
    are dropped. A 400 names the first item the gateway cannot read."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items: list[Any] = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    last_was_call = False
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_input_message(i, item))
        elif kind == "function_call":
            _add_function_call(messages, _input_call(i, item), joins=last_was_call)
        elif kind == "function_call_output":
            messages.append(_input_call_output(i, item))
        elif kind != "reasoning":
            raise ApiError(
                400,
                f"input[{i}] has type {kind!r}, which the gateway does not support",
                param=f"input[{i}].type",
            )
        if kind != "reasoning":
            last_was_call = kind == "function_call"
    if not messages:
        raise ApiError(400, "input is empty", param="input")
    return messages


def _input_message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise ApiError(400, f"input[{i}] has an unknown role {role!r}", param=f"input[{i}].role")
    return {
        "role": "system" if role == "developer" else role,
        "content": flatten_content(item.get("content")),
    }


def _input_call(i: int, item: dict[str, Any]) -> dict[str, Any]:
    for key in ("call_id", "name"):
        if not isinstance(item.get(key), str):
            raise ApiError(400, f"input[{i}] (function_call) needs {key!r}", param=f"input[{i}].{key}")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item.get("arguments", "")},
    }


def _add_function_call(messages: list[dict[str, Any]], call: dict[str, Any], *, joins: bool) -> None:
    """Append ``call`` to the previous assistant message when it follows another call (``joins``) or
    that message has no calls yet; otherwise start an assistant message of its own."""
    prev = messages[-1] if messages else None
    if prev is not None and prev["role"] == "assistant" and (joins or not prev.get("tool_calls")):
        prev.setdefault("tool_calls", []).append(call)
        if prev.get("content") == "":
            prev["content"] = None
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _input_call_output(i: int, item: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str):
        raise ApiError(400, f"input[{i}] (function_call_output) needs 'call_id'", param=f"input[{i}].call_id")
    out = item.get("output", "")
    return {
        "role": "tool",
        "tool_call_id": item["call_id"],
        "content": flatten_content(out) if not isinstance(out, str) else out,
    }


def _responses_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses-API function tools → chat tools; any other tool type is a 400."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise ApiError(
                400,
                f"tools[{i}]: only function tools are supported (got type {t.get('type')!r})",
                param=f"tools[{i}].type",
            )
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _responses_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` → the chat ``response_format`` (json_schema or json_object), else None."""
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    return None


# ------------------------------------------------------------------------------------- bodies


def new_id(prefix: str) -> str:
    """A response/item id. Unique, not secret: drawn like OTel's span ids (``random``, reseeded in a
    forked child), not from ``os.urandom`` — a syscall per id was a visible share of a request."""
    sep = "-" if prefix in ("chatcmpl", "cmpl") else "_"
    return f"{prefix}{sep}{random.getrandbits(128):032x}"


def _usage(result: GenerationResult) -> dict[str, int]:
    prompt = result.prompt_tokens or 0
    completion = result.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chat_logprobs(choice: Choice, tokens: list[str] | None) -> dict[str, Any] | None:
    if choice.logprobs is None or tokens is None:
        return None
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
            for t, lp in zip(tokens, choice.logprobs, strict=False)
        ],
        "refusal": None,
    }


def chat_completion_body(
    result: GenerationResult,
    response_id: str,
    *,
    tokens: list[list[str] | None] | None = None,
    return_token_ids: bool = False,
) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(result.choices):
        msg = c.message()
        msg["refusal"] = None
        item: dict[str, Any] = {
            "index": i,
            "message": msg,
            "logprobs": _chat_logprobs(c, tokens[i]) if tokens else None,
            "finish_reason": c.finish_reason,
        }
        if return_token_ids:
            item["token_ids"] = c.response_ids
        choices.append(item)
    body: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": result.model,
        "choices": choices,
        "usage": _usage(result),
        "system_fingerprint": f"agl-w{result.weight_version}" if result.weight_version is not None else None,
    }
    if return_token_ids:
        body["prompt_token_ids"] = result.prompt_ids
    return body


def completion_body(
    result: GenerationResult, response_id: str, *, return_token_ids: bool = False
) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(result.choices):
        item: dict[str, Any] = {
            "index": i,
            "text": c.text if c.content is None else c.content,
            "logprobs": None,
            "finish_reason": c.finish_reason,
        }
        if return_token_ids:
            item["token_ids"] = c.response_ids
            item["prompt_token_ids"] = result.prompt_ids
        choices.append(item)
    return {
        "id": response_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": result.model,
        "choices": choices,
        "usage": _usage(result),
    }


def responses_output(choice: Choice) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if choice.content:
        out.append(
            {
                "type": "message",
                "id": new_id("msg"),
                "status": "completed",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": choice.content, "annotations": [], "logprobs": []}
                ],
            }
        )
    for tc in choice.tool_calls:
        out.append(
            {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": tc.id,
                "name": tc.name,
                "arguments": tc.arguments,
                "status": "completed",
            }
        )
    return out


def responses_body(
    req: ResponsesRequest,
    response_id: str,
    created: float,
    *,
    result: GenerationResult | None,
    output: list[dict[str, Any]] | None = None,
    status: str | None = None,
) -> dict[str, Any]:
    incomplete = None
    if result is not None:
        choice = result.choices[0]
        output = responses_output(choice) if output is None else output
        if status is None:
            status = "incomplete" if choice.finish_reason == "length" else "completed"
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        usage: dict[str, Any] | None = {
            "input_tokens": result.prompt_tokens or 0,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": (result.prompt_tokens or 0) + result.completion_tokens,
        }
    else:
        usage = None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status or "in_progress",
        "error": None,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": result.model if result is not None else req.model,
        "output": output or [],
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": None,
        "temperature": req.temperature,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "top_p": req.top_p,
        "text": req.text or {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": usage,
        "metadata": {},
    }
