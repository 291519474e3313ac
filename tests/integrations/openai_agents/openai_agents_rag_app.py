"""The retrieval-QA app the OpenAI Agents SDK tests train: an unmodified Agents SDK program.

``triage`` hands every question to ``researcher``, which searches a small local corpus with the
``search`` tool (it fails on an empty query, on purpose) and hands off to ``answerer``, which writes
the answer. ``policy`` is the scripted model behind the gateway: it plays each agent, recognised by
its instructions, deterministically; a question tagged ``[sloppy]`` makes the researcher send an
empty query first, so that rollout has one failing tool call for AIR to penalise.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from agents import (
    Agent,
    GuardrailFunctionOutput,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunContextWrapper,
    TracingProcessor,
    function_tool,
    input_guardrail,
)
from openai import AsyncOpenAI

from agl.gateway.testing import reply, tool_call

Api = Literal["chat", "responses"]

CORPUS: dict[str, str] = {
    "france": "Paris is the capital of France.",
    "japan": "Tokyo is the capital of Japan.",
    "peru": "Lima is the capital of Peru.",
    "kenya": "Nairobi is the capital of Kenya.",
}

TRIAGE = "You are the triage agent. Hand research questions to the researcher."
RESEARCHER = "You are the researcher agent. Search the corpus, then hand off to the answerer."
ANSWERER = "You are the answerer agent. Answer the question from the documents found."
SDK_TOOL_ERROR_PREFIX = "An error occurred while running the tool"  # the SDK's default failure message


def search_corpus(query: str) -> str:
    words = [w.strip("?.,!").lower() for w in query.split()]
    words = [w for w in words if w]
    if not words:
        raise ValueError("search needs a non-empty query")
    hits = [doc for key, doc in CORPUS.items() if key in words]
    return "\n".join(hits) if hits else "no documents found"


@function_tool
def search(query: str) -> str:
    """Search the local corpus for documents about the query."""
    return search_corpus(query)


@input_guardrail
def question_not_empty(ctx: RunContextWrapper[Any], agent: Agent[Any], input: Any) -> GuardrailFunctionOutput:
    text = input if isinstance(input, str) else json.dumps(input)
    return GuardrailFunctionOutput(output_info={"chars": len(text)}, tripwire_triggered=not text.strip())


def make_model(api: Api, base_url: str, model: str = "scripted") -> Any:
    client = AsyncOpenAI(base_url=base_url, api_key="sk-agl-test", max_retries=0)
    if api == "chat":
        return OpenAIChatCompletionsModel(model=model, openai_client=client)
    return OpenAIResponsesModel(model=model, openai_client=client)


def build_app(model: Any) -> Agent[Any]:
    """The agents, wired as the user would write them; returns the entry agent (triage)."""
    answerer = Agent(name="answerer", instructions=ANSWERER, model=model)
    researcher = Agent(
        name="researcher", instructions=RESEARCHER, tools=[search], handoffs=[answerer], model=model
    )
    return Agent(
        name="triage",
        instructions=TRIAGE,
        handoffs=[researcher, answerer],
        input_guardrails=[question_not_empty],
        model=model,
    )


def question_topic(question: str) -> str:
    words = (w.strip("?.,!") for w in question.replace("[sloppy]", "").split())
    return " ".join(w for w in words if w.lower() in CORPUS)


# ---------------------------------------------------------------------------------- test helpers


class UserProcessor(TracingProcessor):
    """A processor the application registered itself (stands in for the SDK's uploader, which
    cannot reach OpenAI offline): agl must leave it in place and it must keep receiving spans."""

    def __init__(self) -> None:
        self.spans: list[Any] = []

    def on_trace_start(self, trace: Any) -> None:
        pass

    def on_trace_end(self, trace: Any) -> None:
        pass

    def on_span_start(self, span: Any) -> None:
        pass

    def on_span_end(self, span: Any) -> None:
        self.spans.append(span)

    def shutdown(self) -> None:
        pass

    def force_flush(self) -> None:
        pass


# ---------------------------------------------------------------------------------- scripted model


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def agent_of(messages: list[dict[str, Any]]) -> str | None:
    """Which agent a request comes from, read off its system prompt."""
    system = " ".join(_text(m.get("content")) for m in messages if m.get("role") == "system")
    for name, prompt in (("triage", TRIAGE), ("researcher", RESEARCHER), ("answerer", ANSWERER)):
        if prompt in system:
            return name
    return None


def policy(messages: list[dict[str, Any]]) -> Any:
    """The scripted model's reply to a chat request (the gateway gives both APIs as chat messages)."""
    agent = agent_of(messages)
    question = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    search_ids = {
        tc.get("id")
        for m in messages
        if m.get("role") == "assistant"
        for tc in m.get("tool_calls") or ()
        if (tc.get("function") or {}).get("name") == "search"
    }
    results = [
        _text(m.get("content"))
        for m in messages
        if m.get("role") == "tool" and m.get("tool_call_id") in search_ids
    ]
    ok = [r for r in results if not r.startswith(SDK_TOOL_ERROR_PREFIX)]
    if agent == "triage":
        return reply(None, tool_call("transfer_to_researcher"))
    if agent == "researcher":
        if ok:
            return reply(None, tool_call("transfer_to_answerer"))
        if "[sloppy]" in question and not results:
            return reply(None, tool_call("search", query=""))
        return reply(None, tool_call("search", query=question_topic(question)))
    if agent == "answerer":
        found = [doc for doc in CORPUS.values() if any(doc in _text(m.get("content")) for m in messages)]
        return reply(found[0] if found else "I do not know.")
    return reply(f"unexpected request: {messages[:1]!r}")


def expected_calls(question: str) -> list[tuple[str, str]]:
    """(agent, what the reply does) for every LLM call a rollout of ``question`` makes, in order."""
    calls = [("triage", "transfer_to_researcher")]
    if "[sloppy]" in question:
        calls.append(("researcher", "search"))  # the empty query, which fails
    calls += [("researcher", "search"), ("researcher", "transfer_to_answerer"), ("answerer", "text")]
    return calls
