"""The retrieval-QA agent: an OpenAI Agents SDK app, written the way an Agents SDK user writes one.

One agent, ``researcher``, answers a two-hop question about the synthetic world of ``data.py``. Its
only tool, ``search``, returns the ``TOP_K`` passages closest to a query by cosine similarity of
MiniLM embeddings (``retrieval.py``); an empty query is refused with an error, which the SDK hands
back to the model. The agent is asked to search once per hop and to end with
``<answer>…</answer>``; the run is capped at ``MAX_TURNS`` model calls.

The only agl code is in :func:`make_rollout`: ``agl.instrument()`` (with the SDK's own trace uploader
replaced, so nothing tries to reach OpenAI's tracing backend) and the rollout function that builds
the agent on the endpoint the trainer hands it and returns the reward. A failing ``search`` makes an
ERROR ``execute_tool`` span carrying the LLM's tool-call id, so AIR penalises the exact call that
issued it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from agents.exceptions import AgentsException
from openai import AsyncOpenAI

from examples.rag_agent import data
from examples.rag_agent.retrieval import Index
from examples.rag_agent.reward import reward

__all__ = ["INSTRUCTIONS", "MAX_TURNS", "TOP_K", "TRAINED_AGENTS", "build_agent", "get_index", "make_rollout"]

MAX_TURNS = 4  # two searches, the answer, and one spare call
TOP_K = 3
#: the agents whose LLM calls are trained
TRAINED_AGENTS = ["researcher"]

INSTRUCTIONS = (
    "You answer questions about people, companies and places using the search tool. Each question "
    "needs two searches: first search for the person or company named in the question, then search "
    "for the company, person or city that the first result mentions. When you know the answer, reply "
    "with only <answer>the answer</answer>."
)


def format_hits(hits: list[tuple[data.Passage, float]]) -> str:
    return "\n".join(f"[{i}] {p.title}: {p.text}" for i, (p, _) in enumerate(hits, 1))


def build_agent(index: Index, model: Any, settings: ModelSettings) -> Agent[Any]:
    @function_tool
    def search(query: str) -> str:
        """Search the encyclopedia for passages about a person, company or place."""
        return format_hits(index.search(query, TOP_K))

    return Agent(
        name="researcher", instructions=INSTRUCTIONS, tools=[search], model=model, model_settings=settings
    )


_indexes: dict[tuple[int, int, str], Index] = {}
_lock = threading.Lock()


def get_index(
    scale: int = data.DEFAULT_SCALE, seed: int = data.SEED, data_dir: str | os.PathLike[str] | None = None
) -> Index:
    """The corpus index for a world, built (or read from the embedding cache) once per process."""
    cache = str(data_dir) if data_dir is not None else str(data.default_data_dir())
    key = (scale, seed, cache)
    with _lock:
        if key not in _indexes:
            _indexes[key] = Index(data.passages(data.build_world(seed, scale)), cache_dir=cache)
        return _indexes[key]


def make_rollout(data_dir: str | os.PathLike[str] | None = None) -> Any:
    """The rollout function the trainer runs: ``(task, resources) -> reward``."""
    import agl

    # The SDK's default processor uploads traces to OpenAI: agl replaces it with its own.
    os.environ.setdefault("AGL_OPENAI_AGENTS_REPLACE_EXPORTER", "1")
    agl.instrument("openai", "openai_agents")

    @agl.rollout
    async def rag_agent(task: dict[str, Any], resources: agl.Resources) -> float:
        index = get_index(task.get("scale", data.DEFAULT_SCALE), task.get("seed", data.SEED), data_dir)
        llm = resources.llm
        client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "agl", max_retries=0)
        settings = ModelSettings(
            # held-out tasks carry temperature 0: they are decoded greedily (see cli.py)
            temperature=task.get("temperature", llm.sampling.get("temperature", 0.0)),
            max_tokens=llm.sampling.get("max_tokens", 128),
        )
        agent = build_agent(
            index, OpenAIChatCompletionsModel(model=llm.model, openai_client=client), settings
        )
        try:
            result = await Runner.run(
                agent, task["question"], max_turns=MAX_TURNS, run_config=RunConfig(workflow_name="rag_agent")
            )
        except AgentsException:  # too many turns, a call of a tool that does not exist, ...
            return reward(None, task["answer"])
        finally:
            await client.close()
        return reward(str(result.final_output), task["answer"])

    return rag_agent


#: for ``agl runner --agent examples.rag_agent.agent:rag_agent`` (embeddings in the default data dir)
async def rag_agent(task: dict[str, Any], resources: Any) -> float:
    global _default
    if _default is None:
        _default = make_rollout()
    return await _default(task, resources)


_default: Any = None
