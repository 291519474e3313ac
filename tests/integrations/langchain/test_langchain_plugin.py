"""The LangChain plugin without LangChain: it loads, registers and declares the extra's requirement.

Runs in every tox env, the ``core`` one (no framework installed) included.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_module_imports_without_langchain() -> None:
    """The plugin loads (and registers) with LangChain unimportable: nothing imports it at module top."""
    code = (
        "import sys\n"
        "for m in ('langchain_core', 'langchain', 'langgraph', 'langchain_openai'):\n"
        "    sys.modules[m] = None\n"
        "import agl.integrations.langchain as lc\n"
        "found = []\n"
        "lc.agl_register_instrumentors(found.append)\n"
        "cls = found[0]\n"
        "print(cls.name, cls.extra, cls.instruments)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["langchain", "langchain"]


def test_requirement_matches_the_extra() -> None:
    tomllib = pytest.importorskip("tomllib")
    from agl.integrations.langchain.instrumentor import LangChainInstrumentor

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "langchain"
    ]
    normalised = {r.replace(" ", "") for r in extra}
    assert {r.replace(" ", "") for r in LangChainInstrumentor.instruments} <= normalised
