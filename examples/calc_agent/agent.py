"""The calculator agent: an AutoGen AgentChat ``AssistantAgent``, written the way AutoGen users write
one — a model client, a Python function as its tool, a system message.

The agent reads a word problem, calls ``calculator`` with an arithmetic expression (as many times as
it needs, up to ``MAX_TOOL_ITERATIONS``), reflects on the results and answers ``ANSWER: <number>``.
``calculator`` evaluates + - * / ** % and parentheses safely (no ``eval``) and raises on anything
else; AutoGen hands the error back to the model as the tool's result, the ``execute_tool`` span is
ERROR, and AIR penalises the LLM call that wrote the malformed call (matched by its tool-call id).

The only agl code is in :func:`make_rollout` — ``agl.instrument()`` and the rollout function that
runs the agent on the endpoint the trainer hands it and returns the exact-answer reward — and the
system message read through ``agl.prompt`` (the default outside APO; a candidate prompt inside it).
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any

from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient

import agl
from examples.calc_agent.reward import exact_match, final_text

__all__ = ["AGENT", "MAX_TOOL_ITERATIONS", "SYSTEM", "build_agent", "calculator", "make_rollout"]

AGENT = "solver"
MAX_TOOL_ITERATIONS = 3
SYSTEM = (
    "You solve arithmetic word problems. Use the calculator tool to compute: pass it one arithmetic "
    "expression with numbers and + - * / ( ). When you know the result, reply with the final answer "
    "as 'ANSWER: <number>'."
)

#: what AutoGen needs to know about a model it has no card for (any model served by agl's gateway)
MODEL_INFO: dict[str, Any] = {
    "vision": False,
    "function_calling": True,
    "json_output": False,
    "structured_output": False,
    "family": "unknown",
}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > 64):
            raise ValueError("exponents must be whole numbers up to 64")
        if isinstance(node.op, (ast.Div, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        return Fraction(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported element {type(node).__name__!r}: use numbers, + - * / % ** and ( )")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as '12 * 7 - 5' or '(93 + 79 + 77) / 3'."""
    text = str(expression).replace("×", "*").replace("÷", "/").replace(",", "").replace("$", "").strip()
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"malformed expression: {expression!r}") from None
    value = _eval(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def build_agent(model_client: OpenAIChatCompletionClient) -> AssistantAgent:
    return AssistantAgent(
        AGENT,
        model_client=model_client,
        tools=[calculator],
        system_message=agl.prompt(AGENT, default=SYSTEM),  # the one line APO needs
        reflect_on_tool_use=True,
        max_tool_iterations=MAX_TOOL_ITERATIONS,
    )


def make_rollout() -> Any:
    """The rollout function the trainer runs: ``async (task, resources) -> reward``."""
    import agl

    agl.instrument("openai", "autogen")

    @agl.rollout
    async def calc_agent(task: dict[str, Any], resources: agl.Resources) -> float:
        llm = resources.llm
        sampling = llm.sampling
        client = OpenAIChatCompletionClient(
            model=llm.model,
            base_url=llm.base_url,
            api_key=llm.api_key or "agl",
            model_info=MODEL_INFO,
            # held-out tasks carry temperature 0: they are decoded greedily (see cli.py)
            temperature=task.get("temperature", sampling.get("temperature", 0.0)),
            max_tokens=sampling.get("max_tokens", 256),
            max_retries=0,
        )
        try:
            result = await build_agent(client).run(task=task["question"])
        finally:
            await client.close()
        return exact_match(final_text(result.messages), task["answer"])

    return calc_agent


#: for ``agl runner --agent examples.calc_agent.agent:calc_agent``
async def calc_agent(task: dict[str, Any], resources: Any) -> float:
    global _default
    if _default is None:
        _default = make_rollout()
    return await _default(task, resources)


_default: Any = None
