"""Test-wide settings: offline, no framework telemetry, never a real API key."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "0")
os.environ.setdefault("OPENAI_API_KEY", "sk-agl-test")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def pytest_configure(config: pytest.Config) -> None:
    """agl.testing is a pytest11 plugin once agl is installed; a checkout run without installing the
    distribution (e.g. a venv that maps ``agl`` to this tree) registers it here instead."""
    pm = config.pluginmanager
    if not pm.has_plugin("agl") and not pm.is_blocked("agl"):
        import agl.testing.plugin

        pm.register(agl.testing.plugin, "agl")
