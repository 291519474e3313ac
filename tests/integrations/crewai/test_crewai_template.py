"""A crew made by ``crewai create crew`` runs unchanged through agl, configured by environment variables
only (``OPENAI_BASE_URL``; CrewAI's default model name served by the policy), and its agents are known
by the names people see: the template's folded YAML (``role: >``) leaves a newline at the end of every
role, which agl trims everywhere (spans, baggage, selection, LoRA names), keeping the raw role in
``agl.agent.name.raw``."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("crewai")

from crewai_support import run_rollouts  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.adapter import Adapter  # noqa: E402
from agl.cli import main as agl_main  # noqa: E402
from agl.lora import lora_name, lora_pattern  # noqa: E402

RESEARCHER = "AI LLMs Senior Data Researcher"
ANALYST = "AI LLMs Reporting Analyst"


@pytest.fixture(scope="module")
def agl_policy() -> Any:
    def policy(request: Any) -> str:
        system = str((request.messages or [{}])[0].get("content") or "")
        if "Reporting Analyst" in system:
            return "# AI LLMs report\n\nEverything the research found, in sections."
        return "- models got larger\n- models got cheaper"

    return policy


@pytest.fixture(scope="module")
def agl_agent_of() -> Any:
    return None


def _run_template(agl_gateway: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> str:
    """One rollout of the template's crew, configured by the environment only; its rollout id."""
    monkeypatch.chdir(tmp_path)  # the template writes report.md into the working directory
    monkeypatch.setenv("OPENAI_BASE_URL", str(agl_gateway))  # the only configuration
    agl.instrument("openai", "crewai")
    from crewai_template.crew import LatestAiDevelopment

    def rollout(task: Any, resources: Any) -> float:  # the template's main.py run()
        LatestAiDevelopment().crew().kickoff(inputs={"topic": "AI LLMs", "current_year": "2025"})
        return 1.0

    (rid,) = run_rollouts(rollout, agl_gateway.store, str(agl_gateway), [{}])
    return str(rid)


def test_crewai_project_template_runs_unchanged(
    agl_gateway: Any, clean_agl: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, caplog: Any
) -> None:
    store = agl_gateway.store
    with caplog.at_level(logging.WARNING, "agl"):
        rid = _run_template(agl_gateway, monkeypatch, tmp_path)
    assert not [r for r in caplog.records if r.name.startswith("agl")], caplog.text  # no false alarm

    spans = store.query_spans(rollout_id=rid, attempt=1)
    agents = sorted((s for s in spans if s.name == sc.SPAN_INVOKE_AGENT), key=lambda s: s.start_ns)
    assert [a.attributes[sc.GEN_AI_AGENT_NAME] for a in agents] == [RESEARCHER, ANALYST]
    assert [a.attributes[sc.AGL_AGENT_NAME_RAW] for a in agents] == [RESEARCHER + "\n", ANALYST + "\n"]
    servers = [s for s in spans if s.name == sc.SPAN_CHAT and s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER]
    assert [s.attributes[sc.AGL_LLM_AGENT] for s in servers] == [RESEARCHER, ANALYST]  # the baggage
    assert {s.attributes[sc.GEN_AI_REQUEST_MODEL] for s in servers} == {"gpt-4.1-mini"}  # CrewAI's default
    assert all(s.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS] for s in servers)

    rollout_obj = store.get_rollout(rid)
    for selection, expected in (
        ([ANALYST], {ANALYST: 1}),
        ([ANALYST + "\n"], {ANALYST: 1}),  # the role exactly as the YAML gives it selects too
        (
            lora_pattern(lora_name(ANALYST + "\n")),
            {ANALYST: 1},
        ),  # what --adapter AI_LLMs_Reporting_Analyst does
    ):
        ts = Adapter(agents=selection).transitions(spans, rollout=rollout_obj, attempt=1)
        assert Counter(t.agent for t in ts) == Counter(expected) and all(t.exact for t in ts)
    assert lora_name(ANALYST + "\n") == "AI_LLMs_Reporting_Analyst"


def test_transitions_cli_selects_by_the_visible_name_and_says_which_exist(
    agl_gateway: Any, clean_agl: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: Any
) -> None:
    rid = _run_template(agl_gateway, monkeypatch, tmp_path)
    store_url = f"sqlite:///{tmp_path / 'agl.db'}"  # agl.testing's agl_store
    capsys.readouterr()
    assert agl_main(["transitions", rid, "--store", store_url, "--adapter", "AI_LLMs_Reporting_Analyst"]) == 0
    out = capsys.readouterr()
    assert f"agent={ANALYST}" in out.out and RESEARCHER not in out.out and "matches none" not in out.err
    assert agl_main(["transitions", rid, "--store", store_url, "--agents", "Reporting Analyst"]) == 0
    err = capsys.readouterr().err
    assert "--agents 'Reporting Analyst' matches none of the 2 LLM call(s)" in err
    assert f"{ANALYST} (1), {RESEARCHER} (1)" in err
