"""LoRA names (ground floor, any process): which LoRA an agent trains and is served by.

With an adapter per agent (``LoopConfig(adapter_per_agent=True)``, ``agl gateway serve --adapter
NAME=DIR``) each selected agent has a LoRA of its own on the shared base model. Its name is the agent's
name with every character peft cannot key a module by replaced by ``_`` (:func:`lora_name`). The
trainer, the gateway's backends, the span adapter, the CLI and the dashboard all take the rule from
here, so the name an agent is trained under is the name it is served by. The Trainer computes
``{agent: lora}`` once (:func:`selected_loras`) and hands the mapping on.

(The span→transition ``agl.Adapter`` is a different thing: in agl, "adapter" alone means it.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agl.errors import UsageError
from agl.semconv import BASE_ADAPTER

__all__ = [
    "BASE_ADAPTER",
    "PEFT_ROW_ADAPTERS",
    "check_lora_dirs",
    "lora_name",
    "lora_names",
    "lora_pattern",
    "selected_loras",
]

#: peft's forward keyword that picks each batch row's LoRA (mixed-adapter batches)
PEFT_ROW_ADAPTERS = "adapter_names"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_RESERVED = (BASE_ADAPTER, "default")


def lora_name(agent: str) -> str:
    """The LoRA an agent trains and is served by: its name with every character peft cannot key a module
    by (``.``, spaces, ``:``, ...) replaced by ``_``, after trimming the whitespace around it
    (:func:`agl.names.display_name`: ``"Content Planner\\n"`` is ``Content_Planner``, like the name
    people see)."""
    return _UNSAFE.sub("_", agent.strip())


def lora_names(agents: Any) -> dict[str, str]:
    """``{agent: LoRA name}`` for the selected agents, in order. Raises UsageError when there are no
    named agents, or when two agents would share one LoRA name (each needs weights of its own)."""
    if agents is None or isinstance(agents, str) or not isinstance(agents, Iterable):
        raise UsageError(
            "adapter_per_agent=True needs the agents to train by name, e.g. "
            f"Trainer(agents=['writer', 'rewriter'], loop=LoopConfig(adapter_per_agent=True)); got agents={agents!r}"
        )
    out: dict[str, str] = {}
    owner: dict[str, str] = {}
    for agent in agents:
        if not isinstance(agent, str) or not agent.strip():
            raise UsageError(f"agent names must be non-empty strings, got {agent!r}")
        name = lora_name(agent)
        if name in _RESERVED:
            raise UsageError(f"agent {agent!r} cannot have a LoRA: {name!r} is a reserved adapter name")
        if name in owner and owner[name] != agent.strip():
            raise UsageError(
                f"agents {owner[name]!r} and {agent!r} map to one LoRA name {name!r}: rename one"
            )
        owner[name] = agent.strip()
        out[agent] = name
    if not out:
        raise UsageError("adapter_per_agent=True needs at least one agent name in agents=")
    return out


def is_lora_name(name: str) -> bool:
    """Whether ``name`` is one an agent's LoRA can have (the rule's output, and not reserved)."""
    return isinstance(name, str) and bool(name) and lora_name(name) == name and name not in _RESERVED


def lora_pattern(name: str) -> re.Pattern[str]:
    """The agent names whose LoRA is ``name`` (:func:`lora_name`), as a regular expression: an agent
    selection for ``agl transitions --adapter`` and the dashboard (a ``_`` stands for itself or any
    character a LoRA name cannot hold). Raises UsageError for a name no LoRA can have."""
    if not isinstance(name, str) or not name or lora_name(name) != name:
        raise UsageError(
            f"{name!r} is not an adapter name: adapters are named after their agent with every character "
            "other than letters, digits, '_' and '-' replaced by '_'"
        )
    return re.compile("".join("[^A-Za-z0-9-]" if c == "_" else re.escape(c) for c in name))


def selected_loras(agents: Any, per_agent: bool, lora: bool) -> dict[str, str]:
    """The LoRA of each selected agent when each trains its own (checked before anything starts: named
    agents, distinct LoRA names, LoRA on); ``{}`` when the agents share one policy."""
    if not per_agent:
        return {}
    names = lora_names(agents)
    if not lora:
        raise UsageError("adapter_per_agent trains a LoRA adapter per agent: it needs lora=True")
    return names


def check_lora_dirs(loras: dict[str, str]) -> dict[str, str]:
    """``{LoRA name: folder}`` checked before anything loads: names an agent's LoRA can have, each folder
    a peft LoRA adapter, all of one rank and one set of target modules (a run's LoRAs share its LoRA
    config). Raises UsageError naming the offending LoRA."""
    names = lora_names(list(loras))
    first: tuple[str, Any] | None = None
    for agent, path in loras.items():
        if names[agent] != agent:
            raise UsageError(
                f"adapter name {agent!r} is not one an agent's adapter has; use {names[agent]!r}"
            )
        config = Path(path) / "adapter_config.json"
        if not config.is_file():
            raise UsageError(f"--adapter {agent}={path}: not a peft adapter folder (no adapter_config.json)")
        cfg = json.loads(config.read_text())
        targets = cfg.get("target_modules")
        shape = (cfg.get("r"), sorted(targets or []) if isinstance(targets, list) else targets)
        if first is None:
            first = (agent, shape)
        elif shape != first[1]:
            raise UsageError(
                f"adapter {agent!r} has rank/target modules {shape}, but {first[0]!r} has {first[1]}: "
                "every adapter of a run shares its LoRA config"
            )
    return dict(loras)
