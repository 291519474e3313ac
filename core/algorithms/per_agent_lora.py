"""An adapter per agent: one LoRA adapter for each selected agent, on one frozen base model (issue 35).

A multi-agent app (a SQL writer and a rewriter, a solver and a verifier) trains one shared policy by
default, so agents that need different behaviour pull one set of weights two ways. With
``adapter_per_agent`` the policy is one peft model holding a named LoRA adapter per selected agent
(peft's ``add_adapter``; the adapter is named after its agent, :func:`adapter_name`). What holds:

- the base weights are shared and frozen; each adapter's A/B matrices are its own parameters, in the
  one optimizer, so each has its own AdamW moments and step count (an adapter with no gradient in a
  step is skipped by the optimizer: its weights and moments stay as they were);
- a step groups the transitions by agent and runs the ordinary update (:class:`PolicyUpdate`'s
  plan, micro-batches, PPO-clip loss) once per adapter, with that adapter active (peft's
  ``set_adapter``), its gradient clipped on its own; learning rate, KL and clip settings are shared.
  The KL reference is the base model (adapters disabled), the same for every agent. Shared-prefix
  packing (:mod:`agl.algorithms.prefix_tree`) runs within each adapter's update, so a prefix is
  shared only among one adapter's sequences (another adapter's tokens run under other weights);
- an agent whose transitions all have zero advantage (and no KL term) trains nothing: its adapter is
  left bit-for-bit unchanged;
- checkpoints hold one folder per adapter (peft's layout for named adapters: ``<checkpoint>/<name>/``).

Agents that are not selected have no adapter: the gateway serves them with the base model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.errors import UsageError
from agl.lora import BASE_ADAPTER, check_lora_dirs, lora_name, lora_names, lora_pattern, selected_loras

if TYPE_CHECKING:
    from agl.algorithms.update import PolicyUpdate
    from agl.types import Transition

#: the LoRA naming rule's old names (it lives in :mod:`agl.lora`); kept for old call sites
adapter_name = lora_name
adapter_names = lora_names
adapter_pattern = lora_pattern
selected_adapters = selected_loras

__all__ = [
    "BASE_ADAPTER",
    "adapter_name",
    "adapter_names",
    "adapter_pattern",
    "selected_adapters",
    "warm_adapters_dir",
    "warm_adapters_folder",
    "agent_peft_model",
    "load_adapter_checkpoint",
    "step_per_adapter",
]

#: the metrics a per-adapter step reports per adapter, as ``<metric>/<adapter>``
PER_ADAPTER_METRICS = (
    "loss",
    "kl",
    "clip_fraction",
    "entropy",
    "grad_norm",
    "trained_transitions",
    "response_tokens",
    "behaviour_ratio_dev",
)
_SUM_METRICS = (
    "trained_transitions",
    "sequences",
    "skipped",
    "truncated_calls",
    "update_tokens",
    "tokens_flat",
    "tokens_packed",
    "response_tokens",
    "micro_batches",
    "update_s",
)
_MEAN_METRICS = ("loss", "kl", "clip_fraction", "entropy", "grad_norm")


def agent_peft_model(model: Any, lora_config: Any, names: Sequence[str]) -> Any:
    """``model`` wrapped by peft with one LoRA adapter per name (same config), every adapter trainable."""
    from peft import get_peft_model

    peft_model = get_peft_model(model, lora_config, adapter_name=names[0])
    for name in names[1:]:
        peft_model.add_adapter(name, lora_config)
    peft_model.set_requires_grad(list(names), True)
    return peft_model


def _group(
    transitions: Sequence[Transition], advantages: Sequence[float], agents: dict[str, str]
) -> dict[str, tuple[list[Transition], list[float]]]:
    """Each adapter's transitions and advantages (every adapter present, maybe empty). Transitions of
    agents without an adapter are left out."""
    groups: dict[str, tuple[list[Transition], list[float]]] = {name: ([], []) for name in agents.values()}
    for t, a in zip(transitions, advantages, strict=True):
        name = agents.get(t.agent or "")
        if name is not None:
            groups[name][0].append(t)
            groups[name][1].append(float(a))
    return groups


def step_per_adapter(
    policy: PolicyUpdate, transitions: Sequence[Transition], advantages: Sequence[float], merge: bool
) -> dict[str, float]:
    """One update of every adapter on its own agent's transitions (see the module docstring). Returns
    the step's totals (counts summed, losses averaged over the adapters that trained) and each
    adapter's metrics as ``<metric>/<adapter>``, plus ``unadapted`` (transitions of agents with no
    adapter, left out)."""
    model = policy.model
    names = list(policy.adapters.values())
    per: dict[str, dict[str, float]] = {}
    try:
        for name, (ts, adv) in _group(transitions, advantages, policy.adapters).items():
            model.set_adapter(name)  # marks only ``name`` trainable: the others get no gradient
            per[name] = policy._step_once(ts, adv, merge)
    finally:
        model.set_requires_grad(names, True)  # every adapter stays in the optimizer and the push
    out = _totals(per)
    out["unadapted"] = float(sum(1 for t in transitions if (t.agent or "") not in policy.adapters))
    for name, m in per.items():
        for key in PER_ADAPTER_METRICS:
            if key in m:
                out[f"{key}/{name}"] = m[key]
    return out


def _totals(per: dict[str, dict[str, float]]) -> dict[str, float]:
    """The step's metrics over all adapters: counts and times summed, loss-like metrics averaged over
    the adapters that trained, the largest behaviour-ratio deviation, the last learning rate."""
    trained = [m for m in per.values() if m.get("micro_batches", 0.0) > 0]
    out: dict[str, float] = {k: float(sum(m.get(k, 0.0) for m in per.values())) for k in _SUM_METRICS}
    for key in _MEAN_METRICS:
        out[key] = float(sum(m[key] for m in trained) / len(trained)) if trained else 0.0
    elapsed = out["update_s"]
    out["tokens_per_s"] = out["update_tokens"] / elapsed if elapsed > 0 else 0.0
    devs = [m["behaviour_ratio_dev"] for m in trained if "behaviour_ratio_dev" in m]
    finite = [d for d in devs if math.isfinite(d)]
    if devs:
        out["behaviour_ratio_dev"] = max(finite) if finite else devs[0]
    rates = [m["learning_rate"] for m in trained if "learning_rate" in m]
    if rates:
        out["learning_rate"] = rates[-1]
    return out


def load_adapter_checkpoint(policy: PolicyUpdate, path: str) -> None:
    """Load every adapter's weights from its folder of a checkpoint (``<path>/<adapter>/``); an adapter
    whose LoRA layers are not the run's (other target modules) is a UsageError."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    for name in policy.adapters.values():
        weights = os.path.join(path, name, "adapter_model.safetensors")
        if not os.path.isfile(weights):
            raise FileNotFoundError(f"{path} holds no adapter {name!r} ({weights} is missing)")
        device = policy.device
        state = load_file(weights, device="cpu" if device.type == "cpu" else str(device))
        result = set_peft_model_state_dict(policy.model, state, adapter_name=name)
        # peft loads leniently: an adapter of other target modules would leave layers at their start
        extra = [k for k in result.unexpected_keys if "lora_" in k]
        lacking = [k for k in result.missing_keys if "lora_" in k and f".{name}." in k]
        if extra or lacking:
            raise UsageError(
                f"adapter {name!r} in {path} has other target modules than the run's LoRA config: "
                + (f"{len(extra)} tensor(s) the run has no layer for (e.g. {extra[0]})" if extra else "")
                + ("; " if extra and lacking else "")
                + (f"{len(lacking)} of the run's tensor(s) missing (e.g. {lacking[0]})" if lacking else "")
            )


def warm_adapters_dir(path: str | os.PathLike[str]) -> Path:
    """The folder of per-agent adapters of an ``agl sft --adapter-per-agent`` run (``run_dir/adapters``)
    or ``path`` itself when it holds adapter folders; a clear error otherwise."""
    p = Path(path)
    for candidate in (p / "adapters", p):
        if candidate.is_dir() and any((d / "adapter_config.json").is_file() for d in candidate.iterdir()):
            return candidate
    raise FileNotFoundError(
        f"{p} holds no per-agent adapters (no adapters/<name>/adapter_config.json); run "
        "`agl sft ... --adapter-per-agent --out DIR` first"
    )


def warm_adapters_folder(path: Any, agent_loras: dict[str, str], lora_r: int) -> Path | None:
    """The folder of each agent's warm-start adapter (``agl sft --adapter-per-agent``), checked before
    anything starts: an adapter per agent is on, and every selected agent has a peft adapter there, of
    the run's LoRA rank (a mismatch would fail only when the policy loads, after the model)."""
    if path is None:
        return None
    if not agent_loras:
        raise UsageError("warm_adapters= starts each agent's adapter: it needs adapter_per_agent=True")
    try:
        folder = warm_adapters_dir(path)
    except FileNotFoundError as exc:
        raise UsageError(f"warm_adapters={os.fspath(path)!r}: {exc}") from None
    dirs = {name: str(folder / name) for name in agent_loras.values()}
    check_lora_dirs(dirs)
    rank = json.loads((folder / next(iter(dirs)) / "adapter_config.json").read_text()).get("r")
    if rank != lora_r:
        raise UsageError(
            f"the warm-start adapters in {folder} have LoRA rank {rank}, the run's lora_r is "
            f"{lora_r}: train with lora_r={rank} (or run agl sft with --lora-r {lora_r})"
        )
    return folder
