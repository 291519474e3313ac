"""A calculator agent, instrumented with agl, written as any OpenAI-client agent would be.

The agent works a question out with its ``calculator`` tool (each step is an ``execute_tool`` span),
then asks the LLM for the final reply, which must be exactly one line ``Answer: <number>``. The
reward is 1 for a reply in that format with the right number and 0 otherwise — strict, as a program
parsing the agent's output would be. The LLM is whatever ``resources`` names: the gateway serving the
policy during training, or any OpenAI-compatible endpoint in ``dev``.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

import agl
from agl import semconv as sc
from agl.tracing.provider import get_tracer

__all__ = ["SYSTEM", "build_messages", "calc_agent", "calculate", "reward"]

agl.instrument("openai")  # client-side chat spans + trace headers; idempotent

SYSTEM = "You are a calculator agent. Reply with exactly one line: Answer: <number>"
ANSWER = re.compile(r"\s*Answer:\s*(-?\d+)\s*")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def calculate(expression: str, log: list[str] | None = None) -> float:
    """Evaluate + - * / and parentheses over numbers, nothing else; ``log`` collects the steps."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            value = _OPS[type(node.op)](left, right)
            if log is not None:
                log.append(f"{_fmt(left)} {_SYMBOL[type(node.op)]} {_fmt(right)} = {_fmt(value)}")
            return value
        raise ValueError(f"the calculator does not understand {ast.dump(node)[:60]}")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc
    return ev(tree)


def calculator(expression: str) -> list[str]:
    """The agent's tool, traced as an ``execute_tool`` span (ERROR status when it fails)."""
    with get_tracer("examples.learn_on_cpu").start_as_current_span(
        sc.SPAN_EXECUTE_TOOL,
        attributes={
            sc.GEN_AI_OPERATION_NAME: sc.OP_EXECUTE_TOOL,
            sc.GEN_AI_TOOL_NAME: "calculator",
            sc.GEN_AI_TOOL_CALL_ARGUMENTS: json.dumps({"expression": expression}),
        },
    ) as span:
        steps: list[str] = []
        calculate(expression, steps)  # raises: the span records the exception and ERROR status
        span.set_attribute(sc.GEN_AI_TOOL_CALL_RESULT, json.dumps(steps))
        return steps


#: The reply format is shown once, on an unrelated question: SmolLM2-135M then follows it for about a
#: quarter of arithmetic questions (low but not zero: GRPO has signal), and learns to always do so.
EXAMPLE = [
    {"role": "user", "content": "How many legs does a spider have?"},
    {"role": "assistant", "content": "Answer: 8"},
]


def build_messages(question: str, steps: list[str]) -> list[dict[str, str]]:
    tool_log = "\n".join(f"Calculator: {s}" for s in steps)
    return [
        {"role": "system", "content": SYSTEM},
        *EXAMPLE,
        {"role": "user", "content": f"{question}\n{tool_log}"},
    ]


def reward(reply: str | None, answer: int) -> float:
    m = ANSWER.fullmatch(reply or "")
    return 1.0 if m is not None and int(m.group(1)) == answer else 0.0


@agl.rollout
def calc_agent(task: dict[str, Any], resources: agl.Resources) -> float:
    import openai

    llm = resources.llm
    if llm is None:
        raise ValueError("the resources name no LLM")
    with get_tracer("examples.learn_on_cpu").start_as_current_span(
        sc.SPAN_INVOKE_AGENT,
        attributes={sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT, sc.GEN_AI_AGENT_NAME: "calculator_agent"},
    ):
        steps = calculator(task["expression"])
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "agl", max_retries=0)
        sampling = {k: v for k, v in llm.sampling.items() if k in ("temperature", "top_p", "max_tokens")}
        out = client.chat.completions.create(
            model=llm.model, messages=build_messages(task["question"], steps), **sampling
        )
        client.close()
        return reward(out.choices[0].message.content, task["answer"])
