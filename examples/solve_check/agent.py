"""A solver and a checker: one app, two agents, on one base model, that need opposite behaviour.

Both agents see the same question and the same calculator log (learn_on_cpu's ``calculator`` tool,
``execute_tool`` spans), and their prompts differ in one line and the system message:

- **solver** must reply exactly ``Answer: <number>``, the calculator's result (learn_on_cpu's task);
- **checker** is shown a proposed ``Answer: <number>`` (right for half the tasks, a near miss for the
  other half) and must reply exactly ``Verdict: correct`` or ``Verdict: wrong``.

What one agent is rewarded for, the other is punished for: the solver for ending on ``Answer: N``,
the checker for anything but a verdict, on nearly the same context, and the checker must contradict a
stated answer half the time. A shared policy is pulled both ways on the same tokens; an adapter per
agent is not. Written with no agent framework: ``agl.agent(name)`` makes each agent's span and puts
its name on the outgoing requests (W3C baggage), which is how each call reaches its agent's adapter.

Reward: the mean of the solver's and the checker's (0 or 1 each, strict formats), returned as the
rollout's reward: what GRPO trains on, for both agents. Each agent's own score is recomputed from the
stored transitions (:func:`agent_scores`), not emitted as reward spans: the adapter would add those to
the calls as intermediate rewards and train on them twice.
"""

from __future__ import annotations

import re
from typing import Any

import agl
from examples.learn_on_cpu.agent import build_messages, calculator
from examples.learn_on_cpu.agent import reward as solver_reward

__all__ = [
    "AGENTS",
    "CHECKER_SYSTEM",
    "agent_scores",
    "checker_messages",
    "checker_reward",
    "oracle",
    "solve_check",
]

agl.instrument("openai")  # client-side chat spans + trace headers; idempotent

AGENTS = ["solver", "checker"]
CHECKER_SYSTEM = "You are a checker. Reply with exactly one line: Verdict: correct or Verdict: wrong"
#: the reply format shown once, on an unrelated question (as learn_on_cpu shows the solver's)
CHECK_EXAMPLE = [
    {"role": "user", "content": "How many legs does a spider have?\nProposed: Answer: 6"},
    {"role": "assistant", "content": "Verdict: wrong"},
]
VERDICT = re.compile(r"\s*Verdict:\s*(correct|wrong)\s*")


def checker_messages(question: str, steps: list[str], proposal: int) -> list[dict[str, str]]:
    tool_log = "\n".join(f"Calculator: {s}" for s in steps)
    return [
        {"role": "system", "content": CHECKER_SYSTEM},
        *CHECK_EXAMPLE,
        {"role": "user", "content": f"{question}\n{tool_log}\nProposed: Answer: {proposal}"},
    ]


def checker_reward(reply: str | None, proposal: int, answer: int) -> float:
    """1 for exactly ``Verdict: correct`` on a right proposal or ``Verdict: wrong`` on a wrong one."""
    m = VERDICT.fullmatch(reply or "")
    if m is None:
        return 0.0
    return 1.0 if (m.group(1) == "correct") == (proposal == answer) else 0.0


def _chat(client: Any, llm: agl.LLM, messages: list[dict[str, str]]) -> str | None:
    sampling = {k: v for k, v in llm.sampling.items() if k in ("temperature", "top_p", "max_tokens")}
    out = client.chat.completions.create(model=llm.model, messages=messages, **sampling)
    return out.choices[0].message.content


def agent_scores(task: dict[str, Any], replies: dict[str, str | None]) -> dict[str, float]:
    """Each agent's own score for one rollout, from its reply (``{"solver": text, "checker": text}``)."""
    out = {}
    if "solver" in replies:
        out["solver"] = solver_reward(replies["solver"], task["answer"])
    if "checker" in replies:
        out["checker"] = checker_reward(replies["checker"], task["proposal"], task["answer"])
    return out


_RESULT = re.compile(r"Calculator: .* = (-?\d+)\s*$", re.M)
_PROPOSED = re.compile(r"Proposed: Answer: (-?\d+)\s*$", re.M)


def oracle(request: Any) -> str:
    """The scripted model of ``dev --backend scripted``: each agent's right reply, read off its prompt
    (the calculator's last result; the proposal compared with it)."""
    prompt = request.messages[-1]["content"]
    result = _RESULT.findall(prompt)[-1]
    if request.messages[0]["content"] != CHECKER_SYSTEM:
        return f"Answer: {result}"
    proposed = _PROPOSED.search(prompt)
    return "Verdict: correct" if proposed and proposed.group(1) == result else "Verdict: wrong"


@agl.rollout
def solve_check(task: dict[str, Any], resources: agl.Resources) -> float:
    """One rollout: the solver answers, the checker judges the task's proposal; the mean score."""
    import openai

    llm = resources.llm
    if llm is None:
        raise ValueError("the resources name no LLM")
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "agl", max_retries=0)
    try:
        with agl.agent("solver"):
            steps = calculator(task["expression"])
            solved = solver_reward(
                _chat(client, llm, build_messages(task["question"], steps)), task["answer"]
            )
        with agl.agent("checker"):
            reply = _chat(client, llm, checker_messages(task["question"], steps, task["proposal"]))
            checked = checker_reward(reply, task["proposal"], task["answer"])
    finally:
        client.close()
    # the rollout's one reward (the runner records the return value); each agent's own score is
    # recomputed from the stored replies (agent_scores): emitted as rewards beside it, the adapter
    # would add them to the checker's call as intermediate rewards and train on them twice
    return (solved + checked) / 2
