"""``agl.instrument()`` touches only what the application uses: in a fresh interpreter of a plain-client
app it loads no agent framework and writes nothing under ``$HOME``; a framework imported afterwards is
instrumented on its import (a post-import hook) and its spans are recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("langchain_core")

FRAMEWORKS = ("crewai", "langchain_core", "autogen_agentchat", "agents")

SCRIPT = """
import json, sys
import openai  # a plain-client application: only the openai client
import agl
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

exporter = InMemorySpanExporter()
agl.setup_tracing().add_span_processor(SimpleSpanProcessor(exporter))
agl.instrument()
from agl.instrumentation import instrumented, is_waiting
from agl.reports.doctor import report
out = {
    "loaded": [m for m in %(frameworks)r if m in sys.modules],
    "instrumented": instrumented(),
    "waiting": [n for n in ("langchain", "crewai", "autogen", "openai_agents") if is_waiting(n)],
    "doctor": [line for line in report().splitlines() if "waiting for import" in line],
}
from langchain_core.tools import tool  # imported afterwards
out["after_import"] = instrumented()

@tool
def count_words(text: str) -> int:
    \"\"\"Count the words of a text.\"\"\"
    return len(text.split())

with agl.rollout_context("ro-1", 1):
    assert count_words.invoke({"text": "one two three"}) == 3
out["integrations"] = sorted({str(s.attributes.get("agl.integration")) for s in exporter.get_finished_spans()})
print(json.dumps(out))
"""


def test_plain_app_loads_no_framework_and_a_later_import_is_instrumented(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    cwd = tmp_path / "myapp"
    cwd.mkdir()
    env = {**os.environ, "HOME": str(home), "XDG_DATA_HOME": "", "XDG_CONFIG_HOME": ""}
    env = {k: v for k, v in env.items() if v != ""}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT % {"frameworks": FRAMEWORKS}],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded"] == [], out  # no framework module loaded on the app's behalf
    assert out["instrumented"] == ["openai"], out
    assert {"langchain", "crewai", "autogen", "openai_agents"} <= set(out["waiting"]), out
    assert any(line.lstrip().startswith("langchain") for line in out["doctor"]), out
    assert "langchain" in out["after_import"], out  # instrumented when imported
    assert "langchain" in out["integrations"], out  # and its spans are recorded
    written = [str(p.relative_to(home)) for p in home.rglob("*")]
    assert written == [], written  # nothing written under $HOME (CrewAI made ~/.local/share/<cwd> on import)
