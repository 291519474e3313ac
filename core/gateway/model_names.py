"""Which backend (and adapter) serves a request's model name, and what ``/v1/models`` lists.

Programs nobody wrote for agl hard-code their model names: ``gpt-4o`` in LangGraph's quickstarts,
``gpt-4.1`` in AutoGen's README, CrewAI's default ``gpt-4.1-mini``, the Agents SDK's default model, and
AutoGen's documented SelectorGroupChat uses two at once (agents on ``gpt-4o``, the selector on
``gpt-4o-mini``). So by default the gateway serves **the policy under any model name** a program asks
for, matched case-insensitively (the Agents SDK lowercases its ``OPENAI_DEFAULT_MODEL``):

1. a name mapped with ``serve`` (``agl gateway serve --serve NAME=TARGET``) goes to its target: another
   backend (a second base model), one of the policy's named LoRA adapters, or the base model;
2. a name a backend serves itself (``backend.models()``, ``"<base>:<adapter>"`` included) goes to it;
   ``"<any name>:<adapter>"`` picks one of the policy's adapters;
3. any other name goes to the policy (under the policy's own name), unless ``only`` is set (strict
   mode, ``--only-model-names``): then only the names above and ``names`` (``--model-name``) are served
   and any other is a 404 naming the ones that are.

The backend is always asked for the name it knows; the span records the name the program asked for
(``gen_ai.request.model``) and the one that served (``gen_ai.response.model``), and replies name the
model as the program asked for it. ``/v1/models`` lists the configured names, then every other name
served so far (at most :data:`MAX_SEEN`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agl.errors import UsageError
from agl.gateway.backends.base import Backend, UnknownModelError

__all__ = ["BASE_TARGET", "MAX_SEEN", "POLICY_TARGET", "ModelNames", "Served"]

#: ``--serve NAME=policy``: the policy, as any unmapped name gets it (for strict mode)
POLICY_TARGET = "policy"
#: ``--serve NAME=base``: the base model without any agent's adapter
BASE_TARGET = "base"
#: names served but not configured that ``/v1/models`` remembers (a client cannot grow it without bound)
MAX_SEEN = 256
_KEEP = object()  # the adapter routing (baggage / "<base>:<adapter>") decides


@dataclass(frozen=True)
class Served:
    """Who serves one model name: ``backend`` under ``model`` (None: the name as asked, for a pass-through
    backend without names of its own), with ``adapter`` forced (None: the base model) unless it is
    left to the usual routing."""

    backend: Backend
    model: str | None
    adapter: Any = _KEEP

    @property
    def forces_adapter(self) -> bool:
        return self.adapter is not _KEEP


class ModelNames:
    """The gateway's model-name rules (module docstring) for ``policy`` and the ``serve`` map.

    ``serve`` maps a model name to a :class:`Backend` (a second model, served as it is: weight swaps
    go to the policy only) or to a string: ``"policy"``, ``"base"`` or the name of one of the policy's
    adapters (checked by :meth:`check` once the backends have started and know their adapters).
    """

    def __init__(
        self,
        policy: Backend,
        *,
        names: Iterable[str] = (),
        serve: Mapping[str, Backend | str] | None = None,
        only: bool = False,
    ) -> None:
        self.policy = policy
        self.only = bool(only)
        self.names = _checked_names(names, "model name")
        self.serve: dict[str, Backend | str] = {}
        for name, target in (serve or {}).items():
            (key,) = _checked_names([name], "--serve name")
            if key.casefold() in {k.casefold() for k in self.serve}:
                raise UsageError(f"--serve {name} is given twice")
            if not isinstance(target, (Backend, str)) or (isinstance(target, str) and not target.strip()):
                raise UsageError(
                    f"--serve {name}=...: the target must be a backend or a name, got {target!r}"
                )
            self.serve[key] = target.strip() if isinstance(target, str) else target
        self._serve_keys = {k.casefold(): k for k in self.serve}
        self._aliases = {n.casefold() for n in self.names}
        self._seen: dict[str, str] = {}  # casefolded -> as first asked

    # ------------------------------------------------------------------------------ backends
    @property
    def backends(self) -> list[Backend]:
        """The policy, then every other backend a name is served by (each once)."""
        out = [self.policy]
        for target in self.serve.values():
            if isinstance(target, Backend) and all(target is not b for b in out):
                out.append(target)
        return out

    def check(self) -> None:
        """Refuse a ``serve`` target that names no adapter of the policy (run once the policy started:
        the transformers backend knows its adapters only after loading)."""
        adapters = self.policy.agent_loras()
        for name, target in self.serve.items():
            if isinstance(target, Backend) or target in (POLICY_TARGET, BASE_TARGET):
                continue
            if target not in adapters:
                known = ", ".join(adapters) or "none (serve adapters with --adapter NAME=DIR)"
                raise UsageError(
                    f"--serve {name}={target}: {target!r} is not one of the policy's adapters ({known}), nor "
                    f"'{POLICY_TARGET}', '{BASE_TARGET}', a checkpoint directory, a script or a URL"
                )

    # ---------------------------------------------------------------------------- resolving
    def resolve(self, requested: str) -> Served:
        """Who serves ``requested`` (raises UnknownModelError in strict mode for a name not served)."""
        key = requested.casefold()
        mapped = self._serve_keys.get(key)
        if mapped is not None:
            return self._target(self.serve[mapped])
        for backend in self.backends:
            for name in backend.models():
                if name.casefold() == key:
                    return Served(backend, name)
        adapter = self._adapter_suffix(requested)
        if adapter is not None:
            return Served(self.policy, f"{self._policy_name() or requested}:{adapter}")
        if self.only and key not in self._aliases:
            try:
                self.policy.check_model(requested)  # a pass-through backend may still take it
            except UnknownModelError:
                raise self.unknown(requested) from None
            return Served(self.policy, requested)
        if key not in self._aliases and key not in self._seen and len(self._seen) < MAX_SEEN:
            self._seen[key] = requested
        return Served(self.policy, self._policy_name() or requested)

    def unknown(self, requested: str) -> UnknownModelError:
        return UnknownModelError(requested, self.configured())

    def _target(self, target: Backend | str) -> Served:
        if isinstance(target, Backend):
            models = target.models()
            return Served(target, models[0] if models else None, _KEEP)
        name = self._policy_name()
        if target == POLICY_TARGET:
            return Served(self.policy, name)
        if target == BASE_TARGET:
            return Served(self.policy, name, None)
        return Served(self.policy, name, target)  # an adapter of the policy

    def _adapter_suffix(self, requested: str) -> str | None:
        base, sep, suffix = requested.rpartition(":")
        if not sep or not base:
            return None
        folded = suffix.casefold()
        return next((a for a in self.policy.agent_loras() if a.casefold() == folded), None)

    def _policy_name(self) -> str | None:
        models = self.policy.models()
        return models[0] if models else None

    # ------------------------------------------------------------------------------- listing
    def configured(self) -> list[str]:
        """The names served by configuration: the backends' own, ``names``, the ``serve`` names."""
        out: list[str] = []
        for backend in self.backends:
            out.extend(backend.models())
        out.extend(self.names)
        out.extend(self.serve)
        return _unique(out)

    def listed(self) -> list[str]:
        """What ``/v1/models`` lists: the configured names, then the other names served so far."""
        return _unique([*self.configured(), *self._seen.values()])

    def describe(self) -> dict[str, Any]:
        """For ``/agl/v1/status``: the rules in force."""
        serve = {
            name: f"{t.name} backend ({', '.join(t.models()) or 'names as asked'})"
            if isinstance(t, Backend)
            else t
            for name, t in self.serve.items()
        }
        return {"any_name": not self.only, "names": list(self.names), "serve": serve}


def _checked_names(names: Iterable[str], what: str) -> list[str]:
    out: list[str] = []
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise UsageError(f"a {what} must be a non-empty string, got {name!r}")
        out.append(name.strip())
    return out


def _unique(names: Sequence[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for name in names:
        if name.casefold() not in seen:
            seen.add(name.casefold())
            out.append(name)
    return out
