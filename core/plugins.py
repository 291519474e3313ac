"""The plugin manager: the only global registry in agl (DESIGN §6).

Entry points of the ``agl`` group are loaded once, the first time anything asks for the manager.
``AGL_DISABLED_INTEGRATIONS`` (a comma-separated list of entry-point names) blocks plugins before they
are imported, e.g. ``AGL_DISABLED_INTEGRATIONS=crewai,autogen``.
"""

from __future__ import annotations

import os
import threading

import pluggy

from agl import hookspecs

__all__ = [
    "DISABLED_ENV",
    "disabled_integrations",
    "get_plugin_manager",
    "hookimpl",
    "reset_plugin_manager",
]

DISABLED_ENV = "AGL_DISABLED_INTEGRATIONS"
ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME

#: Decorate plugin functions with this: ``@hookimpl def agl_register_instrumentors(register): ...``
hookimpl = pluggy.HookimplMarker(hookspecs.PROJECT_NAME)

_lock = threading.Lock()
_pm: pluggy.PluginManager | None = None


def disabled_integrations() -> frozenset[str]:
    """Entry-point names listed in ``AGL_DISABLED_INTEGRATIONS`` (read at call time)."""
    raw = os.environ.get(DISABLED_ENV, "")
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with every ``agl`` entry point loaded (once)."""
    global _pm
    pm = _pm
    if pm is not None:
        return pm
    with _lock:
        if _pm is None:
            pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
            pm.add_hookspecs(hookspecs)
            for name in disabled_integrations():
                pm.set_blocked(name)
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
            pm.check_pending()
            _pm = pm
        return _pm


def reset_plugin_manager() -> None:
    """Forget the manager so the next call reloads entry points (tests; after installing a plugin).

    Instrumentations that are active stay active; call ``agl.uninstrument()`` first to undo them.
    """
    global _pm
    with _lock:
        _pm = None
