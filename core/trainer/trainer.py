"""The Trainer (DESIGN §1, §9): the training loop, end to end, in one process or against a store server.

One step of ``fit``:

1. publish a ``Resources`` snapshot (the gateway URL, model name, sampling) — its version is the step's
   weight version — and push the policy's current weights to the inference backend with that version
   (in-process swap for ``transformers``; a saved LoRA adapter loaded by the gateway's ``vllm`` backend);
2. enqueue ``group_size`` rollouts for each of ``tasks_per_step`` training tasks (one GRPO group each),
   plus the validation tasks every ``val_every`` steps (and before the first update unless
   ``val_before=False``, and after the last), all pinned to that resources version;
3. runners (in-process asyncio tasks by default, or ``agl runner`` processes anywhere) run the agent;
   the gateway records every LLM call with exact token ids; with ``dynamic_sampling=N`` (DAPO), while
   fewer than ``tasks_per_step`` groups have any reward variance, up to N more rounds of fresh tasks
   are run, and the update takes ``tasks_per_step`` informative groups;
4. the adapter turns each finished rollout's spans into transitions (only the finishing attempt, never
   stale spans, only the selected agents); LightningRL computes advantages; ``PolicyUpdate`` updates the
   policy (TRL's GRPO loss, LoRA by default);
5. metrics go to ``run_dir/metrics.jsonl`` and TensorBoard; checkpoints to ``run_dir/checkpoints``.

The store, gateway, runners and weight pushes are the run environment's (:mod:`agl.run`); the trainer
builds the tokenizer and the policy and hands them to it. ``dev(agent, data)`` runs rollouts against
any endpoint without training and prints the transitions and rewards a run would train on.

Torch, transformers and TRL are imported only when a policy is built: ``import agl.trainer.trainer`` is light.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.algorithms.per_agent_lora import warm_adapters_folder
from agl.chat.tokenizer import load_tokenizer
from agl.config import LoopConfig, RolloutSettings, RunConfig
from agl.errors import UsageError
from agl.gateway.sampling import SamplingLimits
from agl.lora import selected_loras
from agl.run.metrics import MetricsLog
from agl.run.settings import Serving
from agl.trainer import distributed
from agl.trainer.checks import StepChecks
from agl.trainer.loop import Schedule, run_loop
from agl.trainer.notes import inspect_commands
from agl.trainer.steps import Steps
from agl.trainer.sync import SyncSchedule
from agl.types import Task, Transition, as_tasks

if TYPE_CHECKING:
    from agl.run.environment import Environment
    from agl.store.base import Store

__all__ = ["Trainer", "load_tokenizer"]

log = logging.getLogger("agl.trainer")


def _given(name: str, cls: type, value: Any, *, default: Any = dataclasses.MISSING) -> Any:
    """``value`` if it is a ``cls``; None gives ``default`` (the class's defaults unless one is named);
    anything else — a dict, another settings class — is a TypeError naming what was expected."""
    if value is None:
        return cls() if default is dataclasses.MISSING else default
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be an {cls.__module__}.{cls.__name__}, got {type(value).__name__}")
    return value


# ------------------------------------------------------------------------------------ trainer


class Trainer:
    """Train an agent's LLM with LightningRL.

    ``algorithm``: a ``LightningRL`` (credit, advantages, update settings) or an algorithm that runs
    itself (``agl.APO``). ``model``: a local path or a loaded ``PreTrainedModel`` (None: the embedded
    SmolLM2-135M-Instruct). The numbers come in four typed values, each optional:

    - ``serving`` (:class:`agl.run.settings.Serving`): what serves the policy and where rollouts go —
      backend, store, runners, run directory, gateway (bind, advertised URL, key, or one started
      elsewhere);
    - ``loop`` (:class:`agl.config.LoopConfig`): steps, tasks per step, held-out checks, dynamic
      sampling, checkpoints, resume, seed; ``rollout`` (:class:`agl.config.RolloutSettings`): a
      rollout's timeout, lease and attempts;
    - ``config`` (:class:`agl.config.RunConfig`): sampling and the update's settings.

    Each value is given whole (``Trainer(serving=Serving(backend="scripted"),
    loop=LoopConfig(steps=3))``); one not given takes its class's defaults, and anything but an
    instance of the class is a TypeError naming it. ``agents``: which agents' calls to train on;
    ``adapter``: an ``Adapter`` to use instead of the default one. With an adapter per agent
    (``LoopConfig.adapter_per_agent``), ``LoopConfig.warm_adapters`` (an ``agl sft
    --adapter-per-agent`` run directory) starts each agent's adapter from its warm start instead of
    zero.

    Rewards (:mod:`agl.judge`, :mod:`agl.trainer.monitors`): ``judge`` (an :class:`agl.Judge`) scores each
    group; ``reward`` is ``"task"``, ``"judge"`` or weights ``{"task": 0.7, "judge": 0.3}``;
    ``monitors`` (True, False or :class:`agl.trainer.monitors.Thresholds`) watch for reward hacking every step;
    ``gate`` (an :class:`agl.Gate`, needs ``checkpoint_every``) rolls back when a monitor fires.
    """

    def __init__(
        self,
        algorithm: Any = None,
        model: Any = None,
        *,
        serving: Serving | None = None,
        loop: LoopConfig | None = None,
        rollout: RolloutSettings | None = None,
        config: RunConfig | None = None,
        agents: Any = None,
        adapter: Any = None,
        judge: Any = None,
        reward: Any = "task",
        monitors: Any = True,
        gate: Any = None,
    ) -> None:
        from agl.algorithms.lightning_rl import LightningRL

        self.algorithm = algorithm if algorithm is not None else LightningRL()
        if not isinstance(self.algorithm, LightningRL) and not callable(getattr(self.algorithm, "fit", None)):
            raise UsageError(
                f"algorithm must be an agl.LightningRL or agl.APO, got {type(self.algorithm).__name__}"
            )
        self.serving = _given("serving", Serving, serving)
        if model is not None:
            self.serving = dataclasses.replace(self.serving, model=model)
        self.loop = _given("loop", LoopConfig, loop)
        self.rollout = _given("rollout", RolloutSettings, rollout)
        #: the one run configuration: sampling published to the agents and used by the in-process
        #: gateway, and the update settings (temperature included) the policy update reads
        self.config = RunConfig.resolve(
            self.algorithm, base=_given("config", RunConfig, config, default=None)
        )
        backend = self.serving.backend
        if backend == "vllm" and not self.config.lora:
            raise UsageError(
                "the vllm backend takes new weights as LoRA adapters: use LightningRL(lora=True) "
                "(for full fine-tuning serve with backend='transformers' or restart vLLM on a checkpoint)"
            )
        if backend == "tinker":  # what the service's losses cannot express, refused before anything starts
            from agl.algorithms.tinker_update import check_settings

            check_settings(self.config, off_policy=self.loop.off_policy)
        if (
            self.serving.runners == 0
            and self.serving.gateway_url is None
            and backend in ("transformers", "scripted")
        ):
            log.info("agl trainer: runners=0 — rollouts wait for external `agl runner` processes")
        self.agents = agents
        #: ``{agent: LoRA name}`` with a LoRA per agent (LoopConfig.adapter_per_agent), else {}
        self.agent_loras = selected_loras(agents, self.loop.adapter_per_agent, self.config.lora)
        #: per-agent LoRA folders the LoRAs start from (``agl sft --adapter-per-agent``), or None
        self.warm_adapters = warm_adapters_folder(
            self.loop.warm_adapters, self.agent_loras, self.config.lora_r
        )
        self.adapter_arg = adapter
        #: the per-rollout limits the store keeps (timeout, lease, attempts)
        self.rollout_config = self.rollout.for_store()
        s = self.serving
        self.metrics = MetricsLog(s.run_dir, report_to=s.report_to, project=s.project, run_name=s.run_name)
        self.checks = StepChecks()
        self.policy: Any = None
        self.env: Environment | None = None
        #: the rollout function of the run in progress (fit/dev set it)
        self.agent_fn: Any = None
        self._tokenizer: Any = None
        #: the model the policy was built from (a path or a loaded model), once a run started
        self.model_source: Any = None
        from agl.trainer.rewarding import RewardAssembly

        self.rewarding = RewardAssembly(judge=judge, reward=reward, monitors=monitors)
        if gate is not None and not self.loop.checkpoint_every:
            raise UsageError("gate= rolls back to the last checkpoint: it needs checkpoint_every >= 1")
        self.gate = gate

    # ------------------------------------------------------------------------ read-only views
    @property
    def sampling(self) -> dict[str, Any]:
        """The sampling settings published to the agents (``self.config.sampling``)."""
        return self.config.sampling

    @property
    def run_dir(self) -> Path:
        return self.serving.run_dir

    @property
    def store(self) -> Store | None:
        """The run's store once started (None before)."""
        return self.env.store if self.env is not None else None

    @property
    def history(self) -> list[dict[str, Any]]:
        """The metrics records written so far (one per step)."""
        return self.metrics.history

    @property
    def gateway_api_key(self) -> str | None:
        return self.serving.gateway_api_key

    @property
    def behaviour_logprobs(self) -> bool:
        """Train against the engine's recorded log-probs: by default only when the engine serves the
        trained weights (the transformers and vllm backends)."""
        if self.loop.behaviour_logprobs is not None:
            return self.loop.behaviour_logprobs
        return self.serving.backend in ("transformers", "vllm", "tinker")

    # ------------------------------------------------------------------------------ setup
    def _start(self, agent: Any, *, training: bool, base_url: str | None = None) -> None:
        """Start the run environment; training builds the policy first, which the engine then shares."""
        from agl.adapter import Adapter
        from agl.run.environment import Environment

        self.agent_fn = agent  # the rollout function (branching reads its replay contract)
        env = self.env = Environment(self.serving)
        env.open_store()
        s = self.serving
        use_model = training or (s.backend == "transformers" and base_url is None)
        source = env.model_source() if use_model else None
        if training:  # several processes: every rank builds its policy from rank 0's source
            distributed.init()
            source = distributed.same_source(source)
        self.model_source = source
        # Training needs the policy's tokenizer; dev uses one to print prompts and to re-tokenise calls
        # of an endpoint without token ids (the shipped SmolLM2 one when nothing better is known).
        self._tokenizer = s.tokenizer if s.tokenizer is not None else load_tokenizer(source or s.model)
        if training:
            self.build_policy(source)
        # the engine's settings travel whole in ``serving.engine``; the run's sampling is the engine's
        # default for a request that sets none
        defaults = {"default_temperature": self.config.temperature, "default_top_p": self.config.top_p}
        env.start(
            agent,
            policy=self.policy if training else None,
            tokenizer=self._tokenizer,
            source=source,
            base_url=base_url,
            defaults=defaults,
            worker_id="agl-trainer",
            # programs that set no max_tokens/temperature (written for a hosted API) get the run's; a
            # program asking more than max_tokens is capped (agl.gateway.sampling)
            sampling=SamplingLimits.from_config(self.config),
        )
        if self.adapter_arg is not None:
            self.adapter = self.adapter_arg
        else:
            self.adapter = Adapter(agents=self.agents, tokenizer=self._tokenizer, algorithm=self.algorithm)

    def build_policy(self, source: Any, tokenizer: Any = None) -> Any:
        """Build the policy this process trains (``self.policy``, returned) from the model ``source``:
        its tokenizer (``tokenizer``; else the one already set; else ``Serving.tokenizer``, else
        ``source``'s), then the seeded :class:`~agl.algorithms.update.PolicyUpdate` (a LoRA per agent when asked), its warm
        start, and on rank 0 of several processes the :class:`~agl.trainer.distributed.LeaderPolicy`
        around it. Every rank builds it the same way (:func:`agl.trainer.distributed.follow_fit`)."""
        if self.serving.backend == "tinker":
            return self._tinker_policy(source, tokenizer)
        import torch

        from agl.algorithms.update import PolicyUpdate

        if tokenizer is not None:
            self._tokenizer = tokenizer
        elif self._tokenizer is None:
            tok = self.serving.tokenizer
            self._tokenizer = tok if tok is not None else load_tokenizer(source)
        torch.manual_seed(self.loop.seed)
        self.policy = PolicyUpdate(
            source,
            self._tokenizer,
            self.config,
            output_dir=self.run_dir / "checkpoints",
            seed=self.loop.seed,
            adapters=dict(self.agent_loras) or None,
        )
        if self.warm_adapters is not None:
            from agl.algorithms.per_agent_lora import load_adapter_checkpoint

            load_adapter_checkpoint(self.policy, str(self.warm_adapters))
        self.policy = distributed.lead(self.policy)  # rank 0 of several: its updates run on every rank
        return self.policy

    def _tinker_policy(self, source: Any, tokenizer: Any = None) -> Any:
        """The policy of a ``tinker`` run: LoRA training clients on the run's Tinker service (one per
        agent with ``adapter_per_agent``), updated there (:class:`agl.algorithms.tinker_update.TinkerPolicy`)."""
        from agl.algorithms.tinker_update import TinkerPolicy
        from agl.run.environment import Environment

        if tokenizer is not None:
            self._tokenizer = tokenizer
        if self.warm_adapters is not None:
            raise UsageError(
                "backend='tinker': warm_adapters start local LoRA folders; the service trains its own"
            )
        env = self.env if self.env is not None else Environment(self.serving)
        self.env = env
        service = env.tinker_service(
            source,
            adapters=list(self.agent_loras.values()) or None,
            lora_rank=int(self.config.lora_r),
            seed=self.loop.seed,
        )
        self.policy = TinkerPolicy(
            service,
            self.config,
            output_dir=self.run_dir / "checkpoints",
            adapters=dict(self.agent_loras) or None,
            off_policy=self.loop.off_policy,
        )
        return self.policy

    def close(self) -> None:
        """Stop the in-process runners and gateway, flush the spans and close TensorBoard."""
        if self.env is not None:
            self.env.close()
        self.rewarding.close()
        summary = self.metrics.summary(self.loop.steps)
        self.metrics.close({k: v for k, v in summary.items() if k.startswith("val_")})

    def sync_weights(self, version: int) -> float:
        """Push the policy's weights to the inference engine as ``version``; returns seconds taken."""
        return self.env.push_weights(self.policy, version) if self.env is not None else 0.0

    # ----------------------------------------------------------------------------------- fit
    def fit(self, agent: Any, train: Iterable[Any], val: Iterable[Any] | None = None) -> dict[str, Any]:
        """Train ``agent`` on ``train`` tasks, measuring held-out reward on ``val``; returns a summary
        (``val_reward_before``/``after``, ``steps``, ``run_dir``, the history)."""
        if callable(getattr(self.algorithm, "fit", None)):  # an algorithm that runs itself (agl.APO)
            return self.algorithm.fit(self, agent, train, val)
        if self.serving.backend == "openai":
            raise UsageError(
                "the openai backend serves a hosted model that agl cannot update: use it with dev()"
            )
        self.config.check_trainable()
        if distributed.is_follower():  # ranks > 0 of torchrun/accelerate launch take part in updates only
            return distributed.follow_fit(self)
        train_tasks = as_tasks(train, "train")
        val_tasks = as_tasks(val, "val") if val is not None else []
        if not train_tasks:
            raise UsageError("fit() needs at least one training task")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.loop.resume:
            self.metrics.reset()
        from agl.trainer import malloc

        malloc.tune()  # freed activations leave the process instead of fragmenting the heap (agl.trainer.malloc)
        from agl.run.trackers import run_config

        parts = {"serving": self.serving, "loop": self.loop, "rollout": self.rollout, "config": self.config}
        self.metrics.start(run_config(self.algorithm, **parts), resume=self.loop.resume)
        try:
            self._start(agent, training=True)
            self._record(agent, parts)
            # the judge's gateway, store and cache; AIR's gate and the credit rule are the adapter's
            self.rewarding.open(self.run_dir, self.adapter)
            self._loop(train_tasks, val_tasks)
            with contextlib.suppress(Exception):  # the reward curve, to run_dir and the trackers
                from agl.run.plot import plot_run

                self.metrics.log_plot(plot_run(self.run_dir))
        except BaseException:
            distributed.end(self.policy, None)  # the other ranks fail too
            raise
        finally:
            self.close()
        if self.serving.progress:
            print(inspect_commands(self.run_dir, self.serving.store_url()))
        summary = self.metrics.summary(self.loop.steps)
        distributed.end(self.policy, summary)  # the other ranks' fit returns it
        return summary

    def _record(self, agent: Any, parts: dict[str, Any]) -> None:
        """``run_dir/run.json`` (:mod:`agl.run.record`): the base model, the agents and the settings,
        which ``agl export model`` writes into the model card."""
        from agl.run.record import write_run_record
        from agl.run.trackers import run_config

        write_run_record(
            self.run_dir,
            source=self.model_source,
            agent=agent,
            agents=self.agents,
            adapters=self.agent_loras,
            lora=self.config.lora,
            config=run_config(self.algorithm, **parts),
        )

    def _loop(self, train_tasks: list[Task], val_tasks: list[Task]) -> None:
        """The run's steps: the synchronous schedule, or the asynchronous one with ``max_staleness > 0``,
        under the one loop skeleton (:mod:`agl.trainer.loop`)."""
        steps = Steps(self)
        schedule: Schedule
        if self.loop.max_staleness:
            from agl.trainer.async_loop import AsyncSchedule

            schedule = AsyncSchedule(steps, train_tasks)
        else:
            schedule = SyncSchedule(steps, train_tasks)
        run_loop(self, schedule, val_tasks)

    # ----------------------------------------------------------------------------------- dev
    def dev(
        self,
        agent: Any,
        data: Iterable[Any],
        *,
        base_url: str | None = None,
        model: str | None = None,
        api_key: str | None = None,
        repeat: int = 1,
        show: bool = True,
    ) -> list[Transition]:
        """Run ``agent`` on ``data`` without training (against ``base_url`` — any OpenAI-compatible
        endpoint, through the gateway so calls are recorded — or the configured backend) and print the
        transitions and rewards a training run would use. Returns the transitions."""
        changes = {"model_name": model, "api_key": api_key}
        self.serving = dataclasses.replace(
            self.serving, **{k: v for k, v in changes.items() if v is not None}
        )
        tasks = as_tasks(data, "test")
        if not tasks:
            raise UsageError("dev() needs at least one task")
        if distributed.is_follower():  # under torchrun, rank 0 alone runs the rollouts
            return []
        self._start(agent, training=False, base_url=base_url)
        steps = Steps(self)
        try:
            version = steps.publish()
            ids = steps.enqueue(tasks, version, 0, repeat)
            transitions, rewards, finished = steps.collect(ids, None, "dev")
        finally:
            self.close()
        if show:
            from agl.trainer.report import print_dev_run

            print_dev_run(ids, finished, transitions, rewards, self._tokenizer)
            print(inspect_commands(self.run_dir, self.serving.store_url()))
        return [t for rid in ids for t in transitions.get(rid, [])]
