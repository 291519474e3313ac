"""``agl doctor``: is agl hooked into this process the way the user thinks it is?

Silent loss of spans is the failure users cannot see: an agent framework that is not instrumented,
an application that replaced the hook agl installed, a tracer provider without agl's export. The
report lists, in order: the installed frameworks and their versions next to the ones agl's CI tests;
each integration's state (instrumented, hooks in place, guarded failures); the tracer provider agl
uses and its span processors and exporters.

From the shell (``agl doctor``, ``agl doctor --instrument`` to instrument first and check the hooks
take) or from inside the application, where it matters most::

    import agl.reports.doctor
    print(agl.reports.doctor.report())
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from packaging.requirements import Requirement

from agl import __version__

__all__ = ["TESTED", "FrameworkVersion", "frameworks", "report"]

#: Versions CI tests in the ``all`` env (constraints/all.txt); the per-framework tox envs test the newest
#: release. tests/test_doctor.py keeps this in step with the constraints file.
TESTED: dict[str, str] = {
    "crewai": "1.15.30",
    "openai-agents": "0.20.0",
    "autogen-agentchat": "0.7.5",
    "autogen-core": "0.7.5",
    "autogen-ext": "0.7.5",
}


@dataclass
class FrameworkVersion:
    integration: str
    distribution: str
    installed: str | None
    tested: str  # a version, or "newest" when CI tests the newest release
    supported: str  # the integration's requirement, "" when it does not name this distribution

    @property
    def verdict(self) -> str:
        if self.installed is None:
            return "not installed"
        if self.supported:
            req = Requirement(self.supported)
            if not req.specifier.contains(self.installed, prereleases=True):
                return f"UNSUPPORTED (agl needs {req.specifier})"
        if self.tested != "newest" and self.installed != self.tested:
            return f"supported, untested (CI tests {self.tested})"
        return "ok"


def _installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def frameworks() -> list[FrameworkVersion]:
    """Every distribution each registered integration instruments, with its installed version."""
    from agl.instrumentation import available_instrumentors

    out: list[FrameworkVersion] = []
    for name, cls in sorted(available_instrumentors().items()):
        reqs = {Requirement(r).name.lower(): r for r in cls.instruments}
        dists = list(dict.fromkeys([*cls.distributions, *(Requirement(r).name for r in cls.instruments)]))
        for dist in dists:
            out.append(
                FrameworkVersion(
                    name,
                    dist,
                    _installed(dist),
                    TESTED.get(dist.lower(), "newest"),
                    reqs.get(dist.lower(), ""),
                )
            )
    return out


def _describe_processor(processor: Any) -> str:
    exporter = getattr(processor, "span_exporter", None) or getattr(processor, "exporter", None)
    text = type(processor).__name__
    if exporter is not None:
        text += f" -> {type(exporter).__module__}.{type(exporter).__name__}"
    return text


def _processors(provider: Any) -> list[Any]:
    active = getattr(provider, "_active_span_processor", None)
    return list(getattr(active, "_span_processors", ()) or ())


def _tracing_lines() -> list[str]:
    from opentelemetry import trace

    from agl.tracing import provider as tracing

    lines: list[str] = []
    agl_provider = tracing.get_tracer_provider()
    global_provider = trace.get_tracer_provider()
    which = "the global provider" if agl_provider is global_provider else "NOT the global provider"
    lines.append(
        f"  tracer provider: {type(agl_provider).__module__}.{type(agl_provider).__name__} ({which})"
    )
    processors = _processors(agl_provider)
    if not processors:
        lines.append(
            "  span processors: none — spans are made but go nowhere (setup_tracing(store) adds the store)"
        )
    for p in processors:
        lines.append(f"  span processor: {_describe_processor(p)}")
    stats = tracing.stats()
    lines.append("  store export: " + ", ".join(f"{k}={v}" for k, v in stats.items()))
    return lines


def report() -> str:
    """The doctor's report for this process, as text."""
    from agl.instrumentation import available_instrumentors, health, is_installed

    lines = [
        f"agl {__version__} (Python {platform.python_version()})",
        "",
        "Frameworks (installed / tested by CI):",
    ]
    for fw in frameworks():
        installed = fw.installed or "-"
        lines.append(
            f"  {fw.integration:<14} {fw.distribution:<20} {installed:<12} tested {fw.tested:<8} {fw.verdict}"
        )
    lines += ["", "Integrations:"]
    classes = available_instrumentors()
    for name, h in health().items():
        cls = classes[name]
        if h.instrumented:
            state = "instrumented, hooks in place" if h.ok else "instrumented, HOOKS LOST"
        elif h.waiting:
            state = "waiting for import (agl.instrument() instruments it when the application imports it)"
        elif is_installed(cls):
            state = "not instrumented (agl.instrument() would instrument it)"
        else:
            state = f"not installed (pip install 'agl[{cls.extra or name}]')"
        failures = sum(h.failures.values())
        lines.append(f"  {name:<14} {state}" + (f"; {failures} guarded failure(s)" if failures else ""))
        for problem in h.problems:
            lines.append(f"    ! {problem}")
        for site, count in sorted(h.failures.items()):
            lines.append(f"    ! {site} failed {count} time(s)")
    lines += ["", "Tracing:", *_tracing_lines()]
    return "\n".join(lines)
