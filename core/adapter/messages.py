"""Message and attribute parsing: span attributes (OpenAI, Responses-API or OTel GenAI ``parts``
JSON) to OpenAI-style chat messages, and the cheap type checks the adapter trusts token ids by.

Nothing here raises on malformed input except :func:`_loads` (``ValueError``), which callers count.
"""

from __future__ import annotations

import json
from typing import Any

try:  # orjson parses message JSON ~2-3x faster; optional (it comes with several frameworks)
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - depends on the environment
    _fast_loads = json.loads


def _loads(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return _fast_loads(value)
        except ValueError:
            return json.loads(value)  # what orjson refuses and json accepts (NaN, huge ints)
    return value


def _norm_message(m: Any) -> dict[str, Any] | None:
    """An OpenAI-style chat message from OpenAI format, an OpenAI choice, or OTel GenAI ``parts``."""
    if not isinstance(m, dict):
        return None
    if "role" not in m:
        if isinstance(m.get("message"), dict):  # an OpenAI choice
            m = m["message"]
        elif m.get("type") == "function_call":  # Responses API items
            call = {
                "id": m.get("call_id"),
                "type": "function",
                "function": {"name": m.get("name"), "arguments": m.get("arguments", "")},
            }
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        elif m.get("type") == "function_call_output":
            out = m.get("output")
            return {
                "role": "tool",
                "tool_call_id": m.get("call_id"),
                "content": out if isinstance(out, str) else json.dumps(out),
            }
    content = m.get("content")
    if isinstance(content, list):  # text parts (Chat Completions or Responses) as one string
        m = {**m, "content": _content_text(content)}
    parts = m.get("parts")
    if "content" in m or not isinstance(parts, list):
        return m
    out: dict[str, Any] = {"role": m.get("role", "assistant")}
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for p in parts:
        if not isinstance(p, dict):
            continue
        kind = p.get("type")
        if kind == "text":
            texts.append(str(p.get("content", "")))
        elif kind == "tool_call":
            args = p.get("arguments")
            calls.append(
                {
                    "id": p.get("id"),
                    "type": "function",
                    "function": {
                        "name": p.get("name"),
                        "arguments": args if isinstance(args, str) else json.dumps(args),
                    },
                }
            )
        elif kind == "tool_call_response":
            out["role"] = "tool"
            out["tool_call_id"] = p.get("id")
            resp = p.get("response")
            texts.append(resp if isinstance(resp, str) else json.dumps(resp))
    out["content"] = "".join(texts) if texts or not calls else None
    if calls:
        out["tool_calls"] = calls
    return out


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", p.get("content", p.get("refusal", "")))) if isinstance(p, dict) else str(p)
            for p in content
        )
    return str(content)


def _response_text(out: dict[str, Any] | None) -> str | None:
    if out is None:
        return None
    text = _content_text(out.get("content"))
    if not text and out.get("tool_calls"):
        return json.dumps(out["tool_calls"], separators=(",", ":"))
    return text


def _int_list(v: Any) -> bool:
    """Token ids as the gateway records them: a list of ints.

    Spans are validated when they enter the store (every attribute list holds only str/bool/int/float
    items), so checking the element type at both ends catches a list of the wrong type (strings,
    floats) without a per-token Python loop on the hot path (DESIGN §10: >= 100k spans/s).
    """
    if type(v) is not list and type(v) is not tuple:
        return False
    return not v or (type(v[0]) is int and type(v[-1]) is int)


def _float_list(v: Any) -> bool:
    if type(v) is not list and type(v) is not tuple:
        return False
    return not v or (type(v[0]) in (float, int) and type(v[-1]) in (float, int))


def _cut_at_max_tokens(finish: Any) -> bool:
    """Whether a call's finish reasons (OTel's list, or one string) say it hit ``max_tokens``: ``length``
    in the chat API, ``max_tokens`` in the Anthropic-style spelling some frameworks record."""
    reasons = [finish] if isinstance(finish, str) else finish if isinstance(finish, (list, tuple)) else []
    return any(str(r).lower() in ("length", "max_tokens") for r in reasons)
