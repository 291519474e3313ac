"""The ``Trainer``'s keywords, each routed into the settings value it belongs to: one table (:data:`HOME`)
keeps every keyword of today's ``Trainer(...)`` working while the numbers live in typed values
(:class:`agl.run.Serving`, :class:`agl.config.LoopConfig`, :class:`agl.config.RolloutSettings`,
:class:`agl.config.RunConfig`); an unknown keyword is refused by name."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from agl.config import LoopConfig
from agl.run.settings import Serving

__all__ = ["HOME", "merged", "route_keywords"]

#: where each of ``Trainer``'s keywords goes: (the settings value, its field). ``sampling`` and
#: ``update_options`` are merged into the RunConfig by ``RunConfig.resolve``.
HOME: dict[str, tuple[str, str]] = {
    **{f.name: ("serving", f.name) for f in dataclasses.fields(Serving) if f.name != "model"},
    **{f.name: ("loop", f.name) for f in dataclasses.fields(LoopConfig)},
    "rollout_timeout_s": ("rollout", "timeout_s"),
    "lease_s": ("rollout", "lease_s"),
    "max_attempts": ("rollout", "max_attempts"),
    "infra_retries": ("rollout", "infra_retries"),
    "sampling": ("config", "sampling"),
    "update_options": ("config", "update"),
}


def route_keywords(keywords: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Today's ``Trainer`` keywords, sorted into the settings value each belongs to (:data:`HOME`);
    an unknown one is refused by name, with the closest known name."""
    parts: dict[str, dict[str, Any]] = {"serving": {}, "loop": {}, "rollout": {}, "config": {}}
    for name, value in keywords.items():
        home = HOME.get(name)
        if home is None:
            close = difflib.get_close_matches(name, list(HOME), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"Trainer() got an unexpected keyword argument {name!r}{hint}")
        parts[home[0]][home[1]] = value
    return parts


def merged(cls: type, value: Any, overrides: dict[str, Any]) -> Any:
    """``value`` (an instance of ``cls``, or None for the defaults) with ``overrides`` applied."""
    if value is None:
        return cls(**overrides)
    if not isinstance(value, cls):
        raise TypeError(f"expected an {cls.__module__}.{cls.__name__}, got {type(value).__name__}")
    return dataclasses.replace(value, **overrides) if overrides else value
