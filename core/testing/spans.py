"""Span-tree assertions on what the store holds (what the adapter will train on)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agl import semconv as sc
from agl.types import Span

__all__ = ["AgentSpans", "SpanTree", "assert_agent_spans"]


@dataclass
class SpanTree:
    """The spans of one rollout as a tree: parents, children, and the agent each span ran under."""

    spans: list[Span]
    by_id: dict[str, Span] = field(init=False)

    def __post_init__(self) -> None:
        self.spans = sorted(self.spans, key=lambda s: (s.start_ns, s.seq or 0))
        self.by_id = {s.span_id: s for s in self.spans}

    def named(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.name == name]

    def ancestors(self, span: Span) -> list[Span]:
        out: list[Span] = []
        seen = {span.span_id}
        while span.parent_id is not None and span.parent_id in self.by_id and span.parent_id not in seen:
            span = self.by_id[span.parent_id]
            seen.add(span.span_id)
            out.append(span)
        return out

    def agent_of(self, span: Span) -> str | None:
        """The name of the nearest ``invoke_agent`` span above ``span`` (None if there is none)."""
        for parent in self.ancestors(span):
            if parent.name == sc.SPAN_INVOKE_AGENT:
                name = parent.attributes.get(sc.GEN_AI_AGENT_NAME)
                return str(name) if name is not None else None
        return None


@dataclass
class AgentSpans:
    """What :func:`assert_agent_spans` found, for further assertions."""

    tree: SpanTree
    agents: list[str]  # agent names in the order they first ran
    llm_calls: dict[str, list[Span]]  # agent -> its gateway (server-side) chat spans
    tools: dict[str, list[Span]]  # agent -> its execute_tool spans
    failed_tools: list[Span]  # execute_tool spans with status ERROR


def _llm_calls(tree: SpanTree) -> list[Span]:
    """One span per LLM call: the gateway's server-side chat span, else the client's."""
    chats = tree.named(sc.SPAN_CHAT)
    server = [s for s in chats if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER]
    return server or chats


def assert_agent_spans(
    store: Any,
    rollout_id: str,
    agents: Sequence[str],
    *,
    attempt: int | None = None,
    ordered: bool = True,
    every_call_attributed: bool = True,
) -> AgentSpans:
    """Assert that the rollout's agents, by ``gen_ai.agent.name``, are exactly ``agents``.

    ``ordered`` compares the order in which the agents first ran (else only the set). With
    ``every_call_attributed`` every LLM call of the rollout must run under one of those agents (that
    is what lets ``Adapter(agents=[...])`` select them). Flushes agl's span export first. Returns an
    :class:`AgentSpans` with the calls and tool spans per agent.
    """
    from agl.tracing import provider as tracing

    tracing.flush()
    spans = store.query_spans(rollout_id=rollout_id, attempt=attempt)
    assert spans, f"rollout {rollout_id!r} has no spans in the store"
    tree = SpanTree(spans)
    seen: list[str] = []
    for span in tree.named(sc.SPAN_INVOKE_AGENT):
        name = span.attributes.get(sc.GEN_AI_AGENT_NAME)
        if name is not None and str(name) not in seen:
            seen.append(str(name))
    expected = list(agents)
    if ordered:
        assert seen == expected, f"agents of rollout {rollout_id!r}: {seen}, expected {expected}"
    else:
        assert sorted(seen) == sorted(expected), (
            f"agents of rollout {rollout_id!r}: {seen}, expected {expected}"
        )
    llm: dict[str, list[Span]] = {name: [] for name in seen}
    unattributed: list[Span] = []
    for call in _llm_calls(tree):
        agent = tree.agent_of(call)
        if agent is None:
            unattributed.append(call)
        else:
            llm.setdefault(agent, []).append(call)
    if every_call_attributed:
        assert not unattributed, (
            f"{len(unattributed)} LLM call(s) of rollout {rollout_id!r} ran under no agent span "
            "(is the agent framework instrumented?)"
        )
    tools: dict[str, list[Span]] = {}
    for tool in tree.named(sc.SPAN_EXECUTE_TOOL):
        tools.setdefault(tree.agent_of(tool) or "", []).append(tool)
    failed = [t for t in tree.named(sc.SPAN_EXECUTE_TOOL) if t.status.code == "ERROR"]
    return AgentSpans(tree, seen, llm, tools, failed)
