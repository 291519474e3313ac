"""Plugin discovery (entry points), the Instrumentor base and agl.instrument()/uninstrument()."""

from __future__ import annotations

import importlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pluggy
import pytest
from opentelemetry.sdk.trace import TracerProvider

import agl
from agl import plugins, semconv
from agl.instrumentation import (
    IntegrationNotFoundError,
    MissingFrameworkError,
    available_instrumentors,
    instrumented,
)
from agl.tracing import provider as tracing
from agl.types import Span, SpanStatus

FIXTURES = Path(__file__).parent / "fixtures" / "plugin_dist"


def _install(tmp_path: Path, which: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """'pip install' a fixture distribution: copy it to a fresh sys.path entry."""
    site = tmp_path / f"site-{which}"
    shutil.copytree(FIXTURES / which, site)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    plugins.reset_plugin_manager()
    return site


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    agl.uninstrument()
    plugins.reset_plugin_manager()
    yield
    agl.uninstrument()
    for name in ("agl_testplugin", "agl_misspelt_plugin"):
        sys.modules.pop(name, None)
    plugins.reset_plugin_manager()
    importlib.invalidate_caches()
    tracing.reset_tracing()


@pytest.fixture()
def demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _install(tmp_path, "good", monkeypatch)
    module = importlib.import_module("agl_testplugin")
    module.calls.clear()
    return module


def test_builtin_integration_is_an_entry_point_plugin() -> None:
    pm = plugins.get_plugin_manager()
    assert pm is plugins.get_plugin_manager()  # loaded once
    assert pm.get_plugin("openai") is importlib.import_module("agl.integrations.openai")
    assert "openai" in available_instrumentors()


def test_third_party_plugin_is_discovered_via_entry_points(demo) -> None:
    pm = plugins.get_plugin_manager()
    assert pm.get_plugin("agl_testplugin") is demo
    found = available_instrumentors()
    assert found["agl-test-demo"] is demo.DemoInstrumentor
    assert found["agl-test-missing"] is demo.MissingFrameworkInstrumentor
    # the distribution it came from is known to pluggy, like any installed plugin
    dists = {d.project_name for _, d in pm.list_plugin_distinfo()}
    assert "agl-testplugin" in dists


def test_intermediate_reward_hook_from_plugin(demo) -> None:
    pm = plugins.get_plugin_manager()
    common = dict(trace_id="1" * 32, start_ns=1, end_ns=2, rollout_id="r1", attempt=1)
    failed = Span(span_id="2" * 16, name=semconv.SPAN_EXECUTE_TOOL, status=SpanStatus(code="ERROR"), **common)
    ok = Span(span_id="3" * 16, name=semconv.SPAN_EXECUTE_TOOL, **common)
    assert pm.hook.agl_intermediate_reward(span=failed, spans=[failed, ok]) == [-0.25]
    assert pm.hook.agl_intermediate_reward(span=ok, spans=[failed, ok]) == []


def test_misspelt_hook_fails_loudly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(tmp_path, "misspelt", monkeypatch)
    with pytest.raises(pluggy.PluginValidationError, match="agl_register_instrumentor"):
        plugins.get_plugin_manager()


def test_disabled_integrations_are_never_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugins.DISABLED_ENV, " agl_testplugin , openai")
    _install(tmp_path, "good", monkeypatch)
    pm = plugins.get_plugin_manager()
    assert pm.get_plugin("agl_testplugin") is None
    assert "agl_testplugin" not in sys.modules
    assert "openai" not in available_instrumentors()
    with pytest.raises(IntegrationNotFoundError, match="disabled by AGL_DISABLED_INTEGRATIONS"):
        agl.instrument("openai")


def test_instrument_named_passes_tracer_provider_and_is_idempotent(demo) -> None:
    provider = TracerProvider()
    assert agl.instrument("agl-test-demo", tracer_provider=provider) == ["agl-test-demo"]
    assert agl.instrument("agl-test-demo", tracer_provider=provider) == ["agl-test-demo"]
    assert demo.calls == [("instrument", provider)]
    assert "agl-test-demo" in instrumented()
    assert agl.uninstrument() == ["agl-test-demo"]
    assert agl.uninstrument() == []
    assert demo.calls == [("instrument", provider), ("uninstrument", None)]
    assert "agl-test-demo" not in instrumented()


def test_instrument_with_another_provider_reinstruments(demo) -> None:
    first, second = TracerProvider(), TracerProvider()
    agl.instrument("agl-test-demo", tracer_provider=first)
    agl.instrument("agl-test-demo", tracer_provider=second)
    assert demo.calls == [("instrument", first), ("uninstrument", None), ("instrument", second)]


def test_instrument_all_skips_missing_frameworks(demo) -> None:
    provider = TracerProvider()
    done = agl.instrument(tracer_provider=provider)
    assert "agl-test-demo" in done
    assert "agl-test-missing" not in done
    assert [c for c in demo.calls if c[0] == "instrument-missing"] == []
    assert set(agl.uninstrument()) == set(done)


def test_missing_framework_error_names_the_extra_and_changes_nothing(demo) -> None:
    with pytest.raises(MissingFrameworkError, match=r"pip install 'agl\[missing-extra\]'") as info:
        agl.instrument("agl-test-demo", "agl-test-missing", tracer_provider=TracerProvider())
    assert isinstance(info.value, ImportError)
    assert "agl-test-framework-that-does-not-exist" in str(info.value)
    assert demo.calls == []  # nothing was instrumented, not even the installed one


def test_unknown_name_lists_known_integrations(demo) -> None:
    with pytest.raises(IntegrationNotFoundError, match="no integration named 'nope'") as info:
        agl.instrument("agl-test-demo", "nope")
    assert "agl-test-demo" in str(info.value) and "openai" in str(info.value)
    assert demo.calls == []
    with pytest.raises(IntegrationNotFoundError):
        agl.uninstrument("nope")


def test_register_refuses_non_instrumentors() -> None:
    class Bad:
        @plugins.hookimpl
        def agl_register_instrumentors(self, register):
            register(object)

    pm = plugins.get_plugin_manager()
    pm.register(Bad(), name="bad")
    try:
        with pytest.raises(TypeError, match="Instrumentor subclass"):
            available_instrumentors()
    finally:
        pm.unregister(name="bad")


def test_the_plugin_manager_holds_one_instance_per_integration(demo) -> None:
    from agl.instrumentation import get_instrumentor

    first = get_instrumentor("agl-test-demo")
    assert first is get_instrumentor("agl-test-demo")
    assert isinstance(first, demo.DemoInstrumentor)
    assert demo.DemoInstrumentor() is not first  # no per-class singleton: the registry owns it
    assert plugins.get_plugin_manager().instances[demo.DemoInstrumentor] is first
    assert list(first.instrumentation_dependencies()) == ["pluggy >= 1.0"]


def test_instrumentations_survive_a_plugin_reset(demo) -> None:
    agl.instrument("agl-test-demo", tracer_provider=TracerProvider())
    plugins.reset_plugin_manager()
    assert instrumented() == ["agl-test-demo"]
    assert agl.uninstrument() == ["agl-test-demo"]
    assert [c[0] for c in demo.calls] == ["instrument", "uninstrument"]


def test_agl_instrument_is_a_function_and_the_module_has_another_name() -> None:
    import types

    import agl.instrumentation

    assert isinstance(agl.instrument, types.FunctionType)
    assert agl.instrument is agl.instrumentation.instrument
    assert agl.uninstrument is agl.instrumentation.uninstrument
    assert "agl.instrument" not in sys.modules


def test_lazy_instrumentors_defers_the_framework_and_rejects_bad_specs() -> None:
    """A built-in integration package is one ``lazy_instrumentors`` line: loading it imports no framework."""
    import subprocess

    probe = (
        "import sys, agl.integrations.crewai as pkg\n"
        "assert pkg.__all__ == ['CrewAIInstrumentor', 'agl_register_instrumentors'], pkg.__all__\n"
        "assert 'crewai' not in sys.modules and 'agl.integrations.crewai.instrumentor' not in sys.modules\n"
        "got = []\n"
        "pkg.agl_register_instrumentors(got.append)\n"
        "assert got == [pkg.CrewAIInstrumentor] and got[0].name == 'crewai', got\n"
        "try:\n"
        "    pkg.NoSuchInstrumentor\n"
        "    raise SystemExit('no AttributeError')\n"
        "except AttributeError:\n"
        "    pass\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from agl.instrumentation.registry import lazy_instrumentors

    for bad in ["", "agl.integrations.crewai.instrumentor", ":CrewAIInstrumentor", "m:not-a-name"]:
        with pytest.raises(ValueError, match="module:ClassName"):
            lazy_instrumentors(bad)
