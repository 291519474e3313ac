"""Exactness per run: the share of exact transitions by API and backend, and the run-level figures."""

from __future__ import annotations

from typing import Any

import pytest
from gateway.gw_helpers import start_rollout

import agl.store
from agl.adapter import Adapter
from agl.gateway.testing import ScriptedBackend, serve_gateway
from agl.reports.exactness import exactness_report, format_report, run_figures

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")


def test_report_breaks_exactness_down_by_api_and_backend() -> None:
    store = agl.store.open("memory://")
    rid, attempt = start_rollout(store, "ro-exact")
    with serve_gateway(ScriptedBackend(["a", "b", "c"]), store) as url:
        base = url.for_rollout(rid, attempt)
        oai = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        oai.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "1"}])
        oai.completions.create(model="scripted", prompt="2")
        an = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key="x", max_retries=0)
        an.messages.create(model="scripted", max_tokens=16, messages=[{"role": "user", "content": "3"}])
    spans = store.query_spans(rollout_id=rid)
    ts = Adapter().transitions(spans, attempt=attempt)
    report = exactness_report(ts, spans)
    assert report["transitions"] == len(ts) == 3 and report["share"] == 1.0
    assert {k: r["transitions"] for k, r in report["by_api"].items()} == {
        "chat": 1,
        "completions": 1,
        "messages": 1,
    }
    assert report["by_backend"] == {"scripted": {"transitions": 3, "exact": 3, "share": 1.0}}
    assert "messages 1/1" in format_report(report)
    # a transition re-derived from text counts as not exact, under its own API
    inexact = [t.model_copy(update={"exact": False}) if i == 2 else t for i, t in enumerate(ts)]
    report = exactness_report(inexact, spans)
    assert report["exact"] == 2 and sum(r["exact"] for r in report["by_api"].values()) == 2
    store.close()


def test_run_figures_weight_steps_and_skip_missing_deviations() -> None:
    steps: list[dict[str, Any]] = [
        {"exact_token_ratio": 1.0, "transitions": 30, "behaviour_ratio_dev": 0.01},
        {"exact_token_ratio": 0.5, "transitions": 10, "behaviour_ratio_dev": float("nan")},
        {"exact_token_ratio": None, "transitions": 0},
        {"exact_token_ratio": 0.0, "transitions": 10, "behaviour_ratio_dev": 0.03},
    ]
    fig = run_figures(steps)
    assert fig["exact_token_ratio"] == pytest.approx((30 + 5) / 50)
    assert fig["behaviour_ratio_dev_max"] == 0.03
    assert fig["behaviour_ratio_dev_mean"] == pytest.approx(0.02)
    assert fig["steps_with_behaviour_logprobs"] == 2
    assert run_figures([])["exact_token_ratio"] is None
