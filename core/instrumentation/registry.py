"""``agl.instrument()``: find every installed integration and turn its framework's runs into spans.

Only what the application uses is touched: ``agl.instrument()`` instruments an installed framework now
if the application has already imported it, and otherwise when it is imported (a ``wrapt`` post-import
hook), so the order of ``import crewai`` and ``agl.instrument()`` does not matter and a framework the
application never imports is never loaded (importing one costs seconds and may write files, e.g.
CrewAI's storage directory). ``agl doctor`` shows such an integration as "waiting for import".

Integrations are Instrumentor classes (built on OpenTelemetry's ``BaseInstrumentor``) that plugins
register through the ``agl_register_instrumentors`` hook (DESIGN §6). Built-in and third-party
integrations are discovered the same way, through the ``agl`` entry-point group. The plugin manager
holds the one instance of each registered class (``get_instrumentor(name)``); there is no other
registry and no per-class singleton.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from opentelemetry.instrumentation.dependencies import get_dependency_conflicts
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.sdk.trace import TracerProvider

from agl import plugins
from agl.errors import IntegrationNotFoundError, MissingFrameworkError
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
    "is_waiting",
    "uninstrument",
]

logger = logging.getLogger("agl.instrumentation")


@dataclass
class Health:
    """One integration's state: is it instrumented, and are its hooks still where it put them."""

    name: str
    instrumented: bool
    problems: list[str] = field(default_factory=list)  # hooks lost or replaced since instrument()
    failures: dict[str, int] = field(default_factory=dict)  # guarded hook failures per site
    waiting: bool = False  # agl.instrument() will instrument it when the application imports it

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
        return Health(self.name, on, problems, failures, waiting=is_waiting(self.name))


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
    """Instrument every integration whose framework the application uses, or exactly the named ones.

    With no names, an installed framework the application has already imported is instrumented now and
    one it has not is instrumented when it is imported (never imported on agl's behalf). Returns the
    names instrumented by this call (already-instrumented ones included; those waiting for their import
    are not). Naming an unknown integration raises ``IntegrationNotFoundError`` listing the known ones;
    naming one whose framework is missing raises ``MissingFrameworkError`` saying
    ``pip install 'agl[extra]'``. Both are raised before anything is instrumented. A named integration is
    instrumented now (its framework imported if need be). Idempotent: instrumenting twice patches once;
    giving another ``tracer_provider`` re-instruments with it. ``options`` passes keyword arguments to one
    integration's instrumentor, e.g. ``options={"openai_agents": {"replace_exporter": True}}``.
    """
    from agl.tracing.provider import setup_tracing

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
            opts = options.get(cls.name)
            if not names and not is_imported(cls):
                _wait_for_import(cls, provider, opts)
            elif _instrument_one(pm, cls, provider, opts, strict=bool(names)):
                done.append(cls.name)
        return done


def _instrument_one(
    pm: AglPluginManager,
    cls: type[Instrumentor],
    provider: TracerProvider,
    opts: Mapping[str, Any] | None,
    *,
    strict: bool,
) -> bool:
    """Instrument one integration (re-instrument on another provider or new options); True when done.
    ``strict`` raises the integration's failure; otherwise it is logged and the integration skipped."""
    _waiting.pop(cls.name, None)
    instance = _instance(pm, cls)
    if instance.is_instrumented_by_opentelemetry:
        if instance.tracer_provider is provider and opts is None:
            return True
        instance.uninstrument()
        pm.active.pop(cls, None)
    try:
        instance.instrument(tracer_provider=provider, skip_dep_check=True, **dict(opts or {}))
    except Exception:
        instance.ledger.unpatch_all()
        if strict:
            raise
        logger.exception("agl: instrumenting %r failed; continuing without it", cls.name)
        return False
    instance.tracer_provider = provider
    pm.active[cls] = None
    return True


# ------------------------------------------------------------------------------ post-import hooks

#: integration name -> (tracer provider, options): instrumented when its framework is imported
_waiting: dict[str, tuple[TracerProvider, Mapping[str, Any] | None]] = {}
#: module names with a post-import hook (wrapt keeps a hook for good; it reads _waiting when it fires)
_hooked: set[str] = set()
_modules_of_dist: dict[str, set[str]] | None = None


def _normalise(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def framework_modules(cls: type[Instrumentor]) -> set[str]:
    """The top-level modules of the framework ``cls`` instruments, from the installed distributions'
    metadata (``crewai`` -> ``crewai``, ``openai-agents`` -> ``agents``), read without importing them."""
    global _modules_of_dist
    if _modules_of_dist is None:
        from importlib.metadata import packages_distributions

        table: dict[str, set[str]] = {}
        for module, dists in packages_distributions().items():
            for dist in dists:
                table.setdefault(_normalise(dist), set()).add(module)
        _modules_of_dist = table
    dists = {re.split(r"[\s<>=!~;\[]", req.strip(), maxsplit=1)[0] for req in cls.instruments}
    return set().union(*(_modules_of_dist.get(_normalise(d), set()) for d in dists))


def is_imported(cls: type[Instrumentor]) -> bool:
    """Whether the application has imported the framework ``cls`` instruments (True when its modules
    cannot be told from the metadata: then it is instrumented at once, as before)."""
    modules = framework_modules(cls)
    return not modules or any(m in sys.modules for m in modules)


def is_waiting(name: str) -> bool:
    """Whether ``agl.instrument()`` will instrument integration ``name`` when its framework is imported."""
    return name in _waiting


def _wait_for_import(
    cls: type[Instrumentor], provider: TracerProvider, opts: Mapping[str, Any] | None
) -> None:
    import wrapt

    _waiting[cls.name] = (provider, opts)
    for module in sorted(framework_modules(cls)):
        if module not in _hooked:
            _hooked.add(module)
            wrapt.register_post_import_hook(_on_import, module)


def _on_import(module: Any) -> None:
    """wrapt's post-import hook: instrument the integrations waiting for ``module``. Never raises: a
    failure here must not break the application's import."""
    try:
        pm = get_plugin_manager()
        with plugins._lock:
            classes = _classes(pm)
            for name, (provider, opts) in list(_waiting.items()):
                cls = classes.get(name)
                if cls is not None and module.__name__ in framework_modules(cls):
                    _instrument_one(pm, cls, provider, opts, strict=False)
    except Exception:  # noqa: BLE001 - the application's import goes on without the integration
        logger.exception("agl: instrumenting on the import of %r failed", getattr(module, "__name__", module))


def uninstrument(*names: str) -> list[str]:
    """Undo ``instrument``: every instrumented integration, or the named ones (those waiting for their
    framework's import stop waiting). Returns the names that were instrumented."""
    pm = get_plugin_manager()
    with plugins._lock:
        registry = _classes(pm)
        for name in names or list(_waiting):
            _waiting.pop(name, None)
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


def lazy_instrumentors(*specs: str) -> tuple[Any, Any, list[str]]:
    """Register Instrumentor classes, named ``"package.module:ClassName"``, without importing them.

    Returns what an integration package's ``__init__`` binds, in one line::

        agl_register_instrumentors, __getattr__, __all__ = lazy_instrumentors("pkg.instrumentor:XInstr")

    i.e. its ``agl_register_instrumentors`` hook, a PEP 562 module ``__getattr__`` and its ``__all__``.
    The plugin manager loads the package through the ``agl`` entry-point group; the class's module (and
    with it the framework) is imported only when the hook runs or when someone reads the class's name
    from the package, so discovering integrations stays cheap.
    """
    if not specs:
        raise ValueError("lazy_instrumentors needs at least one 'module:ClassName'")
    classes: dict[str, str] = {}
    for spec in specs:
        module, _, name = spec.partition(":")
        if not module or not name.isidentifier():
            raise ValueError(f"expected 'module:ClassName', got {spec!r}")
        classes[name] = module

    def load(name: str) -> type[Instrumentor]:
        import importlib

        cls: type[Instrumentor] = getattr(importlib.import_module(classes[name]), name)
        return cls

    @plugins.hookimpl
    def agl_register_instrumentors(register: Any) -> None:
        for name in classes:
            register(load(name))

    def module_getattr(name: str) -> object:
        if name in classes:
            return load(name)
        raise AttributeError(name)

    return agl_register_instrumentors, module_getattr, [*classes, "agl_register_instrumentors"]
