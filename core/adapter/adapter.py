"""The :class:`Adapter`: one attempt's spans → transitions, as a pipeline of named steps (which attempt
→ its live spans → the repaired tree → the LLM calls → rewards and AIR → selected transitions with
credit).

The hot path is plain Python over already-validated spans: one pass to deduplicate and classify, one
to build the tree, one over the LLM calls. Transitions are built with ``model_construct`` from values
the adapter has checked itself (see :func:`agl.adapter.messages._int_list`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from agl import semconv as sc
from agl.adapter.air import AirPass
from agl.adapter.air_rules import AIR
from agl.adapter.credit import credit_returns
from agl.adapter.failures import FailureKind, deciding_attempt, failure_kind
from agl.adapter.messages import (
    _cut_at_max_tokens,
    _float_list,
    _int_list,
    _loads,
    _norm_message,
    _response_text,
)
from agl.adapter.rewards import attach_rewards, final_reward
from agl.adapter.spans import (
    _AGENT,
    _LLM,
    AgentSelection,
    _Call,
    _live_spans,
    _Locator,
    _seq,
    _Target,
    _target,
    _Tree,
    agent_matcher,
    finishing_attempt,
    framework_used,
)
from agl.adapter.stats import AdapterStats
from agl.adapter.trajectories import merge_stats
from agl.chat.tokenizer import as_chat_tokenizer, resolve_tokenizer, retokenise
from agl.errors import UsageError
from agl.lora import lora_name
from agl.types import Rollout, Span, Transition

if TYPE_CHECKING:
    from agl.store.base import Store

__all__ = ["Adapter"]

log = logging.getLogger(__name__)


class Adapter:
    """Turns the spans of one attempt into the transitions LightningRL trains on.

    ``agents`` selects whose LLM calls become transitions: None (all), a list of names, or a regular
    expression (a ``str`` or compiled pattern, matched against the whole name). ``tokenizer`` (an HF
    tokenizer, or anything with ``apply_chat_template``/``encode``, or agl's gateway ``ChatTokenizer``)
    re-tokenises calls that have no engine token ids; without one they are skipped and counted. ``air``
    sets the automatic intermediate rewards (``None`` or ``AIR.off()`` for none). ``missing_reward`` is
    the final reward of an attempt that never reported one, when set; unset (None, the default) such an
    attempt is ``no_reward`` and the trainer leaves it out of its group (a silent zero is never a
    reward), while its transitions carry 0.0. ``keep_discarded``: also turn the calls whose
    output the app threw away (an input guardrail tripped during the agent's turn, the agent span's
    ``agl.discarded.windows``) into transitions, marked ``discarded=True``; by default they are left out.

    ``Transition.reward`` is the credited return (:mod:`agl.adapter.credit`) under ``algorithm``'s
    credit rule (anything with ``.credit`` and ``.gamma``; by default LightningRL's ``identical`` rule,
    ``R + r_j`` with ``include_intermediate=True``), computed here once: exports and the inspection CLI
    show it, and ``LightningRL.compute_advantages`` normalises it without crediting again.
    """

    def __init__(
        self,
        agents: AgentSelection = None,
        tokenizer: Any = None,
        air: AIR | None = AIR(),
        missing_reward: float | None = None,
        *,
        algorithm: Any = None,
        include_intermediate: bool = True,
        keep_discarded: bool = False,
    ) -> None:
        self._match = agent_matcher(agents)
        self.agents = agents
        self.tokenizer = as_chat_tokenizer(resolve_tokenizer(tokenizer))
        if air is not None and not isinstance(air, AIR):
            raise UsageError(
                f"air must be an agl.adapter.air_rules.AIR (or None for no automatic rewards), got {air!r}"
            )
        self.air = AIR.off() if air is None else air
        if missing_reward is not None and (
            isinstance(missing_reward, bool) or not isinstance(missing_reward, (int, float))
        ):
            raise UsageError(f"missing_reward must be a number or None, got {missing_reward!r}")
        if missing_reward is not None and not math.isfinite(missing_reward):
            raise UsageError(f"missing_reward must be finite, got {missing_reward!r}")
        #: the default reward asked for, or None (unset: a rollout without a reward is no member of its
        #: group, agl.algorithms.groups); ``_fill`` is what its transitions carry meanwhile
        self.missing_reward = None if missing_reward is None else float(missing_reward)
        self._fill = self.missing_reward or 0.0
        #: the credit rule's configuration (``.credit``, ``.gamma``); None: ``identical``, gamma 1 (the
        #: defaults of :class:`agl.LightningRL`, without importing the algorithms layer)
        self.algorithm = algorithm
        self.include_intermediate = include_intermediate
        if not isinstance(keep_discarded, bool):
            raise UsageError(f"keep_discarded must be True or False, got {keep_discarded!r}")
        #: keep the calls whose output the app threw away (``Transition.discarded=True``); by default
        #: they are left out and counted (``AdapterStats.discarded``): their reward is not about them
        self.keep_discarded = keep_discarded
        self.stats = AdapterStats()
        self.last_stats = AdapterStats()
        #: final rewards of the rollouts of the last :meth:`from_store` call, by (rollout id, attempt)
        self._finals: dict[tuple[str, int], float | None] = {}
        #: failure kinds of the rollouts of the last :meth:`from_store` call, by (rollout id, attempt)
        self._kinds: dict[tuple[str, int], str] = {}

    def rollout_reward(self, store: Store, rollout: Rollout) -> float:
        """The final reward of ``rollout``'s finishing attempt (:func:`final_reward`), or
        ``missing_reward`` — what its transitions carry as ``final_reward``, also for a rollout that
        made no LLM call. A rollout the last :meth:`from_store` call adapted is not read again."""
        att = finishing_attempt(rollout)
        if att is None:
            return self._fill
        if (rollout.id, att) in self._finals:
            value = self._finals[(rollout.id, att)]
            return self._fill if value is None else value
        spans = store.query_spans(
            rollout_id=rollout.id, attempt=att, name=sc.SPAN_REWARD, include_stale=False
        )
        value = final_reward(spans)
        return self._fill if value is None else value

    # ------------------------------------------------------------------ public API

    def from_store(
        self, store: Store, rollouts: Iterable[str | Rollout], *, progress: bool = False
    ) -> list[Transition]:
        """Transitions of each rollout's finishing attempt (non-stale spans only), in the given order.

        ``rollouts`` are ids or :class:`Rollout` objects: a rollout handed over is not queried again
        (only ids are looked up). Each attempt's spans are read once; :meth:`rollout_reward` then reuses
        the final rewards found here."""
        wanted = self._rollouts(store, rollouts)
        self._finals = {}
        self._kinds = {}
        out: list[Transition] = []
        it: Iterable[Rollout] = wanted
        if progress:
            from tqdm import tqdm

            it = tqdm(wanted, desc="adapter", unit="rollout", leave=False)
        for rollout in it:
            att = finishing_attempt(rollout)
            if att is None:
                self.stats.no_finished_attempt += 1
                continue
            spans = store.query_spans(rollout_id=rollout.id, attempt=att, include_stale=False)
            kind = failure_kind(rollout, spans)
            self._kinds[(rollout.id, att)] = kind
            ts = self.transitions(spans, rollout=rollout, attempt=att)
            out.extend(t.model_copy(update={"failure_kind": kind}) for t in ts)
            self._finals[(rollout.id, att)] = self._final
        return out

    def failure_kind(self, store: Store, rollout: Rollout) -> FailureKind:
        """How ``rollout``'s finishing attempt ended (:func:`agl.adapter.failures.failure_kind`): read
        once — a rollout the last :meth:`from_store` call adapted is not read again."""
        att = finishing_attempt(rollout)
        if att is not None and (rollout.id, att) in self._kinds:
            return self._kinds[(rollout.id, att)]  # type: ignore[return-value]
        if att is None:  # no attempt finished: the last one's spans, stale ones too (deciding_attempt)
            att = deciding_attempt(rollout)
            spans = [] if att is None else store.query_spans(rollout_id=rollout.id, attempt=att)
        else:
            spans = store.query_spans(rollout_id=rollout.id, attempt=att, include_stale=False)
        return failure_kind(rollout, spans)

    @staticmethod
    def _rollouts(store: Store, rollouts: Iterable[str | Rollout]) -> list[Rollout]:
        """The rollouts in the given order, once each; ids are queried, Rollout objects used as given."""
        from agl.store.base import NotFoundError

        given: dict[str, Rollout | None] = {}
        for r in rollouts:
            if isinstance(r, Rollout):
                given[r.id] = r
            elif isinstance(r, str):
                given.setdefault(r, None)
            else:
                raise UsageError(f"rollouts must be rollout ids (str) or Rollout objects, got {r!r:.80}")
        ids = [rid for rid, r in given.items() if r is None]
        if ids:
            found = {r.id: r for r in store.query_rollouts(ids=ids)}
            missing = [i for i in ids if i not in found]
            if missing:
                raise NotFoundError(f"rollout(s) not found: {', '.join(missing)}")
            given.update(found)
        return [r for r in given.values() if r is not None]

    def transitions(
        self, spans: Iterable[Span], *, rollout: Rollout | None = None, attempt: int | None = None
    ) -> list[Transition]:
        """The transitions of one attempt, in call order, with rewards attached and credit assigned.

        Spans of other rollouts/attempts and stale spans are ignored. The attempt is ``attempt`` if
        given, else the rollout's finishing attempt (see :func:`finishing_attempt`), else the highest
        attempt number among the spans. Without ``rollout`` all spans must belong to one rollout.
        """
        st = AdapterStats()
        self._final = None
        try:
            return self._transitions(list(spans), rollout, attempt, st)
        finally:
            self.last_stats = st
            self.stats.merge(st)

    # ------------------------------------------------------------------ internals

    def returns(self, final_reward: float, intermediate: Sequence[float]) -> list[float]:
        """The credited return of each of one rollout's transitions (in call order) under this
        adapter's credit rule (:func:`agl.adapter.credit.credit_returns`, the one implementation);
        the reward assembly credits a judge-rescored rollout with it too."""
        return credit_returns(
            final_reward, intermediate, self.algorithm, include_intermediate=self.include_intermediate
        )

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
        inter, self._final = attach_rewards(tree, len(calls), locate, st)
        big_r = self._fill if self._final is None else self._final
        if self.air.enabled and calls:
            air = AirPass(self.air, tree, calls, locate, st).run()
            # the guards (caps, outcome gate: agl.adapter.air_rules.AIR.shape) see the whole rollout's AIR
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
            and framework_used(S)
        ):
            st.unattributed_calls += len(calls)
        return calls

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
        mine = [k for k in selected if not _served_by_other(tree.S, calls[k])]
        st.other_adapter += len(selected) - len(mine)
        thrown = {k for k in mine if tree.discarded(calls[k].anchor, calls[k].start)}
        st.discarded += len(thrown)
        selected = mine if self.keep_discarded else [k for k in mine if k not in thrown]
        sel_set = set(selected)
        for k, value in enumerate(inter):
            if value != 0.0 and k not in sel_set:
                st.unselected_rewards += 1
        built: list[tuple[int, dict[str, Any]]] = []
        for k in selected:
            data = self._build(tree.S, calls[k], st)
            if data is not None:
                built.append((k, data))
        returns = self.returns(big_r, [inter[k] for k, _ in built])
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
                discarded=k in thrown,
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
        """One call's transition fields: engine token ids when the gateway recorded them exactly, else
        ids re-tokenised from its messages (None, counted, when that is not possible)."""
        s = S[c.idx]
        a, anchor = s.attributes, S[c.anchor].attributes
        messages = self._input(S, c, st)
        text = _response_text(c.output)
        ids = self._exact_ids(a, st) if c.server else None
        exact = ids is not None
        if ids is None:
            ids = self._retokenised_ids(s, anchor, messages, c.output, text, st)
            if ids is None:
                return None
        prompt_ids, response_ids, logprobs = ids
        model = a.get(sc.GEN_AI_RESPONSE_MODEL) or a.get(sc.GEN_AI_REQUEST_MODEL)
        if model is None:
            model = anchor.get(sc.GEN_AI_REQUEST_MODEL)
        wv = a.get(sc.AGL_LLM_WEIGHT_VERSION)
        runs = weight_runs(a.get(sc.AGL_LLM_WEIGHT_VERSIONS), len(response_ids)) if exact else None
        if runs:  # the call's staleness is that of its oldest tokens
            wv = min(v for v, _ in runs)
        finish = a.get(sc.GEN_AI_RESPONSE_FINISH_REASONS) or anchor.get(sc.GEN_AI_RESPONSE_FINISH_REASONS)
        return {
            "prompt_ids": prompt_ids,
            "response_ids": response_ids,
            "response_logprobs": logprobs,
            "messages": tuple(messages),
            "response_text": text,
            "exact": exact,
            "span_id": s.span_id,
            "model": model if isinstance(model, str) else None,
            "weight_version": wv if isinstance(wv, int) and not isinstance(wv, bool) else None,
            "weight_versions": runs,
            "truncated": _cut_at_max_tokens(finish),
            **_seed_fields(a),
        }

    @staticmethod
    def _exact_ids(a: Any, st: AdapterStats) -> tuple[tuple[int, ...], tuple[int, ...], Any] | None:
        """(prompt ids, response ids, logprobs) as the gateway recorded them; None when not exact."""
        prompt = a.get(sc.AGL_LLM_PROMPT_TOKEN_IDS)
        response = a.get(sc.AGL_LLM_RESPONSE_TOKEN_IDS)
        if a.get(sc.AGL_LLM_EXACT, True) is False or not (_int_list(prompt) and _int_list(response)):
            return None
        response_ids = tuple(response)
        logprobs: Any = None
        lp = a.get(sc.AGL_LLM_RESPONSE_LOGPROBS)
        if lp is not None:
            if _float_list(lp) and len(lp) == len(response_ids):
                logprobs = tuple(lp)
            else:
                st.logprobs_dropped += 1
        st.exact += 1
        return tuple(prompt), response_ids, logprobs

    def _retokenised_ids(
        self,
        s: Span,
        anchor: Any,
        messages: list[dict[str, Any]],
        out: dict[str, Any] | None,
        text: str | None,
        st: AdapterStats,
    ) -> tuple[tuple[int, ...], tuple[int, ...], None] | None:
        """(prompt ids, response ids, no logprobs) re-tokenised from the call's messages; None, counted,
        without a tokenizer or when the tokenizer cannot render them."""
        if self.tokenizer is None:
            st.no_tokenizer += 1
            return None
        a = s.attributes
        tools = a.get(sc.GEN_AI_TOOL_DEFINITIONS) or anchor.get(sc.GEN_AI_TOOL_DEFINITIONS)
        try:
            ids = retokenise(
                self.tokenizer, messages, out, text, tools=tools, prompt_text=a.get(sc.AGL_LLM_PROMPT_TEXT)
            )
        except Exception as exc:  # template errors vary by tokenizer; count and go on
            log.debug("re-tokenising span %s failed: %r", s.span_id, exc)
            ids = None
        if ids is None:
            st.retokenise_failed += 1
            return None
        st.retokenised += 1
        return ids[0], ids[1], None


def weight_runs(raw: Any, n_tokens: int) -> tuple[tuple[int, int], ...] | None:
    """The span's ``agl.llm.weight_versions`` (flattened ``[version, n, ...]``) as run-length pairs;
    None when absent or malformed: odd length, a non-integer or negative entry, or run lengths that do
    not add up to the response's ``n_tokens``."""
    if not isinstance(raw, (list, tuple)) or not raw or len(raw) % 2:
        return None
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in raw):
        return None
    runs = tuple((int(raw[i]), int(raw[i + 1])) for i in range(0, len(raw), 2))
    return runs if sum(n for _, n in runs) == n_tokens else None


def _served_by_other(S: list[Span], c: _Call) -> bool:
    """Whether a named adapter other than the call's agent's own (or the base model, on a backend with
    adapters) served the call (``agl.llm.adapter`` on its server span; absent: one shared policy)."""
    served = S[c.idx].attributes.get(sc.AGL_LLM_ADAPTER) if c.server else None
    if served is None:
        return False
    return served != lora_name(c.agent or "")


def _seed_fields(a: Any) -> dict[str, Any]:
    """The call's seed and its source, as the gateway recorded them (none when the call had no seed)."""
    seed = a.get(sc.AGL_LLM_SEED)
    if not isinstance(seed, int) or isinstance(seed, bool):
        return {}
    source = a.get(sc.AGL_LLM_SEED_SOURCE)
    return {"seed": seed, "seed_source": source if isinstance(source, str) else None}
