"""The plugin contract (DESIGN §6): every hook a plugin may implement, typed and documented.

A plugin is any module registered under the ``agl`` entry-point group. Built-in integrations register
exactly the way a third-party ``agl-foo`` distribution does::

    # pyproject.toml of agl-foo
    [project.entry-points.agl]
    foo = "agl_foo"

    # agl_foo/__init__.py
    from agl.plugins import hookimpl

    @hookimpl
    def agl_register_instrumentors(register):
        register(FooInstrumentor)

Hooks are added only when a second implementer needs them; ``pm.check_pending()`` makes a misspelt
hook name fail loudly when plugins are loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from agl.types import Span

__all__ = ["PROJECT_NAME", "hookspec", "agl_register_instrumentors", "agl_intermediate_reward"]

PROJECT_NAME = "agl"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)


@hookspec
def agl_register_instrumentors(register: Callable[[type], None]) -> None:
    """Register this plugin's Instrumentor classes (subclasses of :class:`agl.Instrumentor`) by calling
    ``register(cls)`` once per class. (The contract names no type above the ground floor, so that
    ``hookspecs`` imports nothing of ``agl.instrumentation``.)

    Called once per plugin manager. Registering must not import the instrumented framework: the
    framework is imported only when ``agl.instrument()`` instruments it, so a plugin whose framework is
    missing still loads (and ``agl.instrument("name")`` then says which extra to install).
    """


@hookspec
def agl_intermediate_reward(span: Span, spans: Sequence[Span]) -> float | None:
    """An Automatic Intermediate Reward (AIR) rule: the reward ``span`` earns, or None if none applies.

    ``span`` is one span of an attempt and ``spans`` all spans of that attempt (for context: parents,
    siblings, the LLM call that preceded it). Every implementation is called; AIR adds the non-None
    results to the intermediate reward of the transition that caused ``span``. Return a finite float.
    """
