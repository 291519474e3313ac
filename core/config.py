"""The run configuration: one typed place for how a training run samples and updates (DESIGN §8-9).

Every number that two parts of a run must agree on lives here, with its default, once:

- **sampling** (``temperature``, ``top_p``, ``max_tokens``): what the trainer publishes in the rollouts'
  resources (``LLM.sampling``), what the in-process gateway samples with when a request leaves them
  out, and — ``temperature`` — what :class:`~agl.algorithms.update.PolicyUpdate` divides the logits by
  when it computes the PPO ratio. The ratio is only a ratio of the *same* policy if both sides use the
  same temperature; keeping it in one field is how agl makes that so.
- **update** (clipping, KL, learning rate, LoRA, micro-batching, gradient checkpointing, precision).

:class:`~agl.algorithms.lightning_rl.LightningRL` inherits the update fields from :class:`UpdateSettings`
(so ``LightningRL(learning_rate=...)`` keeps working and shares these defaults); the trainer resolves
``RunConfig.resolve(algorithm, sampling=..., update=...)`` once and hands the result to the gateway, the
runner's resources and the policy update.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Literal, NamedTuple, get_type_hints

from agl.errors import UsageError

__all__ = [
    "LoopConfig",
    "RolloutSettings",
    "RunConfig",
    "UpdateSettings",
    "check_number",
    "config_fields",
]


def check_number(
    owner: str,
    name: str,
    value: Any,
    *,
    lo: float,
    hi: float | None = None,
    lo_open: bool = False,
) -> None:
    """Raise a ValueError naming ``owner.name`` unless ``value`` is a finite number within the bounds."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (hi is None or value <= hi)
    if not ok:
        bound = f"{'>' if lo_open else '>='} {lo}" + (f" and <= {hi}" if hi is not None else "")
        raise UsageError(f"{owner}.{name} must be a finite number {bound}, got {value!r}")


def _check_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{owner}.{name} must be an integer >= 1, got {value!r}")


def _check_bool(owner: str, name: str, value: Any, *, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        allowed = "True, False or None" if optional else "True or False"
        raise UsageError(f"{owner}.{name} must be {allowed}, got {value!r}")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class UpdateSettings:
    """The token-level PPO-clip update's settings (the defaults every part of agl uses).

    ``gradient_checkpointing``: None picks per device (on: it cuts activation memory several-fold for a
    few tens of percent more compute). ``mixed_precision``: None is bf16 on a GPU that has it, else off.
    ``micro_batch_tokens``: None is 4096 on CPU and, on a GPU, the largest power of two up to 65536 whose
    estimated activations and logits fit in half the free GPU memory: a small model on a GPU is bound
    by kernel launches, so one big micro-batch beats several small ones (figures: bench/README.md,
    "Trainer: LightningRL update vs TRL's GRPOTrainer").
    """

    clip_eps: float = field(default=0.2, metadata=_help("PPO clip range of the probability ratio"))
    clip_eps_high: float | None = field(
        default=None, metadata=_help("upper clip range (DAPO's clip-higher; None: clip_eps)")
    )
    kl_coef: float = field(default=0.0, metadata=_help("KL penalty to the starting policy (0: none)"))
    learning_rate: float = field(default=1e-5, metadata=_help("the policy update's learning rate"))
    lora: bool = field(default=True, metadata=_help("train a LoRA adapter (False: full fine-tuning)"))
    lora_r: int = field(default=16, metadata=_help("LoRA rank"))
    lora_alpha: int = field(default=32, metadata=_help("LoRA alpha"))
    micro_batch_tokens: int | None = field(
        default=None,
        metadata=_help("tokens per forward/backward pass (None: 4096 on CPU, sized to free memory on a GPU)"),
    )
    epochs_per_step: int = field(default=1, metadata=_help("passes over a step's transitions"))
    max_grad_norm: float = field(default=1.0, metadata=_help("gradient clipping norm"))
    gradient_checkpointing: bool | None = field(
        default=None, metadata=_help("activation checkpointing in the update (None: per device)")
    )
    mixed_precision: str | None = field(
        default=None, metadata=_help("'no', 'bf16' or 'fp16' (None: bf16 on a GPU that has it, else off)")
    )
    #: train on one merged sequence per agent conversation where turns extend exactly (agl.adapter.trajectories);
    #: False trains every LLM call as its own sequence (the per-call form, for comparison)
    merge_turns: bool = field(
        default=True,
        metadata=_help("one merged sequence per agent conversation where turns extend exactly"),
    )
    #: run the sequences of a step that share a token prefix (a group's prompt, a conversation's earlier
    #: turns) through the model once, as a tree with a custom attention mask: the same log-probs, loss and
    #: gradients on fewer tokens (agl.algorithms.prefix_tree); a model whose attention cannot take the
    #: mask packs unshared, said once in the log. False: every sequence runs whole
    share_prefixes: bool = field(
        default=True,
        metadata=_help("run a step's shared token prefixes through the model once (same loss, fewer tokens)"),
    )
    #: leave calls the engine cut at ``max_tokens`` out of the loss (DAPO's overlong filtering): an
    #: unfinished answer scores 0 whatever it was on its way to, so its negative advantage would push
    #: down every token it holds, e.g. a long query's JOIN, not just the rambling. They still count in
    #: their group's reward statistics.
    mask_truncated: bool = field(
        default=False,
        metadata=_help("leave calls cut at max_tokens out of the loss (DAPO's overlong filtering)"),
    )

    #: what each weighs in the loss: "token" (every trained response token the same: today's token
    #: mean), "transition" (each trained call's tokens together the same) or "rollout" (each rollout's
    #: calls together the same however many calls or tokens it made: slime's per-rollout mean), as a
    #: per-token weight on the policy term (agl.algorithms.balance)
    loss_balance: str = field(
        default="token",
        metadata=_help(
            "what weighs the same in the loss: each token, each call ('transition') or each rollout"
        ),
    )

    def _validate_update(self, owner: str) -> None:
        if self.loss_balance not in ("token", "transition", "rollout"):
            raise UsageError(
                f"{owner}.loss_balance must be 'token', 'transition' or 'rollout', got {self.loss_balance!r}"
            )
        check_number(owner, "clip_eps", self.clip_eps, lo=0.0, lo_open=True)
        if self.clip_eps_high is not None:
            check_number(owner, "clip_eps_high", self.clip_eps_high, lo=0.0, lo_open=True)
        check_number(owner, "kl_coef", self.kl_coef, lo=0.0)
        check_number(owner, "learning_rate", self.learning_rate, lo=0.0, lo_open=True)
        check_number(owner, "max_grad_norm", self.max_grad_norm, lo=0.0, lo_open=True)
        for name in ("lora_r", "lora_alpha", "epochs_per_step"):
            _check_int(owner, name, getattr(self, name))
        if self.micro_batch_tokens is not None:
            _check_int(owner, "micro_batch_tokens", self.micro_batch_tokens)
        _check_bool(owner, "lora", self.lora)
        _check_bool(owner, "merge_turns", self.merge_turns)
        _check_bool(owner, "share_prefixes", self.share_prefixes)
        _check_bool(owner, "mask_truncated", self.mask_truncated)
        _check_bool(owner, "gradient_checkpointing", self.gradient_checkpointing, optional=True)
        if self.mixed_precision not in (None, "no", "bf16", "fp16"):
            raise UsageError(
                f"{owner}.mixed_precision must be None, 'no', 'bf16' or 'fp16', got {self.mixed_precision!r}"
            )

    def update_settings(self) -> dict[str, Any]:
        """Just the update fields, as keyword arguments for another ``UpdateSettings`` subclass."""
        return {f.name: getattr(self, f.name) for f in fields(UpdateSettings)}


#: names of the sampling fields, in the order the resources show them
SAMPLING_FIELDS = ("temperature", "top_p", "max_tokens")


@dataclass
class RunConfig(UpdateSettings):
    """How a run samples and updates: the one source of these defaults.

    Any ``temperature >= 0`` and ``top_p`` in (0, 1] is a valid configuration (``Trainer.dev`` may
    decode greedily), but training refuses two of them (:meth:`check_trainable`): ``temperature=0``
    (greedy decoding has no sampled distribution to learn from, and the ratio divides by it) and
    ``top_p < 1`` (the engine would sample from a truncated distribution while the update's ratio uses
    the full one, biasing every token's ratio low).
    """

    temperature: float = field(
        default=1.0, metadata=_help("sampling temperature, published to the agents and used by the update")
    )
    top_p: float = field(default=1.0, metadata=_help("nucleus sampling (training needs 1.0)"))
    max_tokens: int = field(default=64, metadata=_help("the longest reply the agent's model may write"))

    def __post_init__(self) -> None:
        owner = "RunConfig"
        check_number(owner, "temperature", self.temperature, lo=0.0)
        check_number(owner, "top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int(owner, "max_tokens", self.max_tokens)
        self._validate_update(owner)

    def check_trainable(self) -> None:
        """Refuse sampling settings a policy update cannot learn from on-policy, saying why."""
        if self.temperature <= 0:
            raise UsageError(
                "RunConfig.temperature must be > 0 for training, got 0: greedy decoding gives every "
                "rollout of a group the same reply and no sampled distribution to compute a ratio against"
            )
        if self.top_p != 1.0:
            raise UsageError(
                f"RunConfig.top_p must be 1.0 for training, got {self.top_p!r}: the gateway would sample "
                "from a truncated (nucleus) distribution while the update's PPO ratio uses the full one, "
                "so the run would learn off-policy; lower the temperature instead"
            )

    @property
    def sampling(self) -> dict[str, Any]:
        """The sampling settings as published in ``LLM.sampling`` (what agents should send)."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def resolve(
        cls,
        algorithm: Any = None,
        *,
        sampling: dict[str, Any] | None = None,
        update: dict[str, Any] | None = None,
        base: RunConfig | None = None,
    ) -> RunConfig:
        """One RunConfig from the ways a user can say it: ``base`` (a RunConfig), the update fields of
        ``algorithm`` (a LightningRL), a ``sampling`` dict and ``update`` overrides, later ones winning.
        Unknown keys are refused by name rather than ignored."""
        values: dict[str, Any] = base.to_dict() if base is not None else {}
        if algorithm is not None:
            for f in fields(UpdateSettings):
                if not hasattr(algorithm, f.name):
                    continue
                value = getattr(algorithm, f.name)
                # the algorithm's value counts unless it is the default and ``base`` already set one
                if f.name not in values or value != f.default:
                    values[f.name] = value
        known = {f.name for f in fields(cls)}
        for label, extra in (("sampling", sampling), ("update_options", update)):
            for key, value in (extra or {}).items():
                if key not in known:
                    raise UsageError(
                        f"unknown {label} setting {key!r}; RunConfig has {', '.join(sorted(known))}"
                    )
                if label == "sampling" and key not in SAMPLING_FIELDS:
                    raise UsageError(f"{key!r} is not a sampling setting; sampling has {SAMPLING_FIELDS}")
                values[key] = value
        return cls(**values)


def _check_count(name: str, value: Any, lo: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise UsageError(f"{name} must be an integer >= {lo}, got {value!r}")


@dataclass
class LoopConfig:
    """The numbers of LightningRL's training loop (``agl.Trainer``): how many steps of how many tasks,
    when to measure held-out reward, checkpoint and give up on a step."""

    steps: int = field(default=20, metadata=_help("policy updates"))
    tasks_per_step: int = field(default=8, metadata=_help("training tasks per step (one GRPO group each)"))
    val_every: int = field(
        default=5, metadata=_help("held-out check every N steps (and after the last; 0: end)")
    )
    val_before: bool = field(
        default=True,
        metadata=_help(
            "measure the held-out reward before the first update (False when the warm start was measured)"
        ),
    )
    val_samples: int = field(
        default=0,
        metadata=_help(
            "held-out decoding: 0 decodes each held-out task once greedily (temperature 0, as deployed "
            "agents and benchmarks are scored); K >= 1 samples K rollouts per task at the run's "
            "temperature, reported as their mean (val_reward) and pass@K (val_pass_at_k)"
        ),
    )
    dynamic_sampling: int = field(
        default=0,
        metadata=_help(
            "DAPO's dynamic sampling: up to N extra rounds of fresh tasks while a step's groups have no "
            "reward variance (0: off)"
        ),
    )
    branches: int = field(
        default=0,
        metadata=_help(
            "branching: K continuations sampled at the call of an agent that acted in only some rollouts "
            "of a group and has no reward spread there, the calls before it replayed (needs "
            "@agl.rollout(replayable=True); 0: off)"
        ),
    )
    checkpoint_every: int = field(
        default=0, metadata=_help("save a checkpoint every N steps (0: at the end)")
    )
    resume: bool = field(default=False, metadata=_help("continue from run_dir's last checkpoint"))
    seed: int = field(default=0, metadata=_help("seed of the task order and the policy update"))
    step_timeout_s: float | None = field(
        default=None, metadata=_help("cancel a step's rollouts still running after this many seconds")
    )
    behaviour_logprobs: bool | None = field(
        default=None,
        metadata=_help(
            "use the engine's recorded log-probs as the behaviour policy (None: when the engine serves "
            "the trained weights, i.e. transformers or vllm)"
        ),
    )
    adapter_per_agent: bool = field(
        default=False,
        metadata=_help(
            "train one LoRA adapter per selected agent (agents=[...]) on one frozen base model, each "
            "served to its own agent's calls; GRPO groups per agent"
        ),
    )
    warm_adapters: str | None = field(
        default=None,
        metadata=_help(
            "with adapter_per_agent: the agl sft --adapter-per-agent run (or its adapters/ folder) each "
            "agent's adapter starts from"
        ),
    )
    max_staleness: int = field(
        default=0,
        metadata=_help(
            "asynchronous training: rollouts run up to K policy versions ahead of the update, and a "
            "group with a call served by weights older than K versions is dropped (0: synchronous)"
        ),
    )
    off_policy: Literal["drop", "tis"] = field(
        default="drop",
        metadata=_help(
            "asynchronous training: a group older than --max-staleness is dropped ('drop') or kept with "
            "truncated importance weights ('tis', decoupled PPO for every step; an update in mixed "
            "precision trains that way whatever this says)"
        ),
    )
    tis_cap: float = field(
        default=2.0, metadata=_help("the cap of the truncated importance weights (off_policy='tis')")
    )

    def __post_init__(self) -> None:
        if not isinstance(self.adapter_per_agent, bool):
            raise UsageError(f"adapter_per_agent must be True or False, got {self.adapter_per_agent!r}")
        if self.warm_adapters is not None:
            if not isinstance(self.warm_adapters, (str, os.PathLike)):
                raise UsageError(f"warm_adapters must be a folder path, got {self.warm_adapters!r}")
            self.warm_adapters = os.fspath(self.warm_adapters)
        for name in ("tasks_per_step", "steps"):
            _check_count(name, getattr(self, name))
        if self.tasks_per_step < 1:
            raise UsageError("tasks_per_step must be >= 1")
        if self.val_every < 0 or self.checkpoint_every < 0:
            raise UsageError("val_every and checkpoint_every must be >= 0")
        if not isinstance(self.val_before, bool):
            raise UsageError(f"val_before must be True or False, got {self.val_before!r}")
        _check_count("val_samples", self.val_samples)
        if (
            isinstance(self.dynamic_sampling, bool)
            or not isinstance(self.dynamic_sampling, int)
            or self.dynamic_sampling < 0
        ):
            raise UsageError(
                "dynamic_sampling must be an integer >= 0 (extra sampling rounds), "
                f"got {self.dynamic_sampling!r}"
            )
        _check_count("max_staleness", self.max_staleness)
        b = self.branches
        if isinstance(b, bool) or not isinstance(b, int) or b < 0 or b == 1:
            raise UsageError(f"branches must be 0 (off) or an integer >= 2 (continuations), got {b!r}")
        if self.max_staleness and self.branches:
            raise UsageError("branches works on the synchronous loop only: use it with max_staleness=0")
        if self.off_policy not in ("drop", "tis"):
            raise UsageError(f"off_policy must be 'drop' or 'tis', got {self.off_policy!r}")
        check_number("LoopConfig", "tis_cap", self.tis_cap, lo=1.0)
        if self.max_staleness and self.dynamic_sampling:
            raise UsageError(
                "dynamic_sampling works on the synchronous loop only: use it with max_staleness=0"
            )


@dataclass
class RolloutSettings:
    """How long one of the trainer's rollouts may run and how often it is tried (the loop's defaults;
    :meth:`for_store` gives the per-rollout record :class:`agl.types.RolloutConfig` the store keeps)."""

    timeout_s: float | None = field(
        default=None, metadata=_help("a rollout attempt's time limit in seconds (None: no limit)")
    )
    lease_s: float = field(
        default=120.0, metadata=_help("a runner's claim lapses without a heartbeat within this many seconds")
    )
    max_attempts: int = field(default=2, metadata=_help("tries per rollout before it counts as failed"))
    infra_retries: int = field(
        default=2,
        metadata=_help(
            "new rollouts in the place of one that failed on the infrastructure (a 502, a dead runner),"
            " apart from max_attempts"
        ),
    )

    def __post_init__(self) -> None:
        if (
            isinstance(self.infra_retries, bool)
            or not isinstance(self.infra_retries, int)
            or self.infra_retries < 0
        ):
            raise UsageError(f"infra_retries must be an integer >= 0, got {self.infra_retries!r}")

    def for_store(self) -> Any:
        """The same limits as the store's per-rollout ``agl.types.RolloutConfig`` (validated there)."""
        from agl.types import RolloutConfig as StoreRolloutConfig

        return StoreRolloutConfig(
            timeout_s=self.timeout_s, lease_s=self.lease_s, max_attempts=self.max_attempts
        )


class ConfigField(NamedTuple):
    """One field of a config dataclass, as a command line shows it."""

    name: str
    type: Any
    default: Any
    help: str


def config_fields(cls: type) -> Iterator[ConfigField]:
    """The fields of config dataclass ``cls`` (name, resolved type, default, help text), in order: what
    a command line needs to offer them as flags without restating them (``examples/_cli.py``)."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        default = f.default if f.default is not MISSING else None
        yield ConfigField(f.name, hints[f.name], default, str(f.metadata.get("help", "")))
