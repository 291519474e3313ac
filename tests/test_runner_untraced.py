"""The runner's instrumentation warning is given only when true: an attempt whose LLM calls went through
the gateway but left no client-side span. A program that calls ``agl.instrument()`` before it imports
its framework (the integrations wait for the import) gets no warning; one that never instruments gets
one, once, after its first attempt. Each case runs in a fresh interpreter (so ``openai`` really is
imported after the runner started), against agl's real gateway on the scripted engine."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("openai")

PROGRAM = """
import logging, sys
import agl
from agl.gateway.testing import ScriptedBackend, serve_gateway
from agl.store.memory import MemoryStore
from agl.types import LLM, NewRollout

logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s: %(message)s")
INSTRUMENT = {instrument}
if INSTRUMENT:
    agl.instrument()  # before the program imports openai: the openai integration waits for the import
    from agl.instrumentation import instrumented, is_waiting
    assert instrumented() == [] and is_waiting("openai"), instrumented()

def agent(task, resources):
    import openai  # the framework is imported by the agent, after the runner started
    llm = resources.llm
    client = openai.OpenAI(base_url=llm.base_url, api_key="sk-agl-test", max_retries=0)
    client.chat.completions.create(model="gpt-4o", messages=[{{"role": "user", "content": "hi"}}])
    return 1.0

store = MemoryStore()
with serve_gateway(ScriptedBackend(["ok"], on_exhausted="repeat"), store) as url:
    version = store.add_resources({{"main": LLM(base_url=str(url), model="gpt-4o")}}).version
    store.enqueue([NewRollout(input=i, resources_version=version) for i in range(3)])
    stats = agl.Runner(agent, store, claim_timeout_s=0.2).run(max_rollouts=3)
assert stats.succeeded == 3, stats.errors
sides = sorted({{s.attributes.get("agl.side") for s in store.query_spans() if s.name == "chat"}})
print("SIDES", sides)
"""


def _run(tmp_path: Path, instrument: bool) -> str:
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PROGRAM.format(instrument=instrument)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_no_warning_when_integrations_wait_for_the_programs_import(tmp_path: Path) -> None:
    out = _run(tmp_path, instrument=True)
    assert "SIDES ['client', 'server']" in out  # every call traced on both sides
    assert "agl.runner" not in out, out  # and nothing to warn about


def test_warns_once_when_calls_left_no_client_span(tmp_path: Path) -> None:
    out = _run(tmp_path, instrument=False)
    assert "SIDES ['server']" in out
    warnings = [line for line in out.splitlines() if line.startswith("agl.runner:")]
    assert len(warnings) == 1, out  # once, not per rollout
    assert "left no client-side span" in warnings[0] and "agl.instrument()" in warnings[0]
