"""``agl.instrument()``: find every installed integration and turn its framework's runs into spans.

Integrations are Instrumentor classes (built on OpenTelemetry's ``BaseInstrumentor``) that plugins
register through the ``agl_register_instrumentors`` hook (DESIGN §6). Built-in and third-party
integrations are discovered the same way, through the ``agl`` entry-point group. The plugin manager
holds the one instance of each registered class (``get_instrumentor(name)``); there is no other
registry and no per-class singleton.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from opentelemetry.instrumentation.dependencies import get_dependency_conflicts
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.sdk.trace import TracerProvider

from agl import plugins
from agl.instrumentation.toolkit import PatchLedger
from agl.plugins import AglPluginManager, disabled_integrations, get_plugin_manager

__all__ = [
    "Health",
    "IntegrationNotFoundError",
    "Instrumentor",
    "MissingFrameworkError",
    "available_instrumentors",
    "get_instrumentor",
    "health",
    "instrument",
    "instrumented",
    "is_installed",
    "is_instrumented",
    "uninstrument",
]

logger = logging.getLogger("agl.instrumentation")


class MissingFrameworkError(ImportError):
    """An integration was asked for by name but its framework is not installed."""


class IntegrationNotFoundError(ValueError):
    """No registered integration has that name."""


@dataclass
class Health:
    """One integration's state: is it instrumented, and are its hooks still where it put them."""

    name: str
    instrumented: bool
    problems: list[str] = field(default_factory=list)  # hooks lost or replaced since instrument()
    failures: dict[str, int] = field(default_factory=dict)  # guarded hook failures per site

    @property
    def ok(self) -> bool:
        return not self.problems


class Instrumentor(BaseInstrumentor):
    """Base of every agl integration.

    Subclasses set ``name`` (what ``agl.instrument("name")`` takes), ``extra`` (the pip extra that
    installs the framework: ``pip install 'agl[extra]'``), ``instruments`` (requirement strings of the
    framework, the same as the extra's) and ``distributions`` (the framework's distributions whose
    versions ``agl doctor`` shows), and implement ``_instrument(**kwargs)`` — kwargs include
    ``tracer_provider`` — and ``_uninstrument(**kwargs)``. Import the framework inside
    ``_instrument``, never at module top, so the plugin loads without it. Patches go through
    ``self.ledger`` (undone by the base class after ``_uninstrument``); an integration that hooks in
    another way overrides ``_problems()`` so ``health()`` can tell whether its hook is still in place.
    """

    name: ClassVar[str] = ""
    extra: ClassVar[str] = ""
    instruments: ClassVar[tuple[str, ...]] = ()
    distributions: ClassVar[tuple[str, ...]] = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> Instrumentor:
        # BaseInstrumentor makes one instance per class; agl's plugin manager owns the instances
        return object.__new__(cls)

    #: the tracer provider agl.instrument() last instrumented this integration with
    tracer_provider: Any = None

    @property
    def ledger(self) -> PatchLedger:
        """This integration's patches (made on first use, so subclasses need not call ``__init__``)."""
        ledger = self.__dict__.get("_agl_ledger")
        if ledger is None:
            ledger = self.__dict__["_agl_ledger"] = PatchLedger(self.name or type(self).__name__)
        return ledger

    def instrumentation_dependencies(self) -> Collection[str]:
        return self.instruments

    def uninstrument(self, **kwargs: Any) -> None:
        try:
            super().uninstrument(**kwargs)
        finally:
            self.ledger.unpatch_all()

    def _problems(self) -> list[str]:
        """What is wrong with this integration's hooks now (override to check a non-patch hook)."""
        return self.ledger.problems()

    def health(self) -> Health:
        """Whether this integration is instrumented and its hooks are still in place."""
        on = bool(self.is_instrumented_by_opentelemetry)
        problems = self._problems() if on else []
        failures = get_plugin_manager().failures.counts(f"{self.name}.")
        return Health(self.name, on, problems, failures)


# ---------------------------------------------------------------------------------------- registry


def _classes(pm: AglPluginManager) -> dict[str, type[Instrumentor]]:
    if pm.classes is not None:
        return pm.classes  # type: ignore[return-value]
    found: dict[str, type[Instrumentor]] = {}

    def register(cls: type[Instrumentor]) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Instrumentor)):
            raise TypeError(f"register() takes an agl.instrumentation.Instrumentor subclass, got {cls!r}")
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
    pm.classes = found
    return found


def available_instrumentors() -> dict[str, type[Instrumentor]]:
    """Every registered Instrumentor class by name (plugins disabled by env are never loaded)."""
    pm = get_plugin_manager()
    with plugins._lock:
        return dict(_classes(pm))


def _instance(pm: AglPluginManager, cls: type[Instrumentor]) -> Instrumentor:
    instance = pm.instances.get(cls)
    if instance is None:
        instance = pm.instances[cls] = cls()
    return instance  # type: ignore[no-any-return]


def get_instrumentor(name: str) -> Instrumentor:
    """The one instance of the integration named ``name`` (its state: handler, processor, ledger...)."""
    pm = get_plugin_manager()
    with plugins._lock:
        cls = _classes(pm).get(name)
        if cls is None:
            known = ", ".join(sorted(_classes(pm))) or "none"
            raise IntegrationNotFoundError(f"no integration named {name!r}; known integrations: {known}")
        return _instance(pm, cls)


def is_instrumented(name: str) -> bool:
    """Whether the integration named ``name`` is instrumented now (cheap: called on hot paths)."""
    pm = get_plugin_manager()
    for cls in pm.active:
        if cls.name == name:
            return True
    return False


def is_installed(cls: type[Instrumentor]) -> bool:
    """Whether the framework the integration instruments is installed at a supported version."""
    return get_dependency_conflicts(list(cls.instruments)) is None


def instrumented() -> list[str]:
    """Names of the integrations that are instrumented now."""
    pm = get_plugin_manager()
    return sorted(cls.name for cls in pm.active)


def health() -> dict[str, Health]:
    """Every registered integration's :class:`Health`, by name."""
    pm = get_plugin_manager()
    with plugins._lock:
        instances = {name: _instance(pm, cls) for name, cls in sorted(_classes(pm).items())}
    return {name: inst.health() for name, inst in instances.items()}


def _select(
    pm: AglPluginManager, names: tuple[str, ...]
) -> tuple[dict[str, type[Instrumentor]], list[type[Instrumentor]]]:
    registry = _classes(pm)
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
    pm = get_plugin_manager()
    with plugins._lock:
        registry, chosen = _select(pm, names)
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
            instance = _instance(pm, cls)
            if instance.is_instrumented_by_opentelemetry:
                if instance.tracer_provider is provider and cls.name not in options:
                    done.append(cls.name)
                    continue
                instance.uninstrument()
                pm.active.pop(cls, None)
            try:
                instance.instrument(
                    tracer_provider=provider, skip_dep_check=True, **options.get(cls.name, {})
                )
            except Exception:
                instance.ledger.unpatch_all()
                if names:
                    raise
                logger.exception("agl: instrumenting %r failed; continuing without it", cls.name)
                continue
            instance.tracer_provider = provider
            pm.active[cls] = None
            done.append(cls.name)
        return done


def uninstrument(*names: str) -> list[str]:
    """Undo ``instrument``: every instrumented integration, or the named ones. Returns their names."""
    pm = get_plugin_manager()
    with plugins._lock:
        registry = _classes(pm)
        if names:
            unknown = [n for n in names if n not in registry]
            if unknown:
                known = ", ".join(sorted(registry)) or "none"
                raise IntegrationNotFoundError(
                    f"no integration named {unknown[0]!r}; known integrations: {known}"
                )
            wanted = [registry[n] for n in dict.fromkeys(names)]
            chosen = [cls for cls in reversed(pm.active) if cls in wanted or cls.name in names]
        else:
            wanted = list(pm.instances)
            chosen = list(reversed(pm.active))
        chosen += [cls for cls in wanted if cls not in chosen]  # instrumented directly, not by agl.instrument
        done: list[str] = []
        for cls in chosen:
            pm.active.pop(cls, None)
            instance = pm.instances.get(cls)
            if instance is not None and instance.is_instrumented_by_opentelemetry:
                instance.uninstrument()
                instance.tracer_provider = None
                done.append(cls.name)
        return done
