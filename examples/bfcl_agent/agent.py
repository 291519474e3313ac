"""The BFCL agent: plain OpenAI-client code, no framework, with a case's functions as ``tools``.

Single-turn (every AST category): the case's messages go to the model with BFCL's function docs
converted by BFCL's own ``convert_to_tool`` (as its OpenAI function-calling handler sends them, with no
system prompt of ours); the reply's tool calls are the answer, scored by BFCL's checker (reward.py).

Multi-turn (``multi_turn_base``): as BFCL's runner does for a function-calling model, each turn's user
message is added, then the model is queried step by step: the calls of a reply are executed against
BFCL's own API classes (its ``execute_multi_turn_func_call``, one state per rollout) and each result is
returned as a ``tool`` message; a reply without calls ends the turn; at most ``MAX_STEPS`` replies a
turn (BFCL's runner allows 20: too many for a CPU). The calls of every step go to BFCL's multi-turn
checker.

AIR: each call is recorded as an ``execute_tool`` span (``agl.tool``, with its call id); a call whose
arguments are not a JSON object, or that names none of the case's functions, is marked an error there,
so AIR's ``tool_error`` penalises the reply that wrote it; a reply that names no function where the
case needs one (prose, code, an echo of the schema: every category but irrelevance) is recorded with
``agl.emit_exception``, which AIR's ``exception`` rule charges to that reply.

The only agl code is ``agl.instrument``, ``agl.agent``/``agl.tool``/``agl.emit_exception`` and the
rollout function of :func:`make_rollout`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import agl
from examples.bfcl_agent import bfcl
from examples.bfcl_agent.reward import is_irrelevance, score, score_multi_turn

__all__ = ["AGENT", "MAX_STEPS", "bfcl_agent", "make_rollout", "run_case"]

AGENT = "caller"
MAX_STEPS = 4


def _calls(message: Any) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in (getattr(message, "tool_calls", None) or [])
    ]


def _bad_call(call: dict[str, Any], names: set[str]) -> str | None:
    """Why a call cannot be a call of this case (None: it can)."""
    if call["name"] not in names:
        return f"{call['name']!r} is none of the case's functions"
    try:
        args = json.loads(call["arguments"]) if isinstance(call["arguments"], str) else call["arguments"]
    except ValueError:
        return "the arguments are not valid JSON"
    return None if isinstance(args, dict) else "the arguments are not a JSON object"


def _mark(calls: list[dict[str, Any]], names: set[str], results: list[str] | None = None) -> None:
    """One ``execute_tool`` span per call: ERROR for a call that does not parse or names no function."""
    for i, call in enumerate(calls):
        with agl.tool(call["name"] or "?", call_id=call["id"], arguments=call["arguments"]) as span:
            bad = _bad_call(call, names)
            if bad is not None:
                span.error(bad)
            else:
                span.result(results[i] if results is not None and i < len(results) else "accepted")


def _names(tools: list[dict[str, Any]]) -> set[str]:
    return {t["function"]["name"] for t in tools}


async def _ask(
    client: Any, llm: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], task: dict[str, Any]
) -> Any:
    sampling = llm.sampling
    reply = await client.chat.completions.create(
        model=llm.model,
        messages=messages,
        tools=tools,
        # held-out tasks carry temperature 0: decoded greedily, as BFCL scores models
        temperature=task.get("temperature", sampling.get("temperature", 0.0)),
        max_tokens=sampling.get("max_tokens", 256),
    )
    return reply.choices[0].message


async def single_turn(client: Any, llm: Any, task: dict[str, Any]) -> tuple[float, str | None, int]:
    """One reply to the case's messages: ``(reward, BFCL error_type, calls made)``."""
    tools = bfcl.tools_for(task["function"])
    message = await _ask(client, llm, list(task["question"][0]), tools, task)
    calls = _calls(message)
    _mark(calls, _names(tools))
    if not calls and not is_irrelevance(task["category"]):
        agl.emit_exception(ValueError("the reply names no function"))
    reward, error = score(task, calls)
    return reward, error, len(calls)


def _as_dict(message: Any, calls: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if calls:
        out["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ]
    return out


def _execute(calls: list[dict[str, Any]], task: dict[str, Any], run_name: str) -> list[str]:
    from examples.bfcl_agent.reward import decode

    try:
        strings = bfcl.convert_to_calls(decode(calls))
    except (ValueError, TypeError) as exc:
        return [f"Error during execution: {exc}"] * len(calls)
    return bfcl.execute(strings, task, run_name)


async def multi_turn(client: Any, llm: Any, task: dict[str, Any]) -> tuple[float, str | None, int]:
    """BFCL's function-calling loop over the case's turns: ``(reward, BFCL error_type, calls made)``."""
    tools, run_name = bfcl.tools_for(task["function"]), f"agl_{uuid.uuid4().hex[:12]}"
    names, messages, steps, made = _names(tools), [], [], 0
    try:
        for turn in task["question"]:
            messages.extend(turn)
            turn_steps: list[list[dict[str, Any]]] = []
            for _ in range(MAX_STEPS):
                message = await _ask(client, llm, messages, tools, task)
                calls = _calls(message)
                messages.append(_as_dict(message, calls))
                if not calls:
                    break
                results = _execute(calls, task, run_name)
                _mark(calls, names, results)
                turn_steps.append(calls)
                made += len(calls)
                messages.extend(
                    {"role": "tool", "content": r, "tool_call_id": c["id"]}
                    for c, r in zip(calls, results, strict=True)
                )
            if not turn_steps:
                agl.emit_exception(ValueError("the turn's replies name no function"))
            steps.append(turn_steps)
    finally:
        bfcl.forget(run_name)
    reward, error = score_multi_turn(task, steps, run_name + "_check")
    return reward, error, made


async def run_case(client: Any, llm: Any, task: dict[str, Any]) -> tuple[float, str | None, int]:
    """The case's ``(reward, BFCL error_type, calls made)`` by its kind (single- or multi-turn)."""
    with agl.agent(AGENT):
        if task["category"].startswith("multi_turn"):
            return await multi_turn(client, llm, task)
        return await single_turn(client, llm, task)


def make_rollout() -> Any:
    """The rollout function the trainer runs: ``async (task, resources) -> reward``. BFCL's error type
    of each rollout is emitted as an ``agl.object`` span (``{"bfcl_error": ...}``) for the eval table."""
    import openai

    agl.instrument("openai")

    @agl.rollout
    async def bfcl_rollout(task: dict[str, Any], resources: agl.Resources) -> float:
        llm = resources.llm
        client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "agl", max_retries=0)
        try:
            reward, error, made = await run_case(client, llm, task)
        finally:
            await client.close()
        agl.emit_object({"bfcl_id": task["id"], "bfcl_error": error, "calls": made})
        return reward

    return bfcl_rollout


#: for ``agl train --agent examples.bfcl_agent.agent:bfcl_agent`` (run.yaml)
async def bfcl_agent(task: dict[str, Any], resources: Any) -> float:
    global _default
    if _default is None:
        _default = make_rollout()
    return await _default(task, resources)


_default: Any = None
