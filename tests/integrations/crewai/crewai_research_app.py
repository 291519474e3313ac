"""The CrewAI app of the shared scenario: a ``researcher`` with a ``lookup`` tool, then a ``writer``.

The researcher looks a country's capital up (the tool raises on an unknown key, and a "[sloppy]"
question makes the scripted model misspell the key first), the writer turns the fact into a sentence.
Only the writer is trained. The scripted model's policy reads which agent is asking from the system
prompt CrewAI builds from the agent's role, so one gateway serves every agent and process.

Nothing here imports CrewAI at module level except through ``build_crew``/``lookup`` users that have
already passed ``pytest.importorskip("crewai")``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from agl.gateway.testing import reply, tool_call

FACTS = {"france": "Paris is the capital of France.", "japan": "Tokyo is the capital of Japan."}
SLOPPY = "[sloppy]"
WRONG_TOOL = "[wrong-tool]"  # the researcher first asks for a tool it does not have
LLM_ERROR = "[llm-error]"  # the gateway answers 502
PARALLEL = "[parallel]"  # the researcher asks for both lookups in one response
MANAGER = "Crew Manager"  # CrewAI's role for the manager it creates in a hierarchical crew
DELEGATE = "delegate_work_to_coworker"


def lookup_fact(key: str) -> str:
    """The tool body: a fact by key; an unknown key raises (CrewAI reports that to the agent)."""
    if key not in FACTS:
        raise KeyError(f"unknown key {key!r}; known keys: {', '.join(sorted(FACTS))}")
    return FACTS[key]


def make_tools(kind: str = "decorator") -> list[Any]:
    """The lookup tool as ``@tool`` function or as a ``BaseTool`` subclass (both CrewAI styles);
    ``"failure"``: a ``@tool`` that *returns* CrewAI's ``ToolFailure`` instead of raising."""
    from crewai.tools import BaseTool, ToolFailure, tool
    from pydantic import BaseModel, Field

    if kind == "failure":

        @tool("lookup")
        def lookup_reporting(key: str) -> Any:
            """Look a fact up by its key (a lowercase country name)."""
            if key not in FACTS:
                return ToolFailure(message=f"unknown key {key!r}", code="unknown_key")
            return FACTS[key]

        return [lookup_reporting]

    if kind == "decorator":

        @tool("lookup")
        def lookup(key: str) -> str:
            """Look a fact up by its key (a lowercase country name)."""
            return lookup_fact(key)

        return [lookup]

    class LookupInput(BaseModel):
        key: str = Field(description="a lowercase country name")

    class LookupTool(BaseTool):
        name: str = "lookup"
        description: str = "Look a fact up by its key (a lowercase country name)."
        args_schema: type[BaseModel] = LookupInput

        def _run(self, key: str) -> str:
            return lookup_fact(key)

    return [LookupTool()]


def make_llm(base_url: str, *, stream: bool = False, text_tools: bool = False) -> Any:
    """CrewAI's native OpenAI provider pointed at agl's gateway.

    ``text_tools`` makes CrewAI use its ReAct text protocol (Thought/Action/Action Input) instead of
    native function calling, as it does for models without function calling.
    """
    from crewai import LLM
    from crewai.llms.providers.openai.completion import OpenAICompletion

    if not text_tools:
        return LLM(model="openai/scripted", base_url=base_url, api_key="sk-agl-test", stream=stream)

    class TextToolsLLM(OpenAICompletion):
        def supports_function_calling(self) -> bool:
            return False

    return TextToolsLLM(model="scripted", base_url=base_url, api_key="sk-agl-test", stream=stream)


def build_crew(
    llm: Any, *, process: str = "sequential", tools: str = "decorator", stream: bool = False
) -> Any:
    from crewai import Agent, Crew, Process, Task

    researcher = Agent(
        role="researcher",
        goal="Find facts with the lookup tool",
        backstory="You look facts up and never guess.",
        tools=make_tools(tools),
        llm=llm,
        allow_delegation=False,
        max_iter=6,
    )
    writer = Agent(
        role="writer",
        goal="Write one clear sentence",
        backstory="You turn facts into prose.",
        llm=llm,
        allow_delegation=False,
        max_iter=3,
    )
    research = Task(
        description="Find the capital of {country} {flag}",
        expected_output="the fact",
        agent=researcher if process == "sequential" else None,
    )
    write = Task(
        description="Write one sentence saying what the capital of {country} is",
        expected_output="one sentence",
        agent=writer if process == "sequential" else None,
    )
    kwargs: dict[str, Any] = {}
    if process == "hierarchical":
        kwargs = {"process": Process.hierarchical, "manager_llm": llm}
    return Crew(agents=[researcher, writer], tasks=[research, write], stream=stream, **kwargs)


def crew_inputs(task: dict[str, Any]) -> dict[str, str]:
    flags = [SLOPPY] if task.get("sloppy") else []
    if task.get("wrong_tool"):
        flags.append(WRONG_TOOL)
    if task.get("parallel"):
        flags.append(PARALLEL)
    return {"country": task["country"], "flag": " ".join(flags)}


# ------------------------------------------------------------------------------- the scripted model


def agent_of(messages: list[dict[str, Any]]) -> str | None:
    """Which agent is asking: CrewAI's system prompt starts with "You are {role}."."""
    for m in messages:
        if m.get("role") == "system":
            found = re.match(r"\s*You are (.+?)\.", str(m.get("content") or ""))
            if found:
                return found.group(1)
    return None


def _text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(str(m.get("content") or "") for m in messages)


def _country(messages: list[dict[str, Any]]) -> str:
    found = re.search(r"capital of (\w+)", _text([m for m in messages if m.get("role") == "user"]))
    return found.group(1).lower() if found else "france"


def _observations(messages: list[dict[str, Any]], native: bool) -> int:
    if native:
        return sum(1 for m in messages if m.get("role") == "tool")
    return sum(
        str(m.get("content") or "").count("Observation:") for m in messages if m.get("role") != "system"
    )


def _react(thought: str, action: str, args: dict[str, Any]) -> str:
    return f"Thought: {thought}\nAction: {action}\nAction Input: {json.dumps(args)}"


def policy(request: Any) -> Any:
    """The scripted model: what each agent says next, given the conversation so far."""
    messages = request.messages
    if LLM_ERROR in _text(messages):
        return reply(error="the scripted model was told to fail")
    agent = agent_of(messages)
    native = bool(request.tools)
    seen = _observations(messages, native)
    country = _country(messages)
    if agent == "researcher":
        sloppy = SLOPPY in _text(messages)
        keys = ([country[:-1] + "x"] if sloppy else []) + [country]  # "francx": not a known key
        if WRONG_TOOL in _text(messages):
            keys = [""] + keys  # "" stands for a call of a tool the researcher does not have
        if native and PARALLEL in _text(messages) and seen == 0:
            return reply(None, *(tool_call("lookup", {"key": k}) for k in keys))
        if PARALLEL in _text(messages):
            seen = len(keys)
        if seen < len(keys):
            args = {"key": keys[seen]}
            name = "encyclopedia" if not keys[seen] else "lookup"
            if native:
                return reply(None, tool_call(name, args))
            return reply(_react("I must look it up.", name, args))
        return reply(f"Thought: I know it now.\nFinal Answer: {FACTS[country]}")
    if agent == "writer":
        capital = FACTS[country].split(" ")[0]
        return reply(
            f"Thought: I can write it.\nFinal Answer: The capital of {country.title()} is {capital}."
        )
    if agent == MANAGER:
        # one delegation per task: research tasks to the researcher, writing tasks to the writer
        writing = "Write one sentence" in _text([m for m in messages if m.get("role") == "user"])
        coworker = "writer" if writing else "researcher"
        if seen == 0:
            args = {
                "task": f"{'Write one sentence about' if writing else 'Find'} the capital of {country}",
                "context": "A question about capitals.",
                "coworker": coworker,
            }
            if native:
                return reply(None, tool_call(DELEGATE, args))
            return reply(_react("I will delegate.", "Delegate work to coworker", args))
        capital = FACTS[country].split(" ")[0]
        return reply(f"The capital of {country.title()} is {capital}.")
    return reply("Final Answer: I do not know who I am.")


def expected_calls(task: dict[str, Any], process: str = "sequential") -> list[str]:
    """The agents of the LLM calls one sequential crew run makes, in order."""
    research = ["researcher"] * (3 if task.get("sloppy") else 2)
    if process == "sequential":
        return [*research, "writer"]
    # the manager delegates each task (the question's flag stays with it) and answers once its
    # coworker has answered
    return [MANAGER, "researcher", "researcher", MANAGER, MANAGER, "writer", MANAGER]
