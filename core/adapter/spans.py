"""One attempt's spans as a repaired tree: span kinds, which attempt to read, deduplication, parent
repair, agent attribution and the "call before time t" locator the rewards attach by.

Traces from real agents are messy: spans arrive from several processes and exporters, twice, late or
without their parent, and agents nest. Everything here repairs what it can, never raises on a
malformed trace, and counts what it repaired in :class:`~agl.adapter.stats.AdapterStats`.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Union

from agl import semconv as sc
from agl.adapter.stats import AdapterStats
from agl.errors import UsageError
from agl.names import display_name
from agl.types import Rollout, Span

AgentSelection = Union[None, str, "re.Pattern[str]", Iterable[str]]

_LLM_OPS = frozenset({sc.OP_CHAT, sc.OP_TEXT_COMPLETION, sc.OP_GENERATE_CONTENT})
_OP, _PROMPT_IDS, _SIDE, _SERVER = (
    sc.GEN_AI_OPERATION_NAME,
    sc.AGL_LLM_PROMPT_TOKEN_IDS,
    sc.AGL_SIDE,
    sc.SIDE_SERVER,
)
_OP_AGENT, _OP_TOOL, _OP_REWARD, _OP_EXC = (
    sc.OP_INVOKE_AGENT,
    sc.OP_EXECUTE_TOOL,
    sc.SPAN_REWARD,
    sc.SPAN_EXCEPTION,
)
_OTHER, _AGENT, _LLM, _TOOL, _REWARD, _EXC = range(6)
_INF = float("inf")


@dataclass(slots=True)
class _Tree:
    """One attempt's spans as a repaired tree over parallel arrays: ``S[i]`` is span ``i``, ``kind[i]``
    its class, ``parent[i]`` its parent's index (-1 for a root), ``server[i]`` whether an LLM span was
    recorded by the gateway. ``llm``/``rewards``/``notable`` index the spans later steps look at."""

    S: list[Span]
    kind: list[int]
    server: bytearray
    parent: list[int]
    llm: list[int]
    rewards: list[int]
    #: tools, exception spans and ERROR spans: what AIR looks at
    notable: list[int]
    #: nearest agent name per span index, filled lazily by :meth:`agent_of`
    agent_at: dict[int, str | None] = field(default_factory=dict)
    #: server LLM spans whose parent is not among the spans (another provider or exporter holds it)
    orphaned: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, S: list[Span], st: AdapterStats) -> _Tree:
        """Classify every span (one pass), then link parents: orphans go to their trace's root, parent
        cycles are broken, and server chat spans with no parent here are relinked to their client span."""
        n = len(S)
        kind = [_OTHER] * n
        server = bytearray(n)
        llm: list[int] = []
        rewards: list[int] = []
        notable: list[int] = []
        index: dict[tuple[str, str], int] = {}
        roots: dict[str, int] = {}
        for i, s in enumerate(S):
            a = s.attributes
            index[(s.trace_id, s.span_id)] = i
            op = a.get(_OP)
            if op is None or type(op) is not str:
                name = s.name
                sp = name.find(" ")
                op = name if sp < 0 else name[:sp]
            if op in _LLM_OPS or _PROMPT_IDS in a:
                kind[i] = _LLM
                llm.append(i)
                side = a.get(_SIDE)
                if side == _SERVER or (side is None and _PROMPT_IDS in a):
                    server[i] = 1
                if s.status.code == "ERROR":
                    notable.append(i)
            elif op == _OP_AGENT:
                kind[i] = _AGENT
                if s.status.code == "ERROR":
                    notable.append(i)
            elif op == _OP_TOOL:
                kind[i] = _TOOL
                notable.append(i)
            elif op == _OP_REWARD:
                kind[i] = _REWARD
                rewards.append(i)
            elif op == _OP_EXC:
                kind[i] = _EXC
                notable.append(i)
            elif s.status.code == "ERROR":
                notable.append(i)
            if s.parent_id is None:
                r = roots.get(s.trace_id)
                if r is None or (s.start_ns, _seq(s)) < (S[r].start_ns, _seq(S[r])):
                    roots[s.trace_id] = i
        parent = [-1] * n
        orphaned: list[int] = []
        for i, s in enumerate(S):
            pid = s.parent_id
            if pid is None:
                continue
            p = index.get((s.trace_id, pid), -1)
            if p < 0:
                st.orphans += 1
                if server[i]:
                    orphaned.append(i)
                p = roots.get(s.trace_id, -1)
            if p != i:
                parent[i] = p
        st.cycles += _break_cycles(parent)
        tree = cls(S, kind, server, parent, llm, rewards, notable, orphaned=orphaned)
        tree.relink(st)
        return tree

    def agent_of(self, i: int) -> str | None:
        """The name of span ``i``'s nearest ``invoke_agent`` ancestor (itself included), or None."""
        return _agent_of(i, self.S, self.kind, self.parent, self.agent_at)

    def discarded(self, i: int, start_ns: int) -> bool:
        """Whether the call at span ``i``, started at ``start_ns``, started in one of its nearest
        ``invoke_agent`` ancestor's discard windows (``agl.discarded.windows``): the app threw its
        output away."""
        j = i
        while j >= 0 and self.kind[j] != _AGENT:
            j = self.parent[j]
        if j < 0:
            return False
        w = self.S[j].attributes.get(sc.AGL_DISCARDED_WINDOWS)
        if not isinstance(w, (list, tuple)) or len(w) % 2:
            return False
        return any(
            isinstance(a, int) and isinstance(b, int) and a <= start_ns <= b
            for a, b in zip(w[::2], w[1::2], strict=True)
        )

    def relink(self, st: AdapterStats) -> None:
        """Join a server chat span with no parent here to the client chat span with the same response id,
        so it is attributed and not counted twice: a framework dropped ``traceparent``, or a span between
        the two went to another tracer provider (the anthropic SDK's own call span, an httpx
        instrumentation) and only its id reached the gateway."""
        S, server, parent, llm = self.S, self.server, self.parent, self.llm
        orphaned = set(self.orphaned)
        loose = [i for i in llm if server[i] and (parent[i] < 0 or i in orphaned)]
        if not loose:
            return
        clients: dict[str, int] = {}
        for i in llm:
            if not server[i]:
                rid = S[i].attributes.get(sc.GEN_AI_RESPONSE_ID)
                if isinstance(rid, str) and rid:
                    clients.setdefault(rid, i)
        if not clients:
            return
        for i in loose:
            rid = S[i].attributes.get(sc.GEN_AI_RESPONSE_ID)
            c = clients.get(rid) if isinstance(rid, str) else None
            if c is None:
                continue
            j = c  # never make a span its own ancestor
            while j >= 0 and j != i:
                j = parent[j]
            if j == i:
                continue
            parent[i] = c
            st.relinked += 1


@dataclass(slots=True)
class _Call:
    """One LLM call: the span the transition comes from and its client-side anchor (same process as the
    agent, so its clock orders it against tools, rewards and exceptions)."""

    idx: int
    anchor: int
    start: int
    end: int
    seq: int
    server: bool
    output: dict[str, Any] | None = None
    tool_call_ids: tuple[str, ...] = ()
    agent: str | None = None


@dataclass(slots=True, frozen=True)
class _Target:
    """The attempt one adapter call turns into transitions, and what its transitions are labelled with."""

    rollout_id: str
    attempt: int
    group_id: str | None


def _target(
    spans: list[Span], rollout: Rollout | None, attempt: int | None, st: AdapterStats
) -> _Target | None:
    """Which attempt to read: ``attempt`` if given, else the rollout's finishing attempt, else the
    highest attempt among the spans. None when the rollout has attempts but none finished."""
    if rollout is not None:
        rid = rollout.id
        if attempt is None:
            attempt = finishing_attempt(rollout)
            if attempt is None and rollout.attempts:
                st.no_finished_attempt += 1
                return None
    else:
        rids = {s.rollout_id for s in spans}
        if len(rids) > 1:
            raise UsageError(
                f"spans of {len(rids)} rollouts given ({', '.join(sorted(rids)[:3])}, ...); "
                "Adapter.transitions takes one attempt's spans — pass rollout= to pick one"
            )
        rid = next(iter(rids)) if rids else ""
    if attempt is None:
        attempt = max((s.attempt for s in spans if not s.stale and s.rollout_id == rid), default=1)
    group_id = None if rollout is None else (rollout.group_id or rollout.task_id)
    return _Target(rid, attempt, group_id)


def _live_spans(spans: list[Span], target: _Target, st: AdapterStats) -> list[Span]:
    """The target attempt's non-stale spans, one copy of each (:func:`_preferred` picks the copy)."""
    rid, attempt = target.rollout_id, target.attempt
    uniq: dict[tuple[str, str], Span] = {}
    for s in spans:
        if s.stale:
            st.stale += 1
            continue
        if s.attempt != attempt or s.rollout_id != rid:
            st.other_attempt += 1
            continue
        key = (s.trace_id, s.span_id)
        prev = uniq.get(key)
        if prev is None:
            uniq[key] = s
        else:
            st.duplicates += 1
            if _preferred(s, prev):
                uniq[key] = s
    return list(uniq.values())


class _Locator:
    """Finds "the LLM call that precedes time t": the latest call whose anchor ended at or before t,
    preferring calls of the same agent; if none ended yet, the latest that had started."""

    def __init__(self, calls: list[_Call], S: list[Span]) -> None:
        order = sorted(range(len(calls)), key=lambda k: (calls[k].end, calls[k].start, k))
        self._ends = [calls[k].end for k in order]
        self._order = order
        by_agent: dict[str | None, list[int]] = {}
        for k in order:
            by_agent.setdefault(calls[k].agent, []).append(k)
        self._agent = {a: ([calls[k].end for k in ks], ks) for a, ks in by_agent.items()}
        starts = sorted(range(len(calls)), key=lambda k: (calls[k].start, k))
        self._starts = ([calls[k].start for k in starts], starts)

    def before(self, t: int, agent: str | None = None) -> int:
        if agent is not None:
            entry = self._agent.get(agent)
            if entry is not None:
                pos = bisect_right(entry[0], t) - 1
                if pos >= 0:
                    return entry[1][pos]
        pos = bisect_right(self._ends, t) - 1
        if pos >= 0:
            return self._order[pos]
        pos = bisect_right(self._starts[0], t) - 1
        return self._starts[1][pos] if pos >= 0 else -1


def _seq(s: Span) -> int:
    return s.seq if s.seq is not None else -1


def _preferred(s: Span, prev: Span) -> bool:
    """Of two copies of one span keep the one the store saw first; else the one that ended later."""
    a = (s.seq if s.seq is not None else _INF, -s.end_ns)
    b = (prev.seq if prev.seq is not None else _INF, -prev.end_ns)
    return a < b


def _break_cycles(parent: list[int]) -> int:
    n = len(parent)
    state = bytearray(n)  # 0 unseen, 1 on the current path, 2 done
    broken = 0
    for i in range(n):
        if state[i]:
            continue
        path: list[int] = []
        j = i
        while j >= 0 and state[j] == 0:
            state[j] = 1
            path.append(j)
            j = parent[j]
        if j >= 0 and state[j] == 1:
            parent[path[-1]] = -1
            broken += 1
        for k in path:
            state[k] = 2
    return broken


def _agent_name(s: Span) -> str | None:
    """The agent an ``invoke_agent`` span stands for, as people see it (:mod:`agl.names`: spans stored
    before the normalisation, or by another OTel exporter, may still carry the raw name)."""
    name = s.attributes.get(sc.GEN_AI_AGENT_NAME)
    if isinstance(name, str) and name.strip():
        return display_name(name)
    prefix = sc.OP_INVOKE_AGENT + " "
    return display_name(s.name[len(prefix) :]) if s.name.startswith(prefix) else None


def _agent_of(
    i: int, S: list[Span], kind: list[int], parent: list[int], memo: dict[int, str | None]
) -> str | None:
    path: list[int] = []
    j = i
    base: str | None = None
    while j >= 0:
        if j in memo:
            base = memo[j]
            break
        path.append(j)
        if kind[j] == _AGENT:
            base = _agent_name(S[j])
            break
        j = parent[j]
    for k in path:
        memo[k] = base
    return base


def agent_matcher(agents: AgentSelection) -> Any:
    if agents is None:
        return lambda name: True
    if isinstance(agents, re.Pattern):
        pattern = agents
        return lambda name: name is not None and pattern.fullmatch(name) is not None
    if isinstance(agents, str):
        try:
            pattern = re.compile(agents)
        except re.error as exc:
            raise UsageError(f"agents={agents!r} is not a valid regular expression: {exc}") from None
        return lambda name: name is not None and pattern.fullmatch(name) is not None
    names = list(agents)
    for a in names:
        if not isinstance(a, str):
            raise UsageError(f"agents must be names (str), got {a!r}")
    wanted = frozenset(display_name(a) for a in names)  # as people see them, like the spans' names
    return lambda name: name is not None and display_name(name) in wanted


def finishing_attempt(rollout: Rollout) -> int | None:
    """The attempt whose spans are trained on: the last ``succeeded`` one, else the last ``failed`` one.

    Attempts that were ``lost`` or ``timed_out`` (their spans are stale) and a still ``running`` one
    never count. None when no attempt finished.
    """
    succeeded = [a.number for a in rollout.attempts if a.status == "succeeded"]
    if succeeded:
        return max(succeeded)
    failed = [a.number for a in rollout.attempts if a.status == "failed"]
    return max(failed) if failed else None


#: integrations that make no agent spans: LLM calls without an agent are expected under them alone
_NO_AGENT_SPANS = frozenset({"openai"})


def framework_used(spans: Iterable[Span]) -> bool:
    """Whether an agent framework's integration made any of these spans (``agl.integration`` names one
    other than the plain ``openai`` client's). Read from the spans, not this process's plugin registry:
    the agent may have run in another process (``agl runner``), and an installed framework that the
    agent did not use must not make its calls look unattributed."""
    for s in spans:
        name = s.attributes.get(sc.AGL_INTEGRATION)
        if isinstance(name, str) and name and name not in _NO_AGENT_SPANS:
            return True
    return False
