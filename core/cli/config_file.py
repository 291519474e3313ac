"""``--config FILE`` and ``--print-config`` for the ``agl`` commands that train (``train``, ``sft``, ``apo``).

A config file holds the same settings as the command's flags, under the flags' names with underscores
(``tasks_per_step: 4`` for ``--tasks-per-step 4``), in YAML or TOML (by its suffix; YAML otherwise),
as one flat mapping. The flags are generated from the typed configs (:mod:`agl.cli.config_args`), so
the file's keys, their types and their help come from the same fields. What holds:

- **a flag overrides the file**: the file's values become the parser's defaults, then the command line
  is parsed as usual (TRL's ``--config`` works the same way);
- **an unknown key is refused by name**, with the closest known key and, in YAML, the line; a value
  of the wrong kind (text for a number, a choice not offered) is refused naming the key, before
  anything runs;
- a switch that turns a setting off (``--no-lora``) is the setting itself in the file
  (``lora: false``); ``no_lora: true`` is read too;
- **``--print-config``** writes every setting the command would run with (file, flags and defaults
  resolved) as YAML, each key under its help text, grouped as ``--help`` groups them; that text read
  back with ``--config`` gives the same settings (:func:`resolved_config` is what it writes, and
  ``agl train`` saves it into the run directory as ``config.yaml``).

Only the ``agl`` dispatcher (:func:`agl.cli.main`) calls :func:`apply_config_file`; a command opts in
with :func:`add_config_file_arguments`.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agl.errors import UsageError

__all__ = [
    "add_config_file_arguments",
    "apply_config_file",
    "format_config",
    "read_config_file",
    "resolved_config",
]

#: dests that are the command's machinery, never a setting
_NOT_SETTINGS = frozenset({"help", "config", "print_config", "func", "command"})


def add_config_file_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and ``--print-config`` (see the module docstring)."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="a YAML or TOML file of these settings (keys: the flags' names with underscores); "
        "flags on the command line override it",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print every resolved setting as YAML (with its help) and exit; runs again with --config",
    )


def _settings(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if a.dest not in _NOT_SETTINGS
        and a.default is not argparse.SUPPRESS
        and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
    ]


def _is_off_switch(action: argparse.Action) -> bool:
    """``--no-name`` (``store_true``, dest ``no_name``): the file calls it ``name`` with the value inverted."""
    return (
        isinstance(action, argparse._StoreTrueAction)
        and action.dest.startswith("no_")
        and any(o == "--" + action.dest.replace("_", "-") for o in action.option_strings)
    )


def _key(action: argparse.Action) -> str:
    return action.dest[3:] if _is_off_switch(action) else action.dest


def _keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every key a config file may use -> its action (``name`` and ``no_name`` for an off switch)."""
    keys: dict[str, argparse.Action] = {}
    for action in _settings(parser):
        keys[action.dest] = action
        keys[_key(action)] = action
    return keys


def read_config_file(path: str | Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The mapping a YAML or TOML config file holds, and each top-level key's line (YAML only)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--config {p}: no such file")
    text = p.read_text(encoding="utf-8")
    if p.suffix.lower() == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            import tomli as tomllib
        try:
            return tomllib.loads(text), {}
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"{p} is not TOML: {exc}") from None
    import yaml

    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise UsageError(f"{p} is not YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise UsageError(f"{p} must hold a mapping of settings (key: value), not a {type(data).__name__}")
    lines = {}
    if isinstance(node, yaml.MappingNode):
        lines = {str(k.value): k.start_mark.line + 1 for k, _ in node.value}
    return data, lines


def apply_config_file(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Path | None:
    """Make the settings of the ``--config`` file in ``argv`` (if any) ``parser``'s defaults, so flags
    still override them; returns the file's path. Refuses an unknown key or a value of the wrong
    kind with one line naming the file (and line) and the key."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(list(argv))
    if known.config is None:
        return None
    path = Path(known.config)
    data, lines = read_config_file(path)
    keys = _keys(parser)
    defaults: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        where = f"{path}:{lines[str(raw_key)]}" if str(raw_key) in lines else str(path)
        action = keys.get(key)
        if action is None:
            close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(keys))}"
            raise UsageError(f"{where}: unknown key {raw_key!r}{hint}")
        if _is_off_switch(action) and key != action.dest:
            value = _check_bool(where, key, value)
            value = not value
        defaults[action.dest] = _value(where, key, action, value)
        action.required = False  # given by the file: the flag itself is no longer needed
    parser.set_defaults(**defaults)
    return path


def _check_bool(where: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _value(where: str, key: str, action: argparse.Action, value: Any) -> Any:
    """``value`` checked (and converted) as the command line would have taken it for ``action``."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return _check_bool(where, key, value)
    if isinstance(action, argparse.BooleanOptionalAction):
        return value if value is None else _check_bool(where, key, value)
    if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return None if value is None else [_scalar(where, key, action, v) for v in items]
    if isinstance(value, (list, dict)):
        raise UsageError(f"{where}: {key} takes one value, got {value!r}")
    return value if value is None else _scalar(where, key, action, value)


def _scalar(where: str, key: str, action: argparse.Action, value: Any) -> Any:
    kind = action.type
    if kind in (int, float):
        ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
        if isinstance(value, str):  # a number written as text ("1e-3"): read it as the flag would
            try:
                value, ok = kind(value), True
            except ValueError:
                ok = False
        if not ok:
            noun = "an integer" if kind is int else "a number"
            raise UsageError(f"{where}: {key} must be {noun}, got {value!r}")
        value = kind(value)
    elif kind is not None and isinstance(value, str):
        value = kind(value)
    elif kind is None and not isinstance(value, str):
        if isinstance(value, (dict, list)):
            raise UsageError(f"{where}: {key} takes text, got {value!r}")
        value = str(value).lower() if isinstance(value, bool) else str(value)
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise UsageError(f"{where}: {key} must be one of {choices}, got {value!r}")
    return value


def _plain(value: Any) -> Any:
    """A value as YAML writes it: paths as text, tuples as lists."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def resolved_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """Every setting of ``parser`` as ``args`` resolved it, under the keys a config file uses."""
    out: dict[str, Any] = {}
    for action in _settings(parser):
        value = getattr(args, action.dest, action.default)
        out[_key(action)] = (not value) if _is_off_switch(action) else _plain(value)
    return out


def format_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, secrets: Sequence[str] = ()
) -> str:
    """:func:`resolved_config` as YAML: grouped as ``--help`` groups the flags, each key under its help
    text as a comment. Reading it back with ``--config`` gives the same settings. The keys in
    ``secrets`` are written as null when set (a file kept with a run must not hold an API key)."""
    import yaml

    values = resolved_config(parser, args)
    settings = {id(a) for a in _settings(parser)}
    lines = [f"# agl {parser.prog.split()[-1]}: resolved settings (run again with --config FILE)"]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if id(a) in settings]
        if not actions:
            continue
        lines += ["", f"# --- {group.title} ---"]
        for action in actions:
            key = _key(action)
            help_text = (action.help or "").replace("%%", "%")
            if _is_off_switch(action) and help_text.startswith("turn off: "):
                help_text = help_text[len("turn off: ") :]
            lines += [f"# {line}" for line in textwrap.wrap(help_text, 100)]
            value = values[key]
            if key in secrets and value is not None:
                lines.append("# (set, not written: a secret; give it by its environment variable)")
                value = None
            dumped = yaml.safe_dump({key: value}, default_flow_style=True, width=10_000)
            lines.append(dumped.strip()[1:-1])  # {key: value} -> key: value
    return "\n".join(lines) + "\n"
