"""How exact a run's training data is: the share of transitions with engine token ids, by API and backend,
and the run-level deviation between behaviour log-probs and the trainer's.

A transition is *exact* when its ids came from the engine through the gateway (``agl.llm.exact``);
otherwise they were re-derived from text (a client-side span re-tokenised, or a pass-through upstream
that returned no ids). The gateway stamps each server span with the route the call came in by
(``agl.llm.api``: chat, completions, responses, messages) and the backend that answered
(``agl.llm.backend``), so the share can be broken down by both: an agent that switched to the
Anthropic client, or a backend that stopped returning ids, shows up as its own row. Transitions read
from client-side spans count under the API ``client`` and the backend ``none``.

``behaviour_ratio_dev`` (per update step, from :mod:`agl.algorithms.update`) is max |pi/mu - 1| over
the step's response tokens before its first optimizer step; :func:`run_figures` folds the per-step
metrics into run-level figures (max and mean over steps, exact share weighted by transitions).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agl import semconv as sc

__all__ = ["exactness_report", "format_report", "run_figures"]


def _row(rows: dict[str, list[int]], key: str, exact: bool) -> None:
    row = rows.setdefault(key, [0, 0])
    row[0] += 1
    row[1] += int(exact)


def _shares(rows: Mapping[str, list[int]]) -> dict[str, dict[str, Any]]:
    return {k: {"transitions": n, "exact": e, "share": e / n} for k, (n, e) in sorted(rows.items())}


def exactness_report(transitions: Sequence[Any], spans: Iterable[Any]) -> dict[str, Any]:
    """``{"transitions", "exact", "share", "by_api": {api: {transitions, exact, share}}, "by_backend": ...}``
    for transitions (``span_id``, ``exact``) and the spans they were read from."""
    attrs = {s.span_id: s.attributes for s in spans}
    by_api: dict[str, list[int]] = {}
    by_backend: dict[str, list[int]] = {}
    for t in transitions:
        a = attrs.get(t.span_id) or {}
        server = a.get(sc.AGL_SIDE) == sc.SIDE_SERVER
        _row(by_api, str(a.get(sc.AGL_LLM_API, "chat")) if server else "client", t.exact)
        _row(by_backend, str(a.get(sc.AGL_LLM_BACKEND, "unknown")) if server else "none", t.exact)
    n, exact = len(transitions), sum(1 for t in transitions if t.exact)
    return {
        "transitions": n,
        "exact": exact,
        "share": exact / n if n else None,
        "by_api": _shares(by_api),
        "by_backend": _shares(by_backend),
    }


def format_report(report: Mapping[str, Any]) -> str:
    """One line: ``exact 9/10 (0.90); by API chat 4/4, messages 5/6; by backend vllm 9/10``."""
    if not report["transitions"]:
        return "exact: no transitions"

    def part(rows: Mapping[str, Mapping[str, Any]]) -> str:
        return ", ".join(f"{k} {r['exact']}/{r['transitions']}" for k, r in rows.items())

    return (
        f"exact {report['exact']}/{report['transitions']} ({report['share']:.2f}); "
        f"by API {part(report['by_api'])}; by backend {part(report['by_backend'])}"
    )


def _finite(values: Iterable[Any]) -> list[float]:
    out = []
    for v in values:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf"):
            out.append(float(v))
    return out


def run_figures(steps: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Run-level figures from per-step metrics (rows of ``metrics.jsonl``): ``exact_token_ratio`` (the
    steps' ratios weighted by their ``transitions``), ``behaviour_ratio_dev_max`` and ``_mean`` (over
    the steps that report it; None when none does, e.g. behaviour log-probs off)."""
    rows = list(steps)
    weighted = [
        (r["exact_token_ratio"], r.get("transitions") or 1)
        for r in rows
        if _finite([r.get("exact_token_ratio")])
    ]
    total = sum(w for _, w in weighted)
    devs = _finite(r.get("behaviour_ratio_dev") for r in rows)
    return {
        "exact_token_ratio": sum(v * w for v, w in weighted) / total if total else None,
        "behaviour_ratio_dev_max": max(devs) if devs else None,
        "behaviour_ratio_dev_mean": sum(devs) / len(devs) if devs else None,
        "steps_with_behaviour_logprobs": len(devs),
    }
