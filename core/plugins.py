"""The plugin manager: the only global registry in agl (DESIGN §6).

Entry points of the ``agl`` group are loaded once, the first time anything asks for the manager.
``AGL_DISABLED_INTEGRATIONS`` (a comma-separated list of entry-point names) blocks plugins before they
are imported, e.g. ``AGL_DISABLED_INTEGRATIONS=crewai,autogen``.

The manager also holds the little process state instrumentation needs, so there is no other global:
the one Instrumentor instance per registered class, which of them are instrumented, and how often
each integration's hooks failed (:class:`Failures`, fed by ``agl.instrumentation.guarded``).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import pluggy

from agl import hookspecs

__all__ = [
    "DISABLED_ENV",
    "AglPluginManager",
    "Failures",
    "disabled_integrations",
    "get_plugin_manager",
    "hookimpl",
    "reset_plugin_manager",
]

logger = logging.getLogger("agl.instrumentation")

DISABLED_ENV = "AGL_DISABLED_INTEGRATIONS"
ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME

#: Decorate plugin functions with this: ``@hookimpl def agl_register_instrumentors(register): ...``
hookimpl = pluggy.HookimplMarker(hookspecs.PROJECT_NAME)

_lock = threading.RLock()  # re-entrant: a post-import hook may fire while agl.instrument() holds it
_pm: AglPluginManager | None = None


class Failures:
    """How often each hook site failed. The first failure of a site is logged (with its traceback),
    later ones only counted: a broken hook on a hot path must neither flood the log nor stay silent.
    """

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, site: str, exc: BaseException) -> int:
        """Count one failure of ``site``; log it if it is the first. Returns the site's count."""
        with self._lock:
            count = self._counts.get(site, 0) + 1
            self._counts[site] = count
        if count == 1:
            logger.warning(
                "agl: %s failed (%r); the application's run goes on, later failures there are only "
                "counted (agl doctor / agl.instrumentation.failure_counts())",
                site,
                exc,
                exc_info=exc,
            )
        return count

    def counts(self, prefix: str = "") -> dict[str, int]:
        """Failures per site (sites starting with ``prefix``, e.g. ``"crewai."``)."""
        with self._lock:
            return {site: n for site, n in self._counts.items() if site.startswith(prefix)}


class AglPluginManager(pluggy.PluginManager):
    """pluggy's manager plus agl's per-process instrumentation state (see the module docstring)."""

    def __init__(self, previous: AglPluginManager | None = None) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.loaded = False
        #: Instrumentor class -> its one instance (built by ``agl.instrumentation``)
        self.instances: dict[type, Any] = {}
        #: name -> Instrumentor class, from ``agl_register_instrumentors`` (None until first asked)
        self.classes: dict[str, type] | None = None
        #: instrumented classes, in the order they were instrumented
        self.active: dict[type, None] = {}
        self.failures = Failures()
        if previous is not None:  # instrumentations outlive a reset: uninstrument() still finds them
            self.active = dict(previous.active)
            self.instances = {
                cls: previous.instances[cls] for cls in self.active if cls in previous.instances
            }
            self.failures = previous.failures


def disabled_integrations() -> frozenset[str]:
    """Entry-point names listed in ``AGL_DISABLED_INTEGRATIONS`` (read at call time)."""
    raw = os.environ.get(DISABLED_ENV, "")
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


def get_plugin_manager() -> AglPluginManager:
    """The process-wide plugin manager, with every ``agl`` entry point loaded (once)."""
    pm = _pm
    if pm is not None and pm.loaded:
        return pm
    return _load()


def _load() -> AglPluginManager:
    global _pm
    with _lock:
        if _pm is None or not _pm.loaded:
            pm = AglPluginManager(_pm)
            pm.add_hookspecs(hookspecs)
            for name in disabled_integrations():
                pm.set_blocked(name)
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
            pm.check_pending()
            pm.loaded = True
            _pm = pm
        return _pm


def reset_plugin_manager() -> None:
    """Forget the loaded plugins so the next call reloads entry points (tests; after installing a plugin).

    Instrumentations that are active stay active, and ``agl.uninstrument()`` still undoes them.
    """
    global _pm
    with _lock:
        if _pm is not None:
            previous, _pm = _pm, AglPluginManager(_pm)  # not loaded: the next get loads entry points
            _pm.loaded = False
            del previous
