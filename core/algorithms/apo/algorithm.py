"""``agl.APO``: the algorithm object a user builds — its knobs (budgets, the optimiser, the prompts to
optimise), their validation, and the entry points ``fit`` (called by ``agl.Trainer``) and
``optimize`` (without a Trainer). The rounds themselves run in :mod:`agl.algorithms.apo.loop`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from agl.algorithms.apo.settings import RunSettings, as_tasks
from agl.algorithms.apo.text import CRITIQUE_SYSTEM, REWRITE_SYSTEM
from agl.errors import UsageError
from agl.tracing.prompts import placeholders

__all__ = ["APO"]


@dataclass
class APO:
    """Automatic prompt optimisation; pass to ``agl.Trainer(algorithm=...)`` or run ``agl apo``.

    ``prompts``: the starting templates by name (None: the agent's own defaults, read from the
    ``agl.prompt`` spans of the first validation run). ``agents``: the prompt names to optimise (None:
    all; a Trainer's ``agents`` is used when this is None). Budgets: ``rounds``, ``beam_width``
    (candidates kept), ``branch_factor`` (rewrites per kept candidate per round),
    ``rollouts_per_candidate`` (training tasks each beam candidate runs per round, to find failures),
    ``max_optimizer_tokens`` (None: unlimited). ``failure_below``: a rollout whose reward is below it
    is a failure; ``max_failures``: failing traces shown per critique.

    The optimiser: ``optimizer_base_url`` + ``optimizer_model`` (+ ``optimizer_api_key``, default
    ``$OPENAI_API_KEY``) for any OpenAI-compatible endpoint; or ``optimizer_backend``, an
    ``agl.gateway`` Backend (tests: a ``ScriptedBackend``); or neither, to use the agent's own model.
    ``rewrite_format``: ``"json"`` (``{"prompt": ...}``, one repair request on bad JSON) or
    ``"text"`` (the reply is the prompt; for small models that cannot keep to JSON).
    """

    rounds: int = field(default=3, metadata={"help": "optimisation rounds"})
    beam_width: int = field(default=2, metadata={"help": "candidate prompts kept per round"})
    branch_factor: int = field(default=2, metadata={"help": "rewrites per kept candidate per round"})
    rollouts_per_candidate: int = field(
        default=8, metadata={"help": "training tasks each beam candidate runs per round (to find failures)"}
    )
    max_optimizer_tokens: int | None = field(
        default=None, metadata={"help": "the optimiser's token budget for the run (default: unlimited)"}
    )
    prompts: dict[str, str] | None = None
    agents: Sequence[str] | None = None
    optimizer_base_url: str | None = field(
        default=None, metadata={"help": "the optimiser's OpenAI-compatible endpoint"}
    )
    optimizer_model: str | None = field(default=None, metadata={"help": "the model name there"})
    optimizer_api_key: str | None = field(
        default=None, metadata={"help": "its API key (default: $OPENAI_API_KEY)"}
    )
    optimizer_backend: Any = None
    optimizer_store: Any = None
    optimizer_sampling: dict[str, Any] = field(
        default_factory=lambda: {"temperature": 1.0, "max_tokens": 1024}
    )
    optimizer_timeout_s: float = 600.0
    rewrite_format: Literal["json", "text"] = field(
        default="json",
        metadata={
            "help": 'json: the rewrite is {"prompt": ...}; text: the reply is the prompt (small models)'
        },
    )
    repair_retries: int = 1
    failure_below: float = field(default=1.0, metadata={"help": "a reward below this is a failure"})
    max_failures: int = 4
    trace_chars: int = 2000
    critique_system: str = CRITIQUE_SYSTEM
    rewrite_system: str = REWRITE_SYSTEM

    def __post_init__(self) -> None:
        for name in ("rounds", "beam_width", "branch_factor", "rollouts_per_candidate", "max_failures"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (0 if name == "rounds" else 1)
            ):
                raise UsageError(
                    f"APO {name} must be an integer >= {0 if name == 'rounds' else 1}, got {value!r}"
                )
        if self.max_optimizer_tokens is not None and (
            isinstance(self.max_optimizer_tokens, bool)
            or not isinstance(self.max_optimizer_tokens, int)
            or self.max_optimizer_tokens < 1
        ):
            raise UsageError(
                f"max_optimizer_tokens must be a positive integer or None, got {self.max_optimizer_tokens!r}"
            )
        if self.rewrite_format not in ("json", "text"):
            raise UsageError(f"rewrite_format must be 'json' or 'text', got {self.rewrite_format!r}")
        if self.repair_retries < 0:
            raise UsageError("repair_retries must be >= 0")
        if not math.isfinite(self.failure_below):
            raise UsageError("failure_below must be finite")
        if self.prompts is not None:
            if not isinstance(self.prompts, dict) or not self.prompts:
                raise UsageError("prompts must be a non-empty dict {name: template} or None")
            for name, text in self.prompts.items():
                if not isinstance(name, str) or not name or not isinstance(text, str) or not text.strip():
                    raise UsageError(f"prompts: {name!r} must map to a non-empty template string")
                try:
                    placeholders(text)
                except ValueError as exc:
                    raise UsageError(f"prompts[{name!r}] is not a valid f-string template: {exc}") from None
        if isinstance(self.agents, str):
            self.agents = [self.agents]
        if self.optimizer_base_url is not None and self.optimizer_backend is not None:
            raise UsageError("give optimizer_base_url or optimizer_backend, not both")

    # ---------------------------------------------------------------------------- entry points
    def fit(
        self,
        trainer: Any,
        agent: Any,
        train: Iterable[Any],
        val: Iterable[Any] | None = None,
        *,
        test: Iterable[Any] | None = None,
    ) -> dict[str, Any]:
        """The Trainer's entry point (``Trainer.fit`` calls it): run APO with the trainer's model,
        backend, store, runners and run directory. ``test``: as in :meth:`optimize`."""
        return self.optimize(agent, train, val, test=test, setup=RunSettings.from_trainer(trainer))

    def optimize(
        self,
        agent: Any,
        train: Iterable[Any],
        val: Iterable[Any] | None,
        *,
        test: Iterable[Any] | None = None,
        setup: RunSettings | None = None,
        **settings: Any,
    ) -> dict[str, Any]:
        """Run APO without a Trainer; the run's settings are ``setup`` or keywords (``backend``,
        ``model``, ``base_url``, ``store``, ``runners``, ``run_dir``, ``sampling``, ... — the fields of
        :class:`RunSettings`). ``test``: tasks held out from selection, run with the initial and the
        best prompts at the end (the unbiased before/after). Returns the run's summary."""
        from agl.algorithms.apo.loop import ApoRun

        if setup is not None and settings:
            raise TypeError("give the run's settings as setup= or as keywords, not both")
        setup = setup or RunSettings.from_kwargs(**settings)
        train_tasks = as_tasks(train, "train")
        val_tasks = as_tasks(val, "val")
        test_tasks = as_tasks(test, "test")
        if not train_tasks:
            raise UsageError("APO needs at least one training task (their failures drive the rewrites)")
        if not val_tasks:
            raise UsageError("APO needs validation tasks (val=...): candidates are chosen on them")
        return ApoRun(self, setup, agent, train_tasks, val_tasks, test_tasks).run()
