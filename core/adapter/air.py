"""Automatic intermediate rewards (:class:`agl.adapter.air_rules.AIR`) placed on the LLM calls that caused them.

:mod:`agl.adapter.air_rules` says how much each signal is worth; this module says which call it lands on:

- a tool span (error or success) goes to the call that issued it (by ``gen_ai.tool.call.id``, else the
  call before the tool started, same agent preferred);
- an exception counts once where it was raised: a span whose exception signature (type, message) was
  already seen below it only propagated it;
- a tool call whose arguments are not valid JSON penalises the call that wrote it (unless the tool ran
  and failed, which ``tool_error`` already counted);
- plugin rewards land on the span's own call, else on the issuer or the call before the span ended.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from agl import semconv as sc
from agl.adapter.air_rules import AIR, plugin_rewards
from agl.adapter.spans import _EXC, _TOOL, _Call, _Locator, _Tree
from agl.adapter.stats import AdapterStats
from agl.types import Span

__all__ = ["AirPass"]


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


class AirPass:
    """One attempt's AIR: :meth:`run` returns the raw AIR per call (before :meth:`AIR.shape`)."""

    def __init__(self, air: AIR, tree: _Tree, calls: list[_Call], locate: _Locator, st: AdapterStats) -> None:
        self.air, self.tree, self.calls, self.locate, self.st = air, tree, calls, locate, st
        self.out = [0.0] * len(calls)
        self.by_tool_id: dict[str, int] = {}
        for k, c in enumerate(calls):
            for tid in c.tool_call_ids:
                self.by_tool_id.setdefault(tid, k)
        self.failed_ids: set[str] = set()  #: tool call ids whose tool span failed

    def run(self) -> list[float]:
        candidates = self._tools_and_signatures()
        if self.air.weight("exception"):
            self._exceptions(*candidates)
        if self.air.weight("malformed_tool_call"):
            self._malformed()
        if self.air.use_plugins:
            self._plugins()
        return self.out

    def _add(self, k: int, value: float, rule: str) -> None:
        if k < 0:
            self.st.unattached_rewards += 1
            return
        self.out[k] += value
        self.st.air[rule] = self.st.air.get(rule, 0) + 1

    def _issuer(self, i: int) -> int:
        s = self.tree.S[i]
        tid = s.attributes.get(sc.GEN_AI_TOOL_CALL_ID)
        if isinstance(tid, str) and tid in self.by_tool_id:
            return self.by_tool_id[tid]
        return self.locate.before(s.start_ns, self.tree.agent_of(i))

    def _tool(self, i: int, is_err: bool) -> None:
        w_err, w_ok = self.air.weight("tool_error"), self.air.weight("tool_success")
        if is_err:
            tid = self.tree.S[i].attributes.get(sc.GEN_AI_TOOL_CALL_ID)
            if isinstance(tid, str):
                self.failed_ids.add(tid)
            if w_err:
                self._add(self._issuer(i), w_err, "tool_error")
        elif w_ok:
            self._add(self._issuer(i), w_ok, "tool_success")

    def _tools_and_signatures(self) -> tuple[list[int], dict[int, set[Any]]]:
        """Tool rewards; the exception candidates and the signatures seen below each span."""
        S, kind, parent = self.tree.S, self.tree.kind, self.tree.parent
        sig_below: dict[int, set[Any]] = {}
        candidates: list[int] = []
        for i in self.tree.notable:
            s, k_i = S[i], kind[i]
            is_err = s.status.code == "ERROR"
            if k_i == _TOOL:
                self._tool(i, is_err)
            elif k_i == _EXC or (is_err and _exception_event(s) is not None):
                candidates.append(i)
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
        return candidates, sig_below

    def _exceptions(self, candidates: list[int], sig_below: dict[int, set[Any]]) -> None:
        S, w_exc = self.tree.S, self.air.weight("exception")
        for i in candidates:
            below = sig_below.get(i)
            if below:
                sig = _signature(S[i])
                if sig in below or sig == (None, None) or (None, None) in below:
                    continue  # raised below and propagated up: already counted there
            ev = _exception_event(S[i])
            t = ev.time_ns if ev is not None else S[i].start_ns
            self._add(self.locate.before(t, self.tree.agent_of(i)), w_exc, "exception")

    def _malformed(self) -> None:
        w_bad = self.air.weight("malformed_tool_call")
        for k, c in enumerate(self.calls):
            tcs = c.output.get("tool_calls") if c.output else None
            if not isinstance(tcs, list):
                continue
            for tc in tcs:
                if not isinstance(tc, dict) or tc.get("id") in self.failed_ids:
                    continue
                fn = tc.get("function")
                args = fn.get("arguments") if isinstance(fn, dict) else None
                if isinstance(args, str):
                    try:
                        json.loads(args)
                    except ValueError:
                        self._add(k, w_bad, "malformed_tool_call")

    def _plugins(self) -> None:
        S, kind = self.tree.S, self.tree.kind
        errors: list[str] = []
        found = plugin_rewards(S, errors=errors)
        self.st.plugin_errors += len(errors)
        if not found:
            return
        call_of = {c.idx: k for k, c in enumerate(self.calls)}
        for c_k, c in enumerate(self.calls):
            call_of.setdefault(c.anchor, c_k)
        for i, value in found:
            k = call_of.get(i)
            if k is None:
                k = (
                    self._issuer(i)
                    if kind[i] == _TOOL
                    else self.locate.before(S[i].end_ns, self.tree.agent_of(i))
                )
            self._add(k, value, "plugin")
