"""``agl.instrument()``: find every installed integration and turn its framework's runs into spans.

Integrations are Instrumentor classes (built on OpenTelemetry's ``BaseInstrumentor``) that plugins
register through the ``agl_register_instrumentors`` hook (DESIGN §6). Built-in and third-party
integrations are discovered the same way, through the ``agl`` entry-point group.
"""

from __future__ import annotations

import logging
import sys
import threading
import types
from collections.abc import Collection, Mapping
from typing import Any, ClassVar

import pluggy
from opentelemetry.instrumentation.dependencies import get_dependency_conflicts
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.sdk.trace import TracerProvider

from agl.plugins import disabled_integrations, get_plugin_manager

__all__ = [
    "IntegrationNotFoundError",
    "Instrumentor",
    "MissingFrameworkError",
    "available_instrumentors",
    "instrument",
    "instrumented",
    "is_installed",
    "uninstrument",
]

logger = logging.getLogger(__name__)


class MissingFrameworkError(ImportError):
    """An integration was asked for by name but its framework is not installed."""


class IntegrationNotFoundError(ValueError):
    """No registered integration has that name."""


class Instrumentor(BaseInstrumentor):
    """Base of every agl integration.

    Subclasses set ``name`` (what ``agl.instrument("name")`` takes), ``extra`` (the pip extra that
    installs the framework: ``pip install 'agl[extra]'``) and ``instruments`` (requirement strings
    of the framework, the same as the extra's), and implement ``_instrument(**kwargs)`` — kwargs
    include ``tracer_provider`` — and ``_uninstrument(**kwargs)``. Import the framework inside
    ``_instrument``, never at module top, so the plugin loads without it.
    """

    name: ClassVar[str] = ""
    extra: ClassVar[str] = ""
    instruments: ClassVar[tuple[str, ...]] = ()

    _instance = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Instrumentor:
        # one instance per class; BaseInstrumentor's check would also see a parent class's instance
        instance = cls.__dict__.get("_instance")
        if instance is None:
            instance = object.__new__(cls)
            cls._instance = instance
        return instance

    def instrumentation_dependencies(self) -> Collection[str]:
        return self.instruments

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._instance = None


# ---------------------------------------------------------------------------------------- registry

_lock = threading.RLock()
_registry: tuple[pluggy.PluginManager, dict[str, type[Instrumentor]]] | None = None
_active: dict[type[Instrumentor], None] = {}  # instrumented classes, in order (survives a plugin reset)


def available_instrumentors() -> dict[str, type[Instrumentor]]:
    """Every registered Instrumentor class by name (plugins disabled by env are never loaded)."""
    global _registry
    pm = get_plugin_manager()
    with _lock:
        if _registry is not None and _registry[0] is pm:
            return dict(_registry[1])
        found: dict[str, type[Instrumentor]] = {}

        def register(cls: type[Instrumentor]) -> None:
            if not (isinstance(cls, type) and issubclass(cls, Instrumentor)):
                raise TypeError(f"register() takes an agl.instrument.Instrumentor subclass, got {cls!r}")
            if not cls.name:
                raise TypeError(f"{cls.__qualname__} must set a non-empty class attribute 'name'")
            other = found.get(cls.name)
            if other is not None and other is not cls:
                raise ValueError(
                    f"two integrations are named {cls.name!r}: {other.__module__}.{other.__qualname__} and "
                    f"{cls.__module__}.{cls.__qualname__}"
                )
            found[cls.name] = cls

        pm.hook.agl_register_instrumentors(register=register)
        _registry = (pm, found)
        return dict(found)


def is_installed(cls: type[Instrumentor]) -> bool:
    """Whether the framework the integration instruments is installed at a supported version."""
    return get_dependency_conflicts(list(cls.instruments)) is None


def instrumented() -> list[str]:
    """Names of the integrations that are instrumented now."""
    return sorted(name for name, cls in available_instrumentors().items() if _is_active(cls))


def _is_active(cls: type[Instrumentor]) -> bool:
    instance = cls.__dict__.get("_instance")
    return bool(instance is not None and instance.is_instrumented_by_opentelemetry)


def _select(names: tuple[str, ...]) -> tuple[dict[str, type[Instrumentor]], list[type[Instrumentor]]]:
    registry = available_instrumentors()
    disabled = disabled_integrations()
    if not names:
        return registry, [cls for name, cls in sorted(registry.items()) if name not in disabled]
    chosen: list[type[Instrumentor]] = []
    for name in dict.fromkeys(names):
        if not isinstance(name, str):
            raise TypeError(f"integration names are strings, got {name!r}")
        if name in disabled:
            raise IntegrationNotFoundError(f"integration {name!r} is disabled by AGL_DISABLED_INTEGRATIONS")
        cls = registry.get(name)
        if cls is None:
            known = ", ".join(sorted(registry)) or "none"
            raise IntegrationNotFoundError(f"no integration named {name!r}; known integrations: {known}")
        chosen.append(cls)
    return registry, chosen


def _missing_message(cls: type[Instrumentor]) -> str:
    conflict = get_dependency_conflicts(list(cls.instruments))
    extra = cls.extra or cls.name
    return (
        f"cannot instrument {cls.name!r}: {str(conflict).rstrip('.')}. Install it with: pip install 'agl[{extra}]'"
        if conflict is not None
        else f"cannot instrument {cls.name!r}: install it with pip install 'agl[{extra}]'"
    )


def instrument(
    *names: str,
    tracer_provider: TracerProvider | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[str]:
    """Instrument every integration whose framework is installed, or exactly the named ones.

    Returns the names now instrumented by this call (already-instrumented ones included). Naming an
    unknown integration raises ``IntegrationNotFoundError`` listing the known ones; naming one whose
    framework is missing raises ``MissingFrameworkError`` saying ``pip install 'agl[extra]'``. Both
    are raised before anything is instrumented. Idempotent: instrumenting twice patches once; giving
    another ``tracer_provider`` re-instruments with it. ``options`` passes keyword arguments to one
    integration's instrumentor, e.g. ``options={"openai_agents": {"replace_exporter": True}}``.
    """
    from agl.tracing import setup_tracing

    options = dict(options or {})
    with _lock:
        registry, chosen = _select(names)
        unknown = [name for name in options if name not in registry]
        if unknown:
            known = ", ".join(sorted(registry)) or "none"
            raise IntegrationNotFoundError(f"options for unknown integration {unknown[0]!r}; known: {known}")
        if names:
            missing = [cls for cls in chosen if not is_installed(cls)]
            if missing:
                raise MissingFrameworkError("; ".join(_missing_message(cls) for cls in missing))
        else:
            chosen = [cls for cls in chosen if is_installed(cls)]
        provider = setup_tracing(tracer_provider=tracer_provider)
        done: list[str] = []
        for cls in chosen:
            instance = cls()
            if instance.is_instrumented_by_opentelemetry:
                if getattr(instance, "_agl_tracer_provider", None) is provider and cls.name not in options:
                    done.append(cls.name)
                    continue
                instance.uninstrument()
            try:
                instance.instrument(
                    tracer_provider=provider, skip_dep_check=True, **options.get(cls.name, {})
                )
            except Exception:
                if names:
                    raise
                logger.exception("agl: instrumenting %r failed; continuing without it", cls.name)
                continue
            instance._agl_tracer_provider = provider  # type: ignore[attr-defined]
            _active[cls] = None
            done.append(cls.name)
        return done


def uninstrument(*names: str) -> list[str]:
    """Undo ``instrument``: every instrumented integration, or the named ones. Returns their names."""
    with _lock:
        registry = available_instrumentors()
        if names:
            unknown = [n for n in names if n not in registry]
            if unknown:
                known = ", ".join(sorted(registry)) or "none"
                raise IntegrationNotFoundError(
                    f"no integration named {unknown[0]!r}; known integrations: {known}"
                )
            chosen = [registry[n] for n in dict.fromkeys(names)]
        else:
            chosen = list(dict.fromkeys([*reversed(_active), *(cls for _, cls in sorted(registry.items()))]))
        done: list[str] = []
        for cls in chosen:
            _active.pop(cls, None)
            if _is_active(cls):
                instance = cls()
                instance.uninstrument()
                instance._agl_tracer_provider = None  # type: ignore[attr-defined]
                done.append(cls.name)
        return done


class _CallableModule(types.ModuleType):
    """``agl.instrument`` names both this module and its function: importing the submodule makes
    Python bind the module to ``agl.instrument``, so the module itself must behave as the function.
    """

    def __call__(self, *names: str, **kwargs: Any) -> list[str]:
        return instrument(*names, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
