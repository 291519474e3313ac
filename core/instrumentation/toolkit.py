"""The toolkit every integration builds on: a patch ledger, JSON-safe attributes, a failure guard.

- :class:`PatchLedger` — ``wrap("module:Class.attr", wrapper)`` with a ``wrapt`` wrapper (or
  ``replace`` with any value), recorded so ``unpatch_all()`` restores exactly what was there.
  Idempotent (patching a target twice patches once) and safe against others: an attribute someone
  else re-patched since is left alone. ``problems()`` says which patches are no longer in place
  (``agl doctor`` shows them).
- :func:`safe_json` — the one encoder for span attributes: never raises, handles pydantic models,
  sets, bytes and anything else (as ``str``), optionally truncates.
- :class:`guarded` — ``with guarded("crewai.event"):`` or ``@guarded("langchain.handler")``: agl's own
  failure inside never reaches the application; the first failure of a site is logged, all are
  counted in the plugin manager (:func:`failure_counts`).

Use the framework's extension point first (callbacks, processors, event bus); patch only where there
is none (docs/architecture.md §6).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from agl.errors import PatchTargetError
from agl.plugins import get_plugin_manager

__all__ = ["PatchLedger", "PatchTargetError", "failure_counts", "guarded", "safe_json"]

logger = logging.getLogger("agl.instrumentation")

F = TypeVar("F", bound=Callable[..., Any])


# ------------------------------------------------------------------------------------ safe_json


def _default(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        try:
            return dump(mode="json", exclude_none=True)
        except Exception:  # noqa: BLE001 - a model that cannot dump itself: fall back to str
            pass
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


_ENCODER = json.JSONEncoder(default=_default, ensure_ascii=False, separators=(",", ":"))


def safe_json(value: Any, max_chars: int | None = None) -> str:
    """``value`` as a span attribute: strings as they are, anything else as compact JSON (pydantic
    models dumped, unknown objects as ``str``). Never raises. ``max_chars`` truncates with ``…``."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = _ENCODER.encode(value)
        except Exception:  # noqa: BLE001 - unencodable (cycles, a failing __str__...): plain text
            try:
                text = str(value)
            except Exception:  # noqa: BLE001
                text = f"<{type(value).__name__}>"
    if max_chars is not None and len(text) > max_chars:
        return text[:max_chars] + "…"
    return text


# --------------------------------------------------------------------------------------- guard


def failure_counts(prefix: str = "") -> dict[str, int]:
    """How often each guarded hook site failed in this process (sites starting with ``prefix``)."""
    return get_plugin_manager().failures.counts(prefix)


class guarded:  # noqa: N801 - used like a function: ``with guarded("site"):``
    """agl's failure at ``site`` never breaks the application's run: logged once, counted always.

    ``site`` names the hook, prefixed with the integration (``"openai_agents.on_span_start"``).
    As a decorator the wrapped function returns ``default`` when it fails. Only ``Exception`` is
    caught: ``KeyboardInterrupt``/``SystemExit``/cancellation pass through.
    """

    __slots__ = ("site", "default")

    def __init__(self, site: str, default: Any = None) -> None:
        self.site = site
        self.default = default

    def __enter__(self) -> guarded:
        return self

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        get_plugin_manager().failures.record(self.site, exc)
        return True

    def failed(self, exc: BaseException) -> None:
        """Record a failure caught by the caller itself."""
        get_plugin_manager().failures.record(self.site, exc)

    def __call__(self, fn: F) -> F:
        site, default = self.site, self.default

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the whole point
                get_plugin_manager().failures.record(site, exc)
                return default

        return wrapper  # type: ignore[return-value]


# -------------------------------------------------------------------------------------- ledger


@dataclass
class _Patch:
    owner: Any
    attr: str
    original: Any
    replacement: Any
    own: bool  # the attribute was in owner's own __dict__ (else inherited: undo deletes it)
    label: str

    def in_place(self) -> bool:
        return vars(self.owner).get(self.attr) is self.replacement

    def undo(self) -> None:
        if not self.in_place():  # someone re-patched it since: leave theirs
            logger.debug("agl: %s was re-patched by someone else; left as it is", self.label)
            return
        if self.own:
            setattr(self.owner, self.attr, self.original)
        else:
            delattr(self.owner, self.attr)


def _describe(owner: Any, attr: str) -> str:
    return f"{getattr(owner, '__module__', '')}.{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{attr}".lstrip(
        "."
    )


def resolve(path: str) -> tuple[Any, str]:
    """``"pkg.module:Class.attr"`` -> (``Class``, ``"attr"``); ``"pkg.module:func"`` -> (module, ``"func"``)."""
    module_name, sep, dotted = path.partition(":")
    if not sep or not dotted:
        raise ValueError(f"a patch path is 'module:attribute[.attribute...]', got {path!r}")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PatchTargetError(f"cannot import {module_name!r} for {path!r}: {exc}") from exc
    *parents, attr = dotted.split(".")
    for name in parents:
        try:
            owner = getattr(owner, name)
        except AttributeError:
            raise PatchTargetError(f"{path!r}: {name!r} not found") from None
    return owner, attr


class PatchLedger:
    """Every patch one integration made, so ``unpatch_all()`` puts everything back (in reverse)."""

    def __init__(self, integration: str) -> None:
        self.integration = integration
        self._patches: list[_Patch] = []
        self._lock = threading.RLock()

    # --------------------------------------------------------------------------- patching
    def wrap(self, target: str | tuple[Any, str], wrapper: Callable[..., Any], *, optional: str = "") -> bool:
        """Wrap ``target`` with ``wrapt.FunctionWrapper(original, wrapper)``.

        ``wrapper(wrapped, instance, args, kwargs)`` is wrapt's signature. ``target`` is a path
        (``"module:Class.attr"``) or ``(owner, "attr")``. Returns False if it was already patched by
        this ledger. A missing target raises :class:`PatchTargetError`, unless ``optional`` says what
        is lost without it: then that is logged as a warning and False returned.
        """
        import wrapt

        return self._patch(target, lambda original: wrapt.FunctionWrapper(original, wrapper), optional)

    def replace(
        self, target: str | tuple[Any, str], make: Callable[[Any], Any], *, optional: str = ""
    ) -> bool:
        """Replace ``target`` with ``make(original)`` (for module-level names a framework calls)."""
        return self._patch(target, make, optional)

    def _patch(self, target: str | tuple[Any, str], make: Callable[[Any], Any], optional: str) -> bool:
        try:
            owner, attr = resolve(target) if isinstance(target, str) else target
            own = attr in vars(owner)
            if own:
                original = vars(owner)[attr]
            elif inspect.isclass(owner):
                original = inspect.getattr_static(owner, attr)
            else:
                raise PatchTargetError(f"{_describe(owner, attr)} not found")
        except (PatchTargetError, AttributeError) as exc:
            if not optional:
                raise PatchTargetError(
                    f"agl: {self.integration}: cannot patch {target!r} ({exc}); this version of the "
                    "framework is not supported"
                ) from None
            logger.warning("agl: %s: %s not found (%s); %s", self.integration, target, exc, optional)
            return False
        with self._lock:
            if any(p.owner is owner and p.attr == attr and p.in_place() for p in self._patches):
                return False
            replacement = make(original)
            setattr(owner, attr, replacement)
            self._patches.append(_Patch(owner, attr, original, replacement, own, _describe(owner, attr)))
        return True

    def unpatch_all(self) -> None:
        """Restore every patch, newest first; attributes re-patched by someone else since stay theirs."""
        with self._lock:
            while self._patches:
                self._patches.pop().undo()

    # ---------------------------------------------------------------------------- queries
    @property
    def patches(self) -> list[tuple[Any, str]]:
        """(owner, attribute) of every patch in place or not, oldest first."""
        with self._lock:
            return [(p.owner, p.attr) for p in self._patches]

    def problems(self) -> list[str]:
        """Patches that are no longer agl's (someone replaced the attribute since): their hooks are lost."""
        with self._lock:
            return [f"{p.label} was replaced after agl patched it" for p in self._patches if not p.in_place()]

    def __len__(self) -> int:
        return len(self._patches)
