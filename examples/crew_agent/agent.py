"""The profile-writing crew: a CrewAI app, written the way a CrewAI user writes one.

    researcher (lookup tool) ──► writer

``researcher`` looks the company up in the fact base with the ``lookup`` tool (an unknown key is an
error, which CrewAI reports back to the agent) and reports the facts the task asks for; ``writer``
turns them into a short profile. The crew's output is the writer's text, and the reward is the share
of the asked-for facts it states (``reward.coverage``). Only the writer is trained: the researcher's
calls are left out of the transitions by the adapter's agent selection.

The only agl code is in :func:`make_rollout`: ``agl.instrument()`` and the rollout function that
builds the crew on the endpoint the trainer hands it and returns the reward. CrewAI's own telemetry
and trace upload are switched off (its documented environment variables) before CrewAI is imported.
"""

from __future__ import annotations

import os
from typing import Any

# CrewAI phones home (anonymous telemetry, trace upload) unless told not to; set before importing it.
os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")

from crewai import LLM, Agent, Crew, Process, Task  # noqa: E402
from crewai.tools import tool  # noqa: E402

from examples.crew_agent import data  # noqa: E402
from examples.crew_agent.reward import coverage  # noqa: E402

__all__ = ["TRAINED_AGENTS", "build_crew", "crew_inputs", "make_lookup", "make_rollout"]

#: the agents whose LLM calls are trained
TRAINED_AGENTS = ["writer"]

RESEARCH = (
    "Use the lookup tool with the key {company} to find the facts about the company {company}. "
    "Report its {asked}."
)
WRITE = "Write a short profile of the company {company} in two or three sentences. Mention its {asked}."


def make_lookup(directory: dict[str, dict[str, str]]) -> Any:
    @tool("lookup")
    def lookup(key: str) -> str:
        """Look up the facts about a company by its key, the company's name (e.g. "Ventor Corp")."""
        entry = directory.get(data.lookup_key(key))
        if entry is None:
            raise KeyError(f"unknown key {key!r}: no company of that name in the fact base")
        return data.fact_lines(entry)

    return lookup


def build_crew(llm: Any, directory: dict[str, dict[str, str]], *, researcher_llm: Any = None) -> Crew:
    """The crew; ``researcher_llm`` runs the researcher on another model (default: ``llm``)."""
    researcher = Agent(
        role="researcher",
        goal="Find the facts a writing task needs, using the lookup tool",
        backstory="You check every fact in the company fact base and never guess.",
        tools=[make_lookup(directory)],
        llm=researcher_llm or llm,
        allow_delegation=False,
        max_iter=3,
    )
    writer = Agent(
        role="writer",
        goal="Write short company profiles that state the facts exactly",
        backstory="You write for a business directory.",
        llm=llm,
        allow_delegation=False,
        max_iter=2,
    )
    research = Task(description=RESEARCH, expected_output="The facts, one per line.", agent=researcher)
    write = Task(description=WRITE, expected_output="A profile of two or three sentences.", agent=writer)
    return Crew(agents=[researcher, writer], tasks=[research, write], process=Process.sequential)


def crew_inputs(task: dict[str, Any]) -> dict[str, str]:
    names = [data.FACTS[f] for f in task["facts"]]
    asked = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return {"company": task["company"], "asked": asked}


def make_rollout(researcher: dict[str, str] | None = None) -> Any:
    """The rollout function the trainer runs: ``(task, resources) -> reward``.

    ``researcher`` (``{"base_url", "model", "api_key"}``) puts the researcher on a fixed endpoint —
    e.g. a strong hosted model — while the writer runs on (and is trained through) the trainer's
    endpoint; by default both run on the trainer's endpoint.
    """
    import agl

    agl.instrument("openai", "crewai")

    @agl.rollout
    def crew_agent(task: dict[str, Any], resources: agl.Resources) -> float:
        llm = resources.llm
        model = LLM(
            model=f"openai/{llm.model}",
            base_url=llm.base_url,
            api_key=llm.api_key or "agl",
            # held-out tasks carry temperature 0: they are decoded greedily (see cli.py)
            temperature=task.get("temperature", llm.sampling.get("temperature", 0.0)),
            max_tokens=llm.sampling.get("max_tokens", 128),
            max_retries=0,
        )
        directory = data.build_directory(task.get("seed", data.SEED), task.get("size", data.DEFAULT_SIZE))
        fixed = None
        if researcher is not None:
            fixed = LLM(
                model=f"openai/{researcher['model']}",
                base_url=researcher["base_url"],
                api_key=researcher.get("api_key") or "agl",
                temperature=0.0,
                max_tokens=llm.sampling.get("max_tokens", 128),
                max_retries=0,
            )
        result = build_crew(model, directory, researcher_llm=fixed).kickoff(inputs=crew_inputs(task))
        return coverage(result.raw, task["gold"])

    return crew_agent


#: for ``agl runner --agent examples.crew_agent.agent:crew_agent``
def crew_agent(task: dict[str, Any], resources: Any) -> float:
    global _default
    if _default is None:
        _default = make_rollout()
    return _default(task, resources)


_default: Any = None
