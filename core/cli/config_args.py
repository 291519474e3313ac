"""Command-line flags generated from the fields of agl's typed configs (issue 34).

A command offers a config dataclass's fields (:class:`agl.config.LoopConfig`, ``RolloutSettings``,
``RunConfig``, :class:`agl.run.settings.Serving`, :class:`agl.SFT`, :class:`agl.APO`) as flags without
restating their types, defaults or help: :func:`add_config_arguments` reads them from the field
(:func:`agl.config.config_fields`) and :func:`config_from_args` turns the parsed flags back into the
dataclass. The library modules stay argparse-free; this is the one place that maps fields onto flags.

The mapping, which every ``agl`` command and example shares:

- a field ``name`` is the flag ``--name`` (underscores as dashes) with ``dest`` ``name``;
- its type is the field's scalar type (``int | None`` is ``int``; a ``Literal`` gives ``choices``;
  anything that is not a number is a string);
- a boolean field that defaults to False is the switch ``--name``; one that defaults to True is the
  switch ``--no-name`` (``dest`` ``no_name``) that turns it off; ``bool | None`` is ``--name`` /
  ``--no-name`` with None when neither is given;
- ``overrides[name]`` replaces any ``add_argument`` keyword (a command's own default or help) and
  may rename the flag with ``"flags": [...]`` (``dest`` follows the first long flag, as in argparse).

The embedded engine's flags (:class:`agl.engine.EngineSettings`) are one set, the same in every command
that serves with it (``agl train``, ``agl gateway serve``, the examples' ``train``):
:func:`add_engine_arguments` adds them and :func:`engine_from_args` reads them back.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from agl.config import ConfigField, config_fields
from agl.engine.settings import ENGINE_BACKEND, EngineSettings

__all__ = [
    "ENGINE_FLAGS",
    "add_config_arguments",
    "add_engine_arguments",
    "config_from_args",
    "engine_from_args",
    "scalar_type",
]

_NUMBERS = (int, float, bool)


def add_config_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, str]:
    """Add a flag for each field of config dataclass ``cls`` (those in ``only``, in that order, when
    given; else every field not in ``skip``) to ``parser`` (a parser or an argument group); returns
    ``{field name: dest}`` for :func:`config_from_args`. Unknown names in ``only``, ``skip`` or
    ``overrides`` raise a ValueError naming them, so a renamed field cannot silently drop a flag."""
    known = {f.name: f for f in config_fields(cls)}
    overrides = dict(overrides or {})
    skip = set(skip)
    names = list(only) if only is not None else [n for n in known if n not in skip]
    unknown = sorted((set(names) | skip | set(overrides)) - set(known))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {', '.join(unknown)}; it has {', '.join(known)}")
    dests: dict[str, str] = {}
    for name in names:
        flags, opts = _argument(known[name], dict(overrides.get(name, {})))
        dests[name] = parser.add_argument(*flags, **opts).dest
    return dests


def _argument(f: ConfigField, override: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The flags and ``add_argument`` keywords of field ``f``, with ``override`` applied last."""
    flag = "--" + f.name.replace("_", "-")
    opts: dict[str, Any] = {"default": f.default, "help": f.help or None}
    kind = scalar_type(f.type)
    if kind is bool and f.default is None:
        opts["action"] = argparse.BooleanOptionalAction
    elif kind is bool:
        if f.default is True:
            flag = "--no-" + f.name.replace("_", "-")
            opts["help"] = f"turn off: {f.help}" if f.help else None
        opts = {"action": "store_true", "help": opts["help"]}
    elif typing.get_origin(kind) is typing.Literal:
        opts["choices"] = list(typing.get_args(kind))
    elif kind in _NUMBERS:
        opts["type"] = kind
    flags = list(override.pop("flags", [flag]))
    opts.update(override)
    return flags, opts


def scalar_type(annotation: Any) -> Any:
    """``int`` from ``int``, ``int | None`` or ``Optional[int]``; other annotations as they are."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def config_from_args(
    cls: type, args: argparse.Namespace, dests: Mapping[str, str] | None = None, **values: Any
) -> Any:
    """``cls(...)`` from the flags :func:`add_config_arguments` added (``dests`` as it returned: only
    those fields; by default every field whose own ``dest``, ``name`` or ``no_name``, is in ``args``),
    then ``values`` (which win). A field with no flag keeps its default; a ``--no-name`` switch gives ``name=False``. The dataclass
    validates the result, so a bad value fails here with the dataclass's own message."""
    kwargs: dict[str, Any] = {}
    for f in config_fields(cls):
        dest = dests.get(f.name) if dests is not None else _own_dest(f, args)
        if dest is None or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        kwargs[f.name] = (not value) if scalar_type(f.type) is bool and f.default is True else value
    kwargs.update(values)
    return cls(**kwargs)


def _own_dest(f: ConfigField, args: argparse.Namespace) -> str | None:
    if scalar_type(f.type) is bool and f.default is True:
        return "no_" + f.name if hasattr(args, "no_" + f.name) else None
    return f.name if hasattr(args, f.name) else None


#: the engine's flags where one differs from its field's name: ``--engine-dtype`` (a train command's
#: ``--dtype`` would read as the trained policy's, which the engine's dtype is not)
ENGINE_FLAGS: dict[str, dict[str, Any]] = {"dtype": {"flags": ["--engine-dtype"], "metavar": "DTYPE"}}


def add_engine_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, only: Iterable[str] | None = None
) -> dict[str, str]:
    """The embedded engine's flags from :class:`~agl.engine.EngineSettings` (all, or those in ``only``),
    named alike in every command; returns ``{field: dest}`` for :func:`engine_from_args`."""
    names = list(only) if only is not None else None
    overrides = {k: v for k, v in ENGINE_FLAGS.items() if names is None or k in names}
    return add_config_arguments(parser, EngineSettings, only=names, overrides=overrides)


def engine_from_args(
    args: argparse.Namespace, dests: Mapping[str, str] | None = None, *, process_threads: bool = False
) -> EngineSettings:
    """The :class:`~agl.engine.EngineSettings` the flags of :func:`add_engine_arguments` give (``dests``
    as it returned; by default every engine flag found in ``args``, the others at their defaults),
    validated there: a bad value fails naming the field. ``process_threads``: the command sets torch's
    threads for its whole process itself (a train command: the trainer's and an in-process engine's),
    so ``--threads`` is honoured whatever the backend and stays out of the settings of a backend other
    than the embedded engine, which would refuse it."""
    if dests is None:
        dests = {}
        for f in config_fields(EngineSettings):
            flags, _ = _argument(f, dict(ENGINE_FLAGS.get(f.name, {})))
            dest = flags[0].removeprefix("--").replace("-", "_")
            if hasattr(args, dest):
                dests[f.name] = dest
    if process_threads and getattr(args, "backend", ENGINE_BACKEND) != ENGINE_BACKEND:
        dests = {k: v for k, v in dests.items() if k != "threads"}
    return config_from_args(EngineSettings, args, dests)
