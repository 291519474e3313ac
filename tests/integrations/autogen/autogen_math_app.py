"""The math team the AutoGen tests train: an unmodified AutoGen AgentChat program.

``solver`` (an ``AssistantAgent`` with a ``calculator`` ``FunctionTool``, which fails on a malformed
expression) works the question out; ``verifier`` checks the answer and says ``VERIFIED``, which ends
the team's run. The team is a ``RoundRobinGroupChat`` or a ``SelectorGroupChat`` (the model picks the
next speaker). ``policy`` is the scripted model behind the gateway: it plays each role, recognised by
its system prompt, deterministically; a question tagged ``[sloppy]`` makes the solver send a malformed
expression first, so that rollout has one failing tool call for AIR to penalise.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any, Literal

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination, TextMentionTermination
from autogen_agentchat.teams import RoundRobinGroupChat, SelectorGroupChat
from autogen_core.tools import FunctionTool
from autogen_ext.models.openai import OpenAIChatCompletionClient

from agl.gateway.testing import reply, tool_call

TeamKind = Literal["round_robin", "selector"]
SELECTOR = "SelectorGroupChatManager"  # the selector's LLM calls are its group chat manager's turns

SOLVER = "You are the solver agent. Work out arithmetic questions with the calculator tool."
VERIFIER = "You are the verifier agent. Check the solver's answer and reply VERIFIED when it is right."
SELECTOR_MARK = "select the next role"  # in AutoGen's default selector prompt
MALFORMED_ERROR = "malformed expression"

#: ``model_info`` is required for model names AutoGen does not know (anything but OpenAI's own)
MODEL_INFO: dict[str, Any] = {
    "vision": False,
    "function_calling": True,
    "json_output": False,
    "structured_output": False,
    "family": "unknown",
}

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"{MALFORMED_ERROR}: unsupported {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 6*7 or (2+3)/5."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"{MALFORMED_ERROR}: {expression!r}") from exc
    value = _eval(tree.body)
    return str(int(value)) if float(value).is_integer() else str(value)


def make_client(base_url: str, model: str = "scripted", **kwargs: Any) -> OpenAIChatCompletionClient:
    return OpenAIChatCompletionClient(
        model=model, base_url=base_url, api_key="sk-agl-test", model_info=MODEL_INFO, max_retries=0, **kwargs
    )


def build_solver(client: Any, *, stream: bool = False) -> AssistantAgent:
    return AssistantAgent(
        "solver",
        model_client=client,
        system_message=SOLVER,
        tools=[FunctionTool(calculator, description="Evaluate an arithmetic expression.")],
        max_tool_iterations=3,
        model_client_stream=stream,
    )


def build_team(client: Any, kind: TeamKind = "round_robin", *, stream: bool = False) -> Any:
    """The agents and the team, wired as the user would write them."""
    solver = build_solver(client, stream=stream)
    verifier = AssistantAgent(
        "verifier", model_client=client, system_message=VERIFIER, model_client_stream=stream
    )
    done = TextMentionTermination("VERIFIED") | MaxMessageTermination(12)
    if kind == "selector":
        return SelectorGroupChat(
            [solver, verifier],
            model_client=client,
            termination_condition=done,
            allow_repeated_speaker=True,  # so the model picks every speaker, the verifier included
            model_client_streaming=stream,
        )
    return RoundRobinGroupChat([solver, verifier], termination_condition=done)


# ---------------------------------------------------------------------------------- scripted model


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def role_of(messages: list[dict[str, Any]]) -> str | None:
    """Which role a request comes from: its system prompt (or the selector's prompt)."""
    text = " ".join(_text(m.get("content")) for m in messages if m.get("role") in ("system", "user"))
    system = " ".join(_text(m.get("content")) for m in messages if m.get("role") == "system")
    if SOLVER in system:
        return "solver"
    if VERIFIER in system:
        return "verifier"
    if SELECTOR_MARK in text:
        return "selector"
    return None


def expression_of(question: str) -> str:
    found = re.search(r"What is ([0-9+\-*/(). ]+)\?", question)
    return found.group(1).strip() if found else ""


def policy(messages: list[dict[str, Any]]) -> Any:
    """The scripted model's reply to a chat request."""
    role = role_of(messages)
    transcript = " ".join(_text(m.get("content")) for m in messages)
    if role == "selector":
        return reply("verifier" if "ANSWER:" in transcript else "solver")
    question = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    if role == "verifier":
        found = re.search(r"ANSWER: (\S+)", transcript)
        ok = found is not None and calculator(expression_of(question)) == found.group(1)
        return reply(f"VERIFIED {found.group(1)}" if ok and found else "WRONG")
    if role == "solver":
        results = [_text(m.get("content")) for m in messages if m.get("role") == "tool"]
        good = [r for r in results if MALFORMED_ERROR not in r]
        if good:
            return reply(f"ANSWER: {good[-1]}")
        expression = expression_of(question)
        if "[sloppy]" in question and not results:
            return reply(None, tool_call("calculator", expression=expression + ")"))
        return reply(None, tool_call("calculator", expression=expression))
    return reply(f"unexpected request: {messages[:1]!r}")


def expected_calls(question: str, kind: TeamKind = "round_robin") -> list[tuple[str, str]]:
    """(agent, what the reply does) for every LLM call a rollout of ``question`` makes, in order."""
    solver = [("solver", "calculator")]
    if "[sloppy]" in question:
        solver.append(("solver", "calculator"))  # the malformed expression first, which fails
    solver.append(("solver", "ANSWER"))
    if kind == "selector":
        return [(SELECTOR, "solver"), *solver, (SELECTOR, "verifier"), ("verifier", "VERIFIED")]
    return [*solver, ("verifier", "VERIFIED")]
