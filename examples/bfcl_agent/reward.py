"""The reward: BFCL's own verdict on the agent's calls (1.0 when its checker accepts them, else 0.0).

- single-turn AST categories: the reply's tool calls, decoded as BFCL's OpenAI function-calling handler
  decodes them (``[{name: json.loads(arguments)}]``), go to BFCL's AST checker unchanged;
- irrelevance (and live_irrelevance): BFCL's own rule, the reply is right when it decodes to no call;
- multi_turn_base: BFCL's multi-turn checker on the calls of every step of every turn (the agent
  loop in agent.py records them), replayed on fresh API instances and compared with the ground truth.

What went wrong is reported in the checker's own ``error_type`` and grouped into :data:`KINDS` (no
call, wrong function, wrong argument type, wrong value, ...), the terms BFCL's score files use. AIR's
penalty for a call that does not parse or names no function is not part of this reward: the agent
marks such calls on the trace (agent.py) and AIR reads it there.
"""

from __future__ import annotations

import json
from typing import Any

from examples.bfcl_agent import bfcl

__all__ = ["KINDS", "decode", "is_irrelevance", "kind_of", "score"]

#: the failure kinds the eval command reports, in BFCL's terms, most basic first
KINDS = (
    "no call",
    "call does not parse",
    "wrong function",
    "wrong number of calls",
    "wrong parameters",
    "wrong argument type",
    "wrong value",
    "no matching call",
    "call where none fits",
    "multi-turn state or result",
)


def is_irrelevance(category: str) -> bool:
    return "irrelevance" in category


def decode(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``[{"name", "arguments"}]`` (arguments a JSON string) as BFCL's FC handler decodes them;
    raises ValueError when an argument string is not a JSON object."""
    out = []
    for call in calls:
        args = call.get("arguments")
        params = json.loads(args) if isinstance(args, str) else args
        if not isinstance(params, dict):
            raise ValueError(f"the arguments of {call.get('name')!r} are not a JSON object")
        out.append({call.get("name"): params})
    return out


def kind_of(error_type: str | None, n_calls: int) -> str | None:
    """The :data:`KINDS` entry of one of BFCL's ``error_type`` strings (None: no error)."""
    if not error_type:
        return None
    if error_type.startswith("ast_decoder"):
        return "no call" if n_calls == 0 else "call does not parse"
    if "wrong_count" in error_type:
        return "no call" if n_calls == 0 else "wrong number of calls"
    table = {
        "wrong_func_name": "wrong function",
        "missing_required": "wrong parameters",
        "unexpected_param": "wrong parameters",
        "missing_optional": "wrong parameters",
        "cannot_find_match": "no matching call",
        "decoder_success": "call where none fits",
        "empty_turn_model_response": "no call",
    }
    for key, kind in table.items():
        if key in error_type:
            return kind
    if error_type.startswith("type_error"):
        return "wrong argument type"
    if error_type.startswith("value_error") or error_type.endswith(":unclear"):
        return "wrong value"
    return "multi-turn state or result" if error_type.startswith("multi_turn") else "wrong value"


def score(task: dict[str, Any], calls: list[dict[str, Any]]) -> tuple[float, str | None]:
    """``(reward, error_type)`` of a single-turn reply whose tool calls are ``calls``."""
    from examples.bfcl_agent import data

    category = task["category"]
    try:
        decoded = decode(calls)
    except (ValueError, TypeError):
        if is_irrelevance(category):
            return 1.0, None  # BFCL: a reply that does not decode is no call
        return 0.0, "ast_decoder:decoder_failed"
    if is_irrelevance(category):
        empty = not decoded or decoded == [{}]
        return (1.0, None) if empty else (0.0, "irrelevance_error:decoder_success")
    if not decoded:
        return 0.0, "ast_decoder:decoder_failed"  # BFCL's FC handler: text is no decodable call
    result = bfcl.ast_check(task["function"], decoded, data.answer(task), category)
    return (1.0, None) if result["valid"] else (0.0, result.get("error_type", "unknown"))


def score_multi_turn(
    task: dict[str, Any], steps: list[list[list[dict[str, Any]]]], run_name: str
) -> tuple[float, str | None]:
    """``(reward, error_type)`` of a multi-turn conversation: ``steps[turn][step]`` are the tool calls
    of one reply. Each step is decoded into BFCL's call strings as its runner does (a step that does
    not decode is skipped, as BFCL skips it) and BFCL's multi-turn checker scores the whole."""
    from examples.bfcl_agent import data

    turns: list[list[list[str]]] = []
    for turn in steps:
        decoded_turn = []
        for calls in turn:
            try:
                decoded = bfcl.convert_to_calls(decode(calls)) if calls else []
            except (ValueError, TypeError):
                continue
            if decoded:
                decoded_turn.append(decoded)
        turns.append(decoded_turn)
    result = bfcl.multi_turn_check(turns, task, data.answer(task), run_name)
    return (1.0, None) if result["valid"] else (0.0, result.get("error_type", "unknown"))
