"""The adapter (DESIGN §8): the spans of one attempt → ordered training :class:`Transition` s.

Traces from real agents are messy: spans arrive from several processes and exporters, twice, late or
without their parent; a rollout may have been retried; agents nest; tools run in parallel. The adapter
repairs what it can, never crashes on a malformed trace, never yields the same LLM call twice, and
counts everything it had to skip or guess in :class:`AdapterStats`, so a training run can see how
trustworthy its data is. The exact rules (transition selection, agent attribution, reward attachment,
AIR) are documented in docs/architecture.md §8.

The hot path is plain Python over already-validated spans: one pass to deduplicate and classify, one
to build the tree, one over the LLM calls. Transitions are built with ``model_construct`` from values
the adapter has checked itself (see :func:`_int_list`).
"""

from __future__ import annotations

import json
import logging
import math
import re
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Union

from agl import semconv as sc
from agl.algorithms.lightning_rl import LightningRL, credit_returns
from agl.rewards import AIR, plugin_rewards
from agl.trajectories import merge_stats
from agl.types import Rollout, Span, Transition

if TYPE_CHECKING:
    from agl.store.base import Store

__all__ = ["Adapter", "AdapterStats", "AgentSelection", "finishing_attempt"]

log = logging.getLogger(__name__)

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


@dataclass
class AdapterStats:
    """What the adapter saw, skipped and repaired. Cumulative over an :class:`Adapter`'s calls."""

    attempts: int = 0  #: attempts turned into transitions
    spans: int = 0  #: spans given
    duplicates: int = 0  #: copies of a span already seen (same trace_id + span_id), dropped
    stale: int = 0  #: spans the store marked stale (lost/timed-out attempt), dropped
    other_attempt: int = 0  #: spans of another rollout or attempt than the one adapted, dropped
    orphans: int = 0  #: spans whose parent is missing, re-attached to their trace's root
    cycles: int = 0  #: parent cycles broken (malformed parent ids)
    relinked: int = 0  #: server chat spans with no parent joined to their client span by response id
    llm_calls: int = 0  #: LLM calls found (before agent selection)
    transitions: int = 0  #: transitions produced
    exact: int = 0  #: ... of which with engine token ids
    retokenised: int = 0  #: ... of which re-tokenised from messages
    unselected: int = 0  #: LLM calls of agents not selected
    no_tokenizer: int = 0  #: calls that needed re-tokenising but no tokenizer was given
    retokenise_failed: int = 0  #: calls the tokenizer could not render (e.g. template errors)
    failed_calls: int = 0  #: LLM calls that errored without a response
    bad_messages: int = 0  #: message attributes that were not valid JSON
    logprobs_dropped: int = 0  #: logprobs whose length did not match the response ids
    reward_spans: int = 0  #: agl.reward spans read
    invalid_rewards: int = 0  #: reward spans without a finite numeric value
    missing_final_reward: int = 0  #: attempts without a primary reward (fill value used)
    intermediate_rewards: int = 0  #: emitted (non-final) rewards attached to a transition
    unattached_rewards: int = 0  #: intermediate/AIR rewards with no LLM call before them
    unselected_rewards: int = 0  #: intermediate/AIR rewards that landed on an unselected agent's call
    plugin_errors: int = 0  #: AIR plugins that raised or returned a non-number
    no_finished_attempt: int = 0  #: rollouts with no succeeded/failed attempt (from_store)
    #: LLM calls of attempts where no call had an agent span although an agent framework was
    #: instrumented: its hooks were bypassed or removed (see :data:`AGENT_FRAMEWORKS`)
    unattributed_calls: int = 0
    #: multi-turn merging of the transitions (agl.trajectories, what the update trains on): the
    #: sequences they make (one per agent conversation whose calls extend exactly), the calls that
    #: extended a sequence, and the tokens the per-call and the merged forms encode
    sequences: int = 0
    merged_calls: int = 0
    tokens_per_call: int = 0
    tokens_merged: int = 0
    #: calls that started a new sequence although their agent had one open, by cause
    #: (agl.trajectories.BREAK_CAUSES: retokenised, edited, rerendered, truncated, diverged)
    prefix_breaks: dict[str, int] = field(default_factory=dict)
    air: dict[str, int] = field(default_factory=dict)  #: AIR events per rule
    #: LLM calls per agent name ("" for calls with no agent span), before selection
    agents: dict[str, int] = field(default_factory=dict)

    def merge(self, other: AdapterStats) -> None:
        mine = self.__dict__
        for name, value in other.__dict__.items():
            if isinstance(value, dict):
                counts = mine[name]
                for k, v in value.items():
                    counts[k] = counts.get(k, 0) + v
            elif value:
                mine[name] += value

    @property
    def merge_rate(self) -> float:
        """Share of the calls that could extend their agent's sequence (every call after an agent's
        first) that did; 0.0 when there were none."""
        could = self.merged_calls + sum(self.prefix_breaks.values())
        return self.merged_calls / could if could else 0.0

    @property
    def tokens_saved(self) -> int:
        """Tokens the merged form does not encode again (``tokens_per_call - tokens_merged``)."""
        return self.tokens_per_call - self.tokens_merged

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["prefix_breaks"] = dict(self.prefix_breaks)
        out["air"] = dict(self.air)
        out["agents"] = dict(self.agents)
        out["merge_rate"] = self.merge_rate
        out["tokens_saved"] = self.tokens_saved
        return out

    def copy(self) -> AdapterStats:
        out = AdapterStats()
        out.merge(self)
        return out

    def since(self, earlier: AdapterStats) -> AdapterStats:
        """The counts added after ``earlier`` (a :meth:`copy` of these stats taken before)."""
        out = AdapterStats()
        for f in fields(self):
            now, then = getattr(self, f.name), getattr(earlier, f.name)
            if isinstance(now, dict):
                setattr(out, f.name, {k: v - then.get(k, 0) for k, v in now.items() if v != then.get(k, 0)})
            else:
                setattr(out, f.name, now - then)
        return out


#: integrations whose frameworks make agent spans (``invoke_agent``); the plain ``openai`` client
#: integration makes none, so calls without an agent are expected under it alone
AGENT_FRAMEWORKS = frozenset({"openai_agents", "langchain", "crewai", "autogen"})


def _agent_framework_instrumented() -> bool:
    from agl.instrumentation.registry import instrumented

    return bool(AGENT_FRAMEWORKS.intersection(instrumented()))


def final_reward(spans: Iterable[Span]) -> float | None:
    """The final reward of one attempt: the value of its last-ending primary ``agl.reward`` span with
    a finite numeric value (None when it has none). The one definition the adapter and the trainer
    use; other reward spans are intermediate."""
    best: tuple[tuple[int, int, int, str], float] | None = None
    for s in spans:
        if s.name != _OP_REWARD and s.attributes.get(sc.GEN_AI_OPERATION_NAME) != _OP_REWARD:
            continue
        value = s.attributes.get(sc.AGL_REWARD_VALUE)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        if not _truthy(s.attributes.get(sc.AGL_REWARD_PRIMARY, True)):
            continue
        key = _reward_key(s)
        if best is None or key > best[0]:
            best = (key, float(value))
    return None if best is None else best[1]


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


# ------------------------------------------------------------------------------------ messages


try:  # orjson parses message JSON ~2-3x faster; optional (it comes with several frameworks)
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - depends on the environment
    _fast_loads = json.loads


def _loads(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return _fast_loads(value)
        except ValueError:
            return json.loads(value)  # what orjson refuses and json accepts (NaN, huge ints)
    return value


def _norm_message(m: Any) -> dict[str, Any] | None:
    """An OpenAI-style chat message from OpenAI format, an OpenAI choice, or OTel GenAI ``parts``."""
    if not isinstance(m, dict):
        return None
    if "role" not in m:
        if isinstance(m.get("message"), dict):  # an OpenAI choice
            m = m["message"]
        elif m.get("type") == "function_call":  # Responses API items
            call = {
                "id": m.get("call_id"),
                "type": "function",
                "function": {"name": m.get("name"), "arguments": m.get("arguments", "")},
            }
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        elif m.get("type") == "function_call_output":
            out = m.get("output")
            return {
                "role": "tool",
                "tool_call_id": m.get("call_id"),
                "content": out if isinstance(out, str) else json.dumps(out),
            }
    content = m.get("content")
    if isinstance(content, list):  # text parts (Chat Completions or Responses) as one string
        m = {**m, "content": _content_text(content)}
    parts = m.get("parts")
    if "content" in m or not isinstance(parts, list):
        return m
    out: dict[str, Any] = {"role": m.get("role", "assistant")}
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for p in parts:
        if not isinstance(p, dict):
            continue
        kind = p.get("type")
        if kind == "text":
            texts.append(str(p.get("content", "")))
        elif kind == "tool_call":
            args = p.get("arguments")
            calls.append(
                {
                    "id": p.get("id"),
                    "type": "function",
                    "function": {
                        "name": p.get("name"),
                        "arguments": args if isinstance(args, str) else json.dumps(args),
                    },
                }
            )
        elif kind == "tool_call_response":
            out["role"] = "tool"
            out["tool_call_id"] = p.get("id")
            resp = p.get("response")
            texts.append(resp if isinstance(resp, str) else json.dumps(resp))
    out["content"] = "".join(texts) if texts or not calls else None
    if calls:
        out["tool_calls"] = calls
    return out


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", p.get("content", p.get("refusal", "")))) if isinstance(p, dict) else str(p)
            for p in content
        )
    return str(content)


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
            raise ValueError(
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

    @classmethod
    def build(cls, S: list[Span], st: AdapterStats) -> _Tree:
        """Classify every span (one pass), then link parents: orphans go to their trace's root, parent
        cycles are broken, and parentless server chat spans are relinked to their client span."""
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
        for i, s in enumerate(S):
            pid = s.parent_id
            if pid is None:
                continue
            p = index.get((s.trace_id, pid), -1)
            if p < 0:
                st.orphans += 1
                p = roots.get(s.trace_id, -1)
            if p != i:
                parent[i] = p
        st.cycles += _break_cycles(parent)
        tree = cls(S, kind, server, parent, llm, rewards, notable)
        tree.relink(st)
        return tree

    def agent_of(self, i: int) -> str | None:
        """The name of span ``i``'s nearest ``invoke_agent`` ancestor (itself included), or None."""
        return _agent_of(i, self.S, self.kind, self.parent, self.agent_at)

    def relink(self, st: AdapterStats) -> None:
        """Join a parentless server chat span (a framework dropped ``traceparent``) to the client chat
        span with the same response id, so it is attributed and not counted twice."""
        S, server, parent, llm = self.S, self.server, self.parent, self.llm
        loose = [i for i in llm if server[i] and parent[i] < 0]
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


# ------------------------------------------------------------------------------------ the adapter


class Adapter:
    """Turns the spans of one attempt into the transitions LightningRL trains on.

    ``agents`` selects whose LLM calls become transitions: None (all), a list of names, or a regular
    expression (a ``str`` or compiled pattern, matched against the whole name). ``tokenizer`` (an HF
    tokenizer, or anything with ``apply_chat_template``/``encode``, or agl's gateway ``ChatTokenizer``)
    re-tokenises calls that have no engine token ids; without one they are skipped and counted. ``air``
    sets the automatic intermediate rewards (``None`` or ``AIR.off()`` for none). ``missing_reward`` is
    the final reward of an attempt that never reported one.

    ``Transition.reward`` is the credited return under ``algorithm``'s credit rule — by default
    LightningRL's ``identical`` rule, ``R + r_j`` (``include_intermediate=True``) — so exports and the
    inspection CLI show what the trainer would use. The trainer recomputes returns from
    ``final_reward``/``intermediate_reward`` with its own configuration.
    """

    def __init__(
        self,
        agents: AgentSelection = None,
        tokenizer: Any = None,
        air: AIR | None = AIR(),
        missing_reward: float = 0.0,
        *,
        algorithm: LightningRL | None = None,
        include_intermediate: bool = True,
    ) -> None:
        self._match = _agent_matcher(agents)
        self.agents = agents
        self.tokenizer = _as_chat_tokenizer(_resolve_tokenizer(tokenizer))
        if air is not None and not isinstance(air, AIR):
            raise ValueError(
                f"air must be an agl.rewards.AIR (or None for no automatic rewards), got {air!r}"
            )
        self.air = AIR.off() if air is None else air
        if isinstance(missing_reward, bool) or not isinstance(missing_reward, (int, float)):
            raise ValueError(f"missing_reward must be a number, got {missing_reward!r}")
        if not math.isfinite(missing_reward):
            raise ValueError(f"missing_reward must be finite, got {missing_reward!r}")
        self.missing_reward = float(missing_reward)
        self.algorithm = algorithm or LightningRL()
        self.include_intermediate = include_intermediate
        self.stats = AdapterStats()
        self.last_stats = AdapterStats()

    def reset_stats(self) -> None:
        self.stats = AdapterStats()

    def rollout_reward(self, store: Store, rollout: Rollout) -> float:
        """The final reward of ``rollout``'s finishing attempt (:func:`final_reward`), or
        ``missing_reward`` — what its transitions carry as ``final_reward``, also for a rollout that
        made no LLM call."""
        att = finishing_attempt(rollout)
        if att is None:
            return self.missing_reward
        spans = store.query_spans(
            rollout_id=rollout.id, attempt=att, name=sc.SPAN_REWARD, include_stale=False
        )
        value = final_reward(spans)
        return self.missing_reward if value is None else value

    # ------------------------------------------------------------------ public API

    def from_store(
        self, store: Store, rollout_ids: Iterable[str], *, progress: bool = False
    ) -> list[Transition]:
        """Transitions of each rollout's finishing attempt (non-stale spans only), in the given order."""
        from agl.store.base import NotFoundError

        ids = list(dict.fromkeys(rollout_ids))
        if not ids:
            return []
        found = {r.id: r for r in store.query_rollouts(ids=ids)}
        missing = [i for i in ids if i not in found]
        if missing:
            raise NotFoundError(f"rollout(s) not found: {', '.join(missing)}")
        out: list[Transition] = []
        it: Iterable[str] = ids
        if progress:
            from tqdm import tqdm

            it = tqdm(ids, desc="adapter", unit="rollout", leave=False)
        for rid in it:
            rollout = found[rid]
            att = finishing_attempt(rollout)
            if att is None:
                self.stats.no_finished_attempt += 1
                continue
            spans = store.query_spans(rollout_id=rid, attempt=att, include_stale=False)
            out.extend(self.transitions(spans, rollout=rollout, attempt=att))
        return out

    def transitions(
        self, spans: Iterable[Span], *, rollout: Rollout | None = None, attempt: int | None = None
    ) -> list[Transition]:
        """The transitions of one attempt, in call order, with rewards attached and credit assigned.

        Spans of other rollouts/attempts and stale spans are ignored. The attempt is ``attempt`` if
        given, else the rollout's finishing attempt (see :func:`finishing_attempt`), else the highest
        attempt number among the spans. Without ``rollout`` all spans must belong to one rollout.
        """
        st = AdapterStats()
        try:
            return self._transitions(list(spans), rollout, attempt, st)
        finally:
            self.last_stats = st
            self.stats.merge(st)

    # ------------------------------------------------------------------ internals

    def _transitions(
        self, spans: list[Span], rollout: Rollout | None, attempt: int | None, st: AdapterStats
    ) -> list[Transition]:
        """The pipeline, one named step per phase: which attempt -> its live spans -> the span tree ->
        the LLM calls -> rewards (final, emitted, AIR) -> selected transitions with credit."""
        st.spans = len(spans)
        target = _target(spans, rollout, attempt, st)
        if target is None:
            return []
        live = _live_spans(spans, target, st)
        if not live:
            return []
        st.attempts = 1
        tree = _Tree.build(live, st)
        calls = self._calls(tree, st)
        locate = _Locator(calls, tree.S)
        inter, big_r = self._rewards(tree, calls, locate, st)
        if self.air.enabled and calls:
            air = [0.0] * len(calls)
            self._air(tree, calls, locate, air, st)
            # the guards (caps, outcome gate: agl.rewards.AIR.shape) see the whole rollout's AIR
            for k, value in enumerate(self.air.shape(air, big_r)):
                inter[k] += value
        return self._emit(tree, calls, inter, big_r, target, st)

    # .................................................................. pipeline steps

    def _calls(self, tree: _Tree, st: AdapterStats) -> list[_Call]:
        """The LLM spans that are calls, in call order, each with its anchor, agent and parsed output.

        A client span with an LLM span below it is the same call as that (server) span and is dropped;
        a server span is anchored at its client span (the agent's clock) when there is one. A call that
        errored without any response is counted in ``failed_calls`` and skipped."""
        S, kind, parent, server = tree.S, tree.kind, tree.parent, tree.server
        has_llm_below = bytearray(len(S))
        for i in tree.llm:
            j = parent[i]
            while j >= 0 and not has_llm_below[j]:
                has_llm_below[j] = 1
                j = parent[j]
        calls: list[_Call] = []
        for i in tree.llm:
            if not server[i] and has_llm_below[i]:
                continue
            s = S[i]
            anchor = i
            if server[i]:
                j = parent[i]
                while j >= 0 and kind[j] != _AGENT:
                    if kind[j] == _LLM and not server[j]:
                        anchor = j
                        break
                    j = parent[j]
            if s.status.code == "ERROR" and not self._has_response(S, i, anchor):
                st.failed_calls += 1
                continue
            a = S[anchor]
            calls.append(_Call(i, anchor, a.start_ns, a.end_ns, _seq(s), bool(server[i])))
        st.llm_calls = len(calls)
        calls.sort(key=lambda c: (c.start, S[c.idx].start_ns, c.seq, S[c.idx].span_id))
        for c in calls:  # agents: the nearest invoke_agent ancestor, memoised over the tree
            c.agent = tree.agent_of(c.idx)
            st.agents[c.agent or ""] = st.agents.get(c.agent or "", 0) + 1
            self._parse_output(S, c, st)
        if (
            calls
            and all(c.agent is None for c in calls)
            and any(c.server for c in calls)
            and _agent_framework_instrumented()
        ):
            st.unattributed_calls += len(calls)
        return calls

    def _rewards(
        self, tree: _Tree, calls: list[_Call], locate: _Locator, st: AdapterStats
    ) -> tuple[list[float], float]:
        """(intermediate reward per call, final reward). The final reward is the primary reward span
        that ended last (:func:`_reward_key`); every other reward is intermediate, attached to the call
        before it (same agent preferred). No primary reward: ``missing_reward``."""
        S = tree.S
        inter = [0.0] * len(calls)
        primary: list[tuple[tuple[int, int, int, str], float, int]] = []
        emitted: list[tuple[float, int]] = []
        for i in tree.rewards:
            s = S[i]
            st.reward_spans += 1
            value = s.attributes.get(sc.AGL_REWARD_VALUE)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                st.invalid_rewards += 1
                continue
            if _truthy(s.attributes.get(sc.AGL_REWARD_PRIMARY, True)):
                primary.append((_reward_key(s), float(value), i))
            else:
                emitted.append((float(value), i))
        final = max(primary, key=lambda p: p[0]) if primary else None
        emitted.extend((value, i) for key, value, i in primary if final is not None and key != final[0])
        for value, i in emitted:
            k = locate.before(S[i].start_ns, tree.agent_of(i))
            if k < 0:
                st.unattached_rewards += 1
                continue
            inter[k] += value
            st.intermediate_rewards += 1
        if final is None:
            st.missing_final_reward += 1
            return inter, self.missing_reward
        return inter, final[1]

    def _emit(
        self,
        tree: _Tree,
        calls: list[_Call],
        inter: list[float],
        big_r: float,
        target: _Target,
        st: AdapterStats,
    ) -> list[Transition]:
        """The selected agents' calls as transitions (token ids, rewards, credited return), in order."""
        selected = [k for k, c in enumerate(calls) if self._match(c.agent)]
        st.unselected = len(calls) - len(selected)
        sel_set = set(selected)
        for k, value in enumerate(inter):
            if value != 0.0 and k not in sel_set:
                st.unselected_rewards += 1
        built: list[tuple[int, dict[str, Any]]] = []
        for k in selected:
            data = self._build(tree.S, calls[k], st)
            if data is not None:
                built.append((k, data))
        returns = credit_returns(
            big_r,
            [inter[k] for k, _ in built],
            self.algorithm,
            include_intermediate=self.include_intermediate,
        )
        out: list[Transition] = []
        for j, ((k, data), g) in enumerate(zip(built, returns, strict=True)):
            data.update(
                rollout_id=target.rollout_id,
                attempt=target.attempt,
                group_id=target.group_id,
                agent=calls[k].agent,
                index=j,
                reward=g,
                intermediate_reward=inter[k],
                final_reward=big_r,
            )
            out.append(Transition.model_construct(**data))
        st.transitions = len(out)
        if out:
            ms = merge_stats(out)
            st.sequences, st.merged_calls = ms.sequences, ms.merged_calls
            st.tokens_per_call, st.tokens_merged = ms.tokens_per_call, ms.tokens_merged
            st.prefix_breaks = dict(ms.breaks)
        return out

    # .................................................................. calls

    @staticmethod
    def _has_response(S: list[Span], i: int, anchor: int) -> bool:
        a = S[i].attributes
        if a.get(sc.AGL_LLM_RESPONSE_TOKEN_IDS):
            return True
        return bool(a.get(sc.GEN_AI_OUTPUT_MESSAGES) or S[anchor].attributes.get(sc.GEN_AI_OUTPUT_MESSAGES))

    @staticmethod
    def _parse_output(S: list[Span], c: _Call, st: AdapterStats) -> None:
        raw = S[c.idx].attributes.get(sc.GEN_AI_OUTPUT_MESSAGES)
        if raw is None:
            raw = S[c.anchor].attributes.get(sc.GEN_AI_OUTPUT_MESSAGES)
        if raw is None:
            return
        try:
            data = _loads(raw)
        except ValueError:
            st.bad_messages += 1
            return
        if isinstance(data, dict):
            data = [data]
        if not isinstance(data, list) or not data:
            return
        choice = S[c.idx].attributes.get(sc.AGL_LLM_CHOICE_INDEX, 0)
        pick = data[choice] if isinstance(choice, int) and 0 <= choice < len(data) else data[0]
        msg = _norm_message(pick)
        if msg is None:
            return
        c.output = msg
        tcs = msg.get("tool_calls")
        if isinstance(tcs, list) and tcs:
            c.tool_call_ids = tuple(
                tc["id"] for tc in tcs if isinstance(tc, dict) and isinstance(tc.get("id"), str)
            )

    def _input(self, S: list[Span], c: _Call, st: AdapterStats) -> list[dict[str, Any]]:
        raw = S[c.idx].attributes.get(sc.GEN_AI_INPUT_MESSAGES)
        if raw is None:
            raw = S[c.anchor].attributes.get(sc.GEN_AI_INPUT_MESSAGES)
        if raw is None:
            return []
        try:
            data = _loads(raw)
        except ValueError:
            st.bad_messages += 1
            return []
        if not isinstance(data, list):
            return []
        return [m for m in map(_norm_message, data) if m is not None]

    def _build(self, S: list[Span], c: _Call, st: AdapterStats) -> dict[str, Any] | None:
        s = S[c.idx]
        a = s.attributes
        messages = self._input(S, c, st)
        out = c.output
        text = _response_text(out)
        logprobs: Any = None
        prompt = a.get(sc.AGL_LLM_PROMPT_TOKEN_IDS) if c.server else None
        response = a.get(sc.AGL_LLM_RESPONSE_TOKEN_IDS) if c.server else None
        exact = (
            c.server
            and a.get(sc.AGL_LLM_EXACT, True) is not False
            and _int_list(prompt)
            and _int_list(response)
        )
        if exact:
            prompt_ids = tuple(prompt)  # type: ignore[arg-type]
            response_ids = tuple(response)  # type: ignore[arg-type]
            lp = a.get(sc.AGL_LLM_RESPONSE_LOGPROBS)
            if lp is not None:
                if _float_list(lp) and len(lp) == len(response_ids):
                    logprobs = tuple(lp)
                else:
                    st.logprobs_dropped += 1
            st.exact += 1
        else:
            if self.tokenizer is None:
                st.no_tokenizer += 1
                return None
            try:
                ids = _retokenise(self.tokenizer, messages, out, text, a, S[c.anchor].attributes)
            except Exception as exc:  # template errors vary by tokenizer; count and go on
                log.debug("re-tokenising span %s failed: %r", s.span_id, exc)
                ids = None
            if ids is None:
                st.retokenise_failed += 1
                return None
            prompt_ids, response_ids = ids
            st.retokenised += 1
        model = a.get(sc.GEN_AI_RESPONSE_MODEL) or a.get(sc.GEN_AI_REQUEST_MODEL)
        if model is None:
            model = S[c.anchor].attributes.get(sc.GEN_AI_REQUEST_MODEL)
        wv = a.get(sc.AGL_LLM_WEIGHT_VERSION)
        finish = a.get(sc.GEN_AI_RESPONSE_FINISH_REASONS) or S[c.anchor].attributes.get(
            sc.GEN_AI_RESPONSE_FINISH_REASONS
        )
        return {
            "prompt_ids": prompt_ids,
            "response_ids": response_ids,
            "response_logprobs": logprobs,
            "messages": tuple(messages),
            "response_text": text,
            "exact": bool(exact),
            "span_id": s.span_id,
            "model": model if isinstance(model, str) else None,
            "weight_version": wv if isinstance(wv, int) and not isinstance(wv, bool) else None,
            "truncated": _cut_at_max_tokens(finish),
        }

    # .................................................................. AIR

    def _air(
        self, tree: _Tree, calls: list[_Call], locate: _Locator, inter: list[float], st: AdapterStats
    ) -> None:
        """Automatic intermediate rewards (:class:`agl.rewards.AIR`) added into ``inter``, per call."""
        air = self.air
        S, kind, parent, notable, agent_of = tree.S, tree.kind, tree.parent, tree.notable, tree.agent_of
        by_tool_id: dict[str, int] = {}
        for k, c in enumerate(calls):
            for tid in c.tool_call_ids:
                by_tool_id.setdefault(tid, k)

        def add(k: int, value: float, rule: str) -> None:
            if k < 0:
                st.unattached_rewards += 1
                return
            inter[k] += value
            st.air[rule] = st.air.get(rule, 0) + 1

        def issuer(i: int) -> int:
            tid = S[i].attributes.get(sc.GEN_AI_TOOL_CALL_ID)
            if isinstance(tid, str) and tid in by_tool_id:
                return by_tool_id[tid]
            return locate.before(S[i].start_ns, agent_of(i))

        # error-bearing spans and the exception signatures found below each span
        sig_below: dict[int, set[Any]] = {}
        w_err, w_ok, w_exc = air.weight("tool_error"), air.weight("tool_success"), air.weight("exception")
        failed_ids: set[str] = set()
        exc_candidates: list[int] = []
        for i in notable:
            s = S[i]
            k_i = kind[i]
            is_err = s.status.code == "ERROR"
            if k_i == _TOOL:
                if is_err:
                    tid = s.attributes.get(sc.GEN_AI_TOOL_CALL_ID)
                    if isinstance(tid, str):
                        failed_ids.add(tid)
                    if w_err:
                        add(issuer(i), w_err, "tool_error")
                elif w_ok:
                    add(issuer(i), w_ok, "tool_success")
            elif k_i == _EXC or (is_err and _exception_event(s) is not None):
                exc_candidates.append(i)
            else:
                continue
            if k_i == _EXC or is_err:
                sig = _signature(s)
                j = parent[i]
                while j >= 0:
                    below = sig_below.setdefault(j, set())
                    if sig in below:
                        break
                    below.add(sig)
                    j = parent[j]
        if w_exc:
            for i in exc_candidates:
                below = sig_below.get(i)
                if below:
                    sig = _signature(S[i])
                    if sig in below or sig == (None, None) or (None, None) in below:
                        continue  # raised below and propagated up: already counted there
                ev = _exception_event(S[i])
                t = ev.time_ns if ev is not None else S[i].start_ns
                add(locate.before(t, agent_of(i)), w_exc, "exception")

        w_bad = air.weight("malformed_tool_call")
        if w_bad:
            for k, c in enumerate(calls):
                tcs = c.output.get("tool_calls") if c.output else None
                if not isinstance(tcs, list):
                    continue
                for tc in tcs:
                    if not isinstance(tc, dict) or tc.get("id") in failed_ids:
                        continue
                    fn = tc.get("function")
                    args = fn.get("arguments") if isinstance(fn, dict) else None
                    if isinstance(args, str):
                        try:
                            json.loads(args)
                        except ValueError:
                            add(k, w_bad, "malformed_tool_call")

        if air.use_plugins:
            errors: list[str] = []
            found = plugin_rewards(S, errors=errors)
            st.plugin_errors += len(errors)
            if found:
                call_of = {c.idx: k for k, c in enumerate(calls)}
                for c_k, c in enumerate(calls):
                    call_of.setdefault(c.anchor, c_k)
                for i, value in found:
                    k = call_of.get(i)
                    if k is None:
                        if kind[i] == _TOOL:
                            k = issuer(i)
                        else:
                            k = locate.before(S[i].end_ns, agent_of(i))
                    add(k, value, "plugin")


# ------------------------------------------------------------------------------------ helpers


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


def _reward_key(s: Span) -> tuple[int, int, int, str]:
    """Order of reward spans: the last to end is the final reward (ties: emission order)."""
    return (s.end_ns, _seq(s), s.start_ns, s.span_id)


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
    name = s.attributes.get(sc.GEN_AI_AGENT_NAME)
    if isinstance(name, str) and name:
        return name
    prefix = sc.OP_INVOKE_AGENT + " "
    return (s.name[len(prefix) :] or None) if s.name.startswith(prefix) else None


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


def _agent_matcher(agents: AgentSelection) -> Any:
    if agents is None:
        return lambda name: True
    if isinstance(agents, re.Pattern):
        pattern = agents
        return lambda name: name is not None and pattern.fullmatch(name) is not None
    if isinstance(agents, str):
        try:
            pattern = re.compile(agents)
        except re.error as exc:
            raise ValueError(f"agents={agents!r} is not a valid regular expression: {exc}") from None
        return lambda name: name is not None and pattern.fullmatch(name) is not None
    names = list(agents)
    for a in names:
        if not isinstance(a, str):
            raise ValueError(f"agents must be names (str), got {a!r}")
    wanted = frozenset(names)
    return lambda name: name in wanted


def _cut_at_max_tokens(finish: Any) -> bool:
    """Whether a call's finish reasons (OTel's list, or one string) say it hit ``max_tokens``: ``length``
    in the chat API, ``max_tokens`` in the Anthropic-style spelling some frameworks record."""
    reasons = [finish] if isinstance(finish, str) else finish if isinstance(finish, (list, tuple)) else []
    return any(str(r).lower() in ("length", "max_tokens") for r in reasons)


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() not in ("false", "0", "no", "")
    return bool(v)


def _int_list(v: Any) -> bool:
    """Token ids as the gateway records them: a list of ints.

    Spans are validated when they enter the store (every attribute list holds only str/bool/int/float
    items), so checking the element type at both ends catches a list of the wrong type (strings,
    floats) without a per-token Python loop on the hot path (DESIGN §10: >= 100k spans/s).
    """
    if type(v) is not list and type(v) is not tuple:
        return False
    return not v or (type(v[0]) is int and type(v[-1]) is int)


def _float_list(v: Any) -> bool:
    if type(v) is not list and type(v) is not tuple:
        return False
    return not v or (type(v[0]) in (float, int) and type(v[-1]) in (float, int))


def _exception_event(s: Span) -> Any:
    for ev in s.events:
        if ev.name == sc.EVENT_EXCEPTION:
            return ev
    return None


def _signature(s: Span) -> tuple[Any, Any]:
    """What identifies an exception as it propagates up the tree: its type and message."""
    ev = _exception_event(s)
    src: Mapping[str, Any] = ev.attributes if ev is not None else s.attributes
    etype = src.get(sc.AGL_EXCEPTION_TYPE)
    msg = src.get(sc.AGL_EXCEPTION_MESSAGE)
    if etype is None and msg is None and s.status.message:
        msg = s.status.message
    return (etype, msg)


def _response_text(out: dict[str, Any] | None) -> str | None:
    if out is None:
        return None
    text = _content_text(out.get("content"))
    if not text and out.get("tool_calls"):
        return json.dumps(out["tool_calls"], separators=(",", ":"))
    return text


def _ids(result: Any) -> list[int]:
    if isinstance(result, Mapping) or hasattr(result, "input_ids"):
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    result = list(result)
    if result and isinstance(result[0], (list, tuple)):
        result = list(result[0])
    return [int(x) for x in result]


def _resolve_tokenizer(tok: Any) -> Any:
    """What the CLI's ``--tokenizer`` accepts: None, ``"default"`` (the shipped SmolLM2 tokenizer), a
    local tokenizer directory, or a tokenizer object; anything else is refused by name."""
    import os

    if tok is None:
        return None
    if isinstance(tok, (str, os.PathLike)):
        from agl.export import load_tokenizer

        return load_tokenizer(os.fspath(tok))
    if callable(getattr(tok, "encode", None)) or callable(getattr(tok, "apply_chat_template", None)):
        return tok
    raise ValueError(
        "tokenizer must be 'default', a local tokenizer directory or a tokenizer object (with "
        f"apply_chat_template/encode), got {type(tok).__name__} {tok!r:.80}"
    )


def _as_chat_tokenizer(tok: Any) -> Any:
    """Render through agl's chat renderer when we can, as the gateway does.

    Hugging Face chat templates often cannot render assistant tool-call messages (SmolLM2's fails on
    them); the gateway's renderer lowers tool calls and tool results into the text the model was
    actually shown, so re-tokenised transitions match what the engine would have produced.
    """
    if tok is None or (hasattr(tok, "render") and hasattr(tok, "encode_chat")):
        return tok
    if getattr(tok, "backend_tokenizer", None) is None or not getattr(tok, "chat_template", None):
        return tok
    try:
        from agl.gateway.tokenizer import ChatTokenizer

        return ChatTokenizer.from_hf(tok)
    except Exception:  # noqa: BLE001 - fall back to the tokenizer's own template
        return tok


def _retokenise(
    tok: Any,
    messages: list[dict[str, Any]],
    out: dict[str, Any] | None,
    text: str | None,
    attrs: Mapping[str, Any],
    anchor_attrs: Mapping[str, Any],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Prompt/response ids from messages through the tokenizer's chat template.

    The response is the suffix that rendering the conversation *with* the response adds to the prompt
    (so special tokens and tool-call syntax come out as the template writes them), cut after the
    end-of-turn token; if the template does not extend the prompt that way, the response text is
    encoded on its own.
    """
    raw_tools = attrs.get(sc.GEN_AI_TOOL_DEFINITIONS) or anchor_attrs.get(sc.GEN_AI_TOOL_DEFINITIONS)
    try:
        tools = _loads(raw_tools) if raw_tools else None
    except ValueError:
        tools = None
    if not isinstance(tools, list) or not tools:
        tools = None
    chat_tok = hasattr(tok, "render") and hasattr(tok, "encode_chat")  # agl.gateway ChatTokenizer
    if not messages:
        prompt_text = attrs.get(sc.AGL_LLM_PROMPT_TEXT)
        if not isinstance(prompt_text, str) or text is None:
            return None
        prompt = _encode(tok, prompt_text, chat_tok)
        return tuple(prompt), tuple(_encode(tok, text, chat_tok))
    if out is None and text is None:
        return None
    reply = dict(out) if out is not None else {"role": "assistant", "content": text}
    reply["role"] = "assistant"
    if chat_tok:
        prompt = tok.encode(tok.render(messages, tools, add_generation_prompt=True))
        full = tok.encode(tok.render([*messages, reply], tools, add_generation_prompt=False))
    else:
        kw: dict[str, Any] = {"tokenize": True}
        if tools is not None:
            kw["tools"] = tools
        prompt = _ids(tok.apply_chat_template(messages, add_generation_prompt=True, **kw))
        full = _ids(tok.apply_chat_template([*messages, reply], add_generation_prompt=False, **kw))
    eos = getattr(tok, "eos_token_id", None)
    if len(full) > len(prompt) and full[: len(prompt)] == prompt:
        response = list(full[len(prompt) :])
        if isinstance(eos, int) and eos in response:
            response = response[: len(response) - response[::-1].index(eos)]
    else:
        response = _encode(tok, text or "", chat_tok)
        if isinstance(eos, int):
            response.append(eos)
    return tuple(prompt), tuple(response)


def _encode(tok: Any, text: str, chat_tok: bool) -> list[int]:
    if chat_tok:
        return list(tok.encode(text))
    return _ids(tok.encode(text, add_special_tokens=False))
