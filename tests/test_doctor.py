"""``agl doctor``: frameworks vs tested versions, integrations and their hooks, the tracer provider."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import agl
import agl.reports.doctor
from agl.instrumentation import available_instrumentors, get_instrumentor, is_installed

ROOT = Path(__file__).resolve().parents[1]


def test_tested_versions_are_the_ci_pins() -> None:
    pins = dict(
        re.match(r"([A-Za-z0-9_.-]+)==([^\s;]+)", line).groups()  # type: ignore[union-attr]
        for line in (ROOT / "constraints" / "all.txt").read_text().splitlines()
        if re.match(r"[A-Za-z0-9_.-]+==", line)
    )
    pins.pop("torch", None)
    assert agl.reports.doctor.TESTED == {k: v for k, v in pins.items() if k in agl.reports.doctor.TESTED}
    framework_dists = {d for cls in available_instrumentors().values() for d in cls.distributions}
    assert set(agl.reports.doctor.TESTED) <= framework_dists
    assert {"crewai", "openai-agents", "autogen-agentchat"} <= set(pins)


def test_the_command_reports_frameworks_integrations_and_tracing() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agl.cli", "doctor", "--instrument"],
        capture_output=True,
        text=True,
        timeout=900,  # instrumenting every framework takes minutes on a loaded 2-core machine
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert text.startswith(f"agl {agl.__version__}")
    for name, cls in available_instrumentors().items():
        integration_lines = [line for line in text.split("Integrations:")[1].splitlines() if line.strip()]
        (line,) = [line for line in integration_lines if line.startswith(f"  {name} ")]
        if is_installed(cls):
            assert "instrumented, hooks in place" in line, line
            for dist in cls.distributions:
                try:
                    version = metadata.version(dist)
                except metadata.PackageNotFoundError:
                    version = "-"
                assert re.search(rf"{re.escape(dist)}\s+{re.escape(version)}\s", text), (dist, text)
        else:
            assert f"not installed (pip install 'agl[{cls.extra}]')" in line, line
    assert "tracer provider: opentelemetry.sdk.trace.TracerProvider (the global provider)" in text
    assert "span processor: RolloutSpanProcessor" in text


def test_a_lost_hook_is_reported(agl_tracer: Any) -> None:
    pytest.importorskip("langchain_core")
    from langchain_core.tracers import context as lc_context

    agl_tracer.instrument("langchain")
    assert "langchain      instrumented, hooks in place" in agl.reports.doctor.report()
    hook = get_instrumentor("langchain")._hook
    saved = list(lc_context._configure_hooks)
    lc_context._configure_hooks[:] = [h for h in saved if h[0] is not hook]  # what a misbehaving app might do
    try:
        text = agl.reports.doctor.report()
        assert "langchain      instrumented, HOOKS LOST" in text
        assert "! agl's LangChain configure hook was removed" in text
        assert (
            "span processor: SimpleSpanProcessor -> opentelemetry.sdk.trace.export.in_memory_span_exporter"
            in text
        )
    finally:
        lc_context._configure_hooks[:] = saved


def test_a_replaced_patch_is_reported_and_left_alone(agl_tracer: Any) -> None:
    pytest.importorskip("openai")
    from openai._base_client import SyncAPIClient

    agl_tracer.instrument("openai")
    ours = vars(SyncAPIClient)["request"]
    theirs = ours.__wrapped__  # another library puts "its" version over agl's wrapper
    SyncAPIClient.request = theirs
    try:
        health = get_instrumentor("openai").health()
        assert not health.ok and any("SyncAPIClient.request was replaced" in p for p in health.problems)
        agl.uninstrument("openai")
        assert vars(SyncAPIClient)["request"] is theirs  # left as the other library set it
    finally:
        SyncAPIClient.request = theirs
