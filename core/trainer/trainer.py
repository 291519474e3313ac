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
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.adapter.air_rules import agent_rewards, reward_split
from agl.algorithms.per_agent_lora import warm_adapters_folder
from agl.config import LoopConfig, RolloutConfig, RunConfig
from agl.errors import UsageError
from agl.gateway.tokenizer import load_tokenizer
from agl.lora import selected_loras
from agl.run.metrics import MetricsLog, bar_postfix, engine_share, rollouts_postfix
from agl.run.served import prove_calls
from agl.run.settings import Serving
from agl.trainer.checks import StepChecks
from agl.trainer.keywords import merged, route_keywords
from agl.trainer.notes import inspect_commands, no_update_note
from agl.trainer.order import TaskOrder
from agl.trainer.sampling import resample
from agl.types import NewRollout, Rollout, Task, Transition, as_tasks

if TYPE_CHECKING:
    from agl.run.environment import Environment
    from agl.store.base import Store

__all__ = ["Trainer", "load_tokenizer"]

log = logging.getLogger("agl.trainer")


def _mean(xs: Sequence[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None


# ------------------------------------------------------------------------------------ trainer


class Trainer:
    """Train an agent's LLM with LightningRL.

    ``algorithm``: a ``LightningRL`` (credit, advantages, update settings) or an algorithm that runs
    itself (``agl.APO``). ``model``: a local path or a loaded ``PreTrainedModel`` (None: the embedded
    SmolLM2-135M-Instruct). The numbers come in three typed values, each optional:

    - ``serving`` (:class:`agl.run.Serving`): what serves the policy and where rollouts go — backend,
      store, runners, run directory, gateway (bind, advertised URL, key, or one started elsewhere);
    - ``loop`` (:class:`agl.config.LoopConfig`): steps, tasks per step, held-out checks, dynamic
      sampling, checkpoints, resume, seed; ``rollout`` (:class:`agl.config.RolloutConfig`): a
      rollout's timeout, lease and attempts;
    - ``config`` (:class:`agl.config.RunConfig`): sampling and the update's settings.

    Every field can also be given as a keyword (``Trainer(backend="scripted", steps=3)``, and
    ``rollout_timeout_s``, ``sampling={...}``, ``update_options={...}``); a keyword overrides the
    value's field, and an unknown keyword is a TypeError naming it. ``agents``: which agents' calls
    to train on; ``adapter``: an ``Adapter`` to use instead of the default one. With an adapter per
    agent (``adapter_per_agent=True``), ``warm_adapters`` (an ``agl sft --adapter-per-agent`` run
    directory) starts each agent's adapter from its warm start instead of zero.

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
        rollout: RolloutConfig | None = None,
        config: RunConfig | None = None,
        agents: Any = None,
        adapter: Any = None,
        judge: Any = None,
        reward: Any = "task",
        monitors: Any = True,
        gate: Any = None,
        **keywords: Any,
    ) -> None:
        from agl.algorithms.lightning_rl import LightningRL

        self.algorithm = algorithm if algorithm is not None else LightningRL()
        if not isinstance(self.algorithm, LightningRL) and not callable(getattr(self.algorithm, "fit", None)):
            raise UsageError(
                f"algorithm must be an agl.LightningRL or agl.APO, got {type(self.algorithm).__name__}"
            )
        parts = route_keywords(keywords)
        if model is not None:
            parts["serving"]["model"] = model
        self.serving = merged(Serving, serving, parts["serving"])
        self.loop = merged(LoopConfig, loop, parts["loop"])
        self.rollout = merged(RolloutConfig, rollout, parts["rollout"])
        #: the one run configuration: sampling published to the agents and used by the in-process
        #: gateway, and the update settings (temperature included) the policy update reads
        self.config = RunConfig.resolve(self.algorithm, base=config, **parts["config"])
        backend = self.serving.backend
        if backend == "vllm" and not self.config.lora:
            raise UsageError(
                "the vllm backend takes new weights as LoRA adapters: use LightningRL(lora=True) "
                "(for full fine-tuning serve with backend='transformers' or restart vLLM on a checkpoint)"
            )
        if (
            self.serving.runners == 0
            and self.serving.gateway_url is None
            and backend in ("transformers", "scripted")
        ):
            log.info("agl trainer: runners=0 — rollouts wait for external `agl runner` processes")
        self.agents = agents
        #: ``{agent: adapter name}`` with an adapter per agent (LoopConfig.adapter_per_agent), else {}
        self.agent_adapters = selected_loras(agents, self.loop.adapter_per_agent, self.config.lora)
        #: per-agent adapter folders the adapters start from (``agl sft --adapter-per-agent``), or None
        self.warm_adapters = warm_adapters_folder(
            self.loop.warm_adapters, self.agent_adapters, self.config.lora_r
        )
        self.adapter_arg = adapter
        #: the per-rollout limits the store keeps (timeout, lease, attempts)
        self.rollout_config = self.rollout.for_store()
        self.metrics = MetricsLog(self.serving.run_dir)
        self.checks = StepChecks()
        self.policy: Any = None
        self.env: Environment | None = None
        self._tokenizer: Any = None
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
        return self.serving.backend in ("transformers", "vllm")

    # ------------------------------------------------------------------------------ setup
    def _start(self, agent: Any, *, training: bool, base_url: str | None = None) -> None:
        """Start the run environment; training builds the policy first, which the engine then shares."""
        from agl.adapter import Adapter
        from agl.run.environment import Environment

        env = self.env = Environment(self.serving)
        env.open_store()
        s = self.serving
        use_model = training or (s.backend == "transformers" and base_url is None)
        source = env.model_source() if use_model else None
        # Training needs the policy's tokenizer; dev uses one to print prompts and to re-tokenise calls
        # of an endpoint without token ids (the shipped SmolLM2 one when nothing better is known).
        self._tokenizer = s.tokenizer if s.tokenizer is not None else load_tokenizer(source or s.model)
        if training:
            self._build_policy(source)
        engine = {"default_temperature": self.config.temperature, "default_top_p": self.config.top_p}
        if s.batched_lora:  # mixed-adapter rows through one batched LoRA product (adapter_per_agent)
            engine["batched_lora"] = True
        env.start(
            agent,
            policy=self.policy if training else None,
            tokenizer=self._tokenizer,
            source=source,
            base_url=base_url,
            engine=engine,
            worker_id="agl-trainer",
        )
        if self.adapter_arg is not None:
            self.adapter = self.adapter_arg
        else:
            self.adapter = Adapter(agents=self.agents, tokenizer=self._tokenizer, algorithm=self.algorithm)

    def _build_policy(self, source: Any) -> None:
        import torch

        from agl.algorithms.update import PolicyUpdate

        torch.manual_seed(self.loop.seed)
        self.policy = PolicyUpdate(
            source,
            self._tokenizer,
            self.config,
            output_dir=self.run_dir / "checkpoints",
            seed=self.loop.seed,
            adapters=dict(self.agent_adapters) or None,
        )
        if self.warm_adapters is not None:
            from agl.algorithms.per_agent_lora import load_adapter_checkpoint

            load_adapter_checkpoint(self.policy, str(self.warm_adapters))

    def close(self) -> None:
        """Stop the in-process runners and gateway, flush the spans and close TensorBoard."""
        if self.env is not None:
            self.env.close()
        self.rewarding.close()
        self.metrics.close()

    def sync_weights(self, version: int) -> float:
        """Push the policy's weights to the inference engine as ``version``; returns seconds taken."""
        return self.env.push_weights(self.policy, version) if self.env is not None else 0.0

    # ------------------------------------------------------------------------------ rollouts
    def _publish(self) -> int:
        assert self.env is not None
        return self.env.publish(self.config.sampling)

    def _enqueue(
        self, tasks: Sequence[Task], version: int, step: int, repeat: int, group_suffix: str = ""
    ) -> list[str]:
        # a task drawn again in a later sampling round of the same step is a group of its own
        rollouts = [
            NewRollout.from_task(
                task,
                group_id=f"{task.id}-s{step}{group_suffix}",
                resources_version=version,
                config=self.rollout_config,
                metadata={"step": step},
            )
            for task in tasks
            for _ in range(repeat)
        ]
        return [r.id for r in self.store.enqueue(rollouts)] if rollouts else []

    def _rollout_reward(self, rollout: Rollout, transitions: list[Transition]) -> float:
        """A rollout's reward: its final reward as the adapter defines it (one definition)."""
        if transitions:
            return transitions[0].final_reward
        return float(self.adapter.rollout_reward(self.store, rollout))

    def _collect(
        self, ids: Sequence[str], bar: Any, label: str
    ) -> tuple[dict[str, list[Transition]], dict[str, float], list[Rollout]]:
        """Wait for rollouts, adapting each as it finishes; the bar shows the live mean reward."""
        pending = set(ids)
        transitions: dict[str, list[Transition]] = {}
        rewards: dict[str, float] = {}
        finished: list[Rollout] = []
        timeout_s = self.loop.step_timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            done = [
                r for r in self.store.wait_for_rollouts(sorted(pending), timeout_s=0.5) if r.id in pending
            ]
            for r in done:
                pending.discard(r.id)
                ts = self.adapter.from_store(self.store, [r]) if r.status != "cancelled" else []
                transitions[r.id] = ts
                if r.status != "cancelled":
                    rewards[r.id] = self._rollout_reward(r, ts)
                finished.append(r)
            if bar is not None and done:
                bar.set_postfix(rollouts_postfix(len(ids), finished, rewards), refresh=True)
            if deadline is not None and time.monotonic() > deadline and pending:
                log.warning(
                    "agl trainer: %s: %d rollouts did not finish in time; cancelling them",
                    label,
                    len(pending),
                )
                for rid in list(pending):
                    with contextlib.suppress(Exception):
                        self.store.cancel(rid)
                deadline = None
        return transitions, rewards, finished

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
        train_tasks = as_tasks(train, "train")
        val_tasks = as_tasks(val, "val") if val is not None else []
        if not train_tasks:
            raise UsageError("fit() needs at least one training task")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.loop.resume:
            self.metrics.reset()
        from agl.trainer import malloc

        malloc.tune()  # freed activations leave the process instead of fragmenting the heap (agl.trainer.malloc)
        self._start(agent, training=True)
        # the judge's gateway, store and cache; AIR's gate and the credit rule are the adapter's
        self.rewarding.open(self.run_dir, self.adapter)
        try:
            self._loop(train_tasks, val_tasks)
        finally:
            self.close()
        with contextlib.suppress(Exception):
            from agl.reports.plot import plot_run

            plot_run(self.run_dir)
        if self.serving.progress:
            print(inspect_commands(self.run_dir, self.serving.store_url()))
        return self.metrics.summary(self.loop.steps)

    def _loop(self, train_tasks: list[Task], val_tasks: list[Task]) -> None:
        """Steps from the start (or the resumed) step to ``loop.steps``; the last one only measures the
        held-out reward. A checkpoint every ``checkpoint_every`` steps and after the last update."""
        from tqdm.auto import tqdm

        from agl.trainer import malloc

        cfg = self.loop
        if cfg.max_staleness:  # asynchronous training: its own loop (agl.trainer.async_loop)
            from agl.trainer.async_loop import AsyncLoop

            AsyncLoop(self, train_tasks, val_tasks).run()
            return
        order = TaskOrder(len(train_tasks), cfg.seed)
        start_step = self._resume(order)
        bar = tqdm(
            total=cfg.steps,
            initial=start_step,
            desc="agl fit",
            unit="step",
            disable=not self.serving.progress,
            dynamic_ncols=True,
        )
        for step in range(start_step, cfg.steps + 1):
            final = step == cfg.steps
            if step == start_step and not final:
                periodic = cfg.val_before
            else:
                periodic = bool(cfg.val_every and step % cfg.val_every == 0)
            do_val = bool(val_tasks) and (final or periodic)
            if final and not do_val:
                break
            batch = [] if final else [train_tasks[i] for i in order.take(cfg.tasks_per_step)]
            record = self._step(
                step,
                batch,
                val_tasks if do_val else [],
                bar,
                draw=lambda k: [train_tasks[i] for i in order.take(k)],
            )
            malloc.trim()
            if self.gate is not None and not final:  # roll back when a chosen monitor fired
                self.gate.apply(self, record)
            note = no_update_note(record, self.history)
            if note:
                log.warning(note)
            self.metrics.write(record)
            if not final:
                bar.update(1)
                bar.set_postfix(bar_postfix(record, self.history))
                done = step + 1
                if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.steps:
                    self._checkpoint(order, {"next_step": done})
        bar.close()

    def _step(
        self,
        step: int,
        batch: list[Task],
        val_tasks: list[Task],
        bar: Any,
        draw: Callable[[int], list[Task]] | None = None,
    ) -> dict[str, Any]:
        """One step of the loop: publish -> push -> enqueue -> collect -> adapt -> update. Returns the
        step's metrics record (a step with no training batch only measures the held-out reward).
        ``draw(k)`` gives ``k`` more training tasks, for dynamic sampling's extra rounds."""
        t_step = time.perf_counter()
        busy0 = self.env.engine_busy_s() if self.env is not None else None
        version = self._publish()
        sync_s = self.sync_weights(version)
        ids = self._enqueue(batch, version, step, self.algorithm.group_size)
        val_ids = self._enqueue(val_tasks, version, step, 1)
        t0 = time.perf_counter()
        stats_before = self.adapter.stats.copy()
        transitions, rewards, finished = self._collect(ids + val_ids, bar, f"step {step}")
        sampled: dict[str, Any] = {}
        if batch and self.loop.dynamic_sampling and draw is not None:
            ids, sampled = resample(
                self, step, len(batch), version, ids, transitions, rewards, finished, bar, draw
            )
        rollout_s = time.perf_counter() - t0
        self.checks.adapted(step, self.adapter.stats.since(stats_before), self.adapter.agents)
        record: dict[str, Any] = {"step": step, "resources_version": version}
        # judge scores -> the trained reward, judge-gated AIR (agl.trainer.rewarding)
        if batch:
            transitions, rewards, judged = self.rewarding.assemble(self.store, ids, transitions, rewards)
            record.update(judged)
        if val_ids:
            vr = [rewards[r] for r in val_ids if r in rewards]
            record.update(val_reward=_mean(vr), val_rollouts=len(vr), val_tasks=len(val_tasks))
        if batch:
            train_ids = set(ids)
            train_ts = [t for rid in ids for t in transitions.get(rid, [])]
            if self.env is not None and self.env.serves_pushed_weights:  # all ran after this push
                prove_calls(train_ts, {version}, f"step {step}")
            record.update(
                train_reward=_mean([rewards[r] for r in ids if r in rewards]),
                rollouts=len(ids),
                rollouts_failed=sum(1 for r in finished if r.id in train_ids and r.status != "succeeded"),
                transitions=len(train_ts),
                exact_token_ratio=(sum(1 for t in train_ts if t.exact) / len(train_ts)) if train_ts else None,
            )
            record.update(reward_split(train_ts, self.history))
            record.update(agent_rewards(self.agent_adapters, ids, transitions, rewards))
            if sampled:
                keep = set(sampled.pop("kept_groups"))
                # nothing informative after every round: the update still runs (it skips zero
                # advantages), so the step count, schedule and checkpoints stay in step with `step`
                record.update(self._update([t for t in train_ts if t.group_id in keep] or train_ts))
                record.update(sampled)  # groups counted over every round, not only the ones trained
            else:
                record.update(self._update(train_ts))
        # the reward-hacking monitors' metrics and warnings (agl.trainer.monitors)
        record.update(
            self.rewarding.monitor(
                self.store, step, ids if batch else [], val_ids, transitions, record, self.history
            )
        )
        record.update(rollout_s=rollout_s, sync_s=sync_s, step_s=time.perf_counter() - t_step)
        record.update(engine_share(busy0, self.env, record["step_s"]))
        return record

    def _update(self, train_ts: list[Transition], *, on_policy: bool = True) -> dict[str, Any]:
        """Advantages and one policy update over a step's transitions; returns their metrics.
        ``on_policy=False`` (older weights served some calls) skips the on-policy ratio check."""
        if not train_ts:
            return {}
        if not self.behaviour_logprobs:
            train_ts = [t.model_copy(update={"response_logprobs": None}) for t in train_ts]
        # GRPO groups per agent with an adapter per agent (each agent's weights are compared alone)
        per_agent = {"per_agent": True} if self.agent_adapters else {}
        advantages, adv_stats = self.algorithm.compute_advantages(train_ts, **per_agent)
        # decoupled PPO when asked for, and always under mixed precision: the engine's log-probs are
        # not the autocast update's (bf16 rounding differs with every shape), so the ratio is taken
        # against the update's own log-probs and the mismatch is a bounded weight, not a clip
        precision = getattr(self.policy, "precision", "no")
        # likewise for an engine apart from the trainer (vLLM): other kernels, often another dtype
        engine = "vllm" if self.serving.backend == "vllm" and self.behaviour_logprobs else None
        decoupled = self.loop.off_policy == "tis" or precision != "no" or engine is not None
        tis = {"tis_cap": self.loop.tis_cap} if decoupled else {}
        update = self.policy.step(train_ts, advantages, **tis)
        if on_policy:
            self.checks.on_policy(
                update.get("behaviour_ratio_dev"), self.config, precision, decoupled, engine=engine
            )
        # the update's metrics under their final names (PolicyUpdate.step names them for the record)
        return {
            "zero_variance_groups": adv_stats["zero_variance_groups"],
            "groups": adv_stats["groups"],
            **update,
        }

    def _resume(self, order: TaskOrder) -> int:
        """With ``resume=True`` and a saved state: restore the policy, task order, RNG and history, and
        cancel rollouts a crashed run left; returns the step to continue from (0 otherwise)."""
        state_file = self.run_dir / "trainer_state.json"
        if not (self.loop.resume and state_file.exists()):
            return 0
        state = json.loads(state_file.read_text())
        start_step = self.policy.load_checkpoint(state["checkpoint"])
        start_step = int(state.get("next_step", start_step))
        order.restore(state)
        self.metrics.load()
        self.metrics.truncate(start_step)  # steps after the checkpoint: their updates died with the process
        for r in self.store.query_rollouts(status=["queued", "running"]):
            with contextlib.suppress(Exception):
                self.store.cancel(r.id)
        log.info("agl trainer: resumed at step %d from %s", start_step, state["checkpoint"])
        return start_step

    def _checkpoint(self, order: TaskOrder, extra: dict[str, Any] | None = None) -> None:
        """Save the policy, then ``trainer_state.json`` atomically (the task order and ``extra``)."""
        path = self.policy.save_checkpoint()
        state = {
            "checkpoint": str(Path(path).resolve()),
            "step": self.policy.global_step,
            **order.state(),
            **(extra or {}),
        }
        tmp = self.run_dir / "trainer_state.json.tmp"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.run_dir / "trainer_state.json")

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
        self._start(agent, training=False, base_url=base_url)
        try:
            version = self._publish()
            ids = self._enqueue(tasks, version, 0, repeat)
            transitions, rewards, finished = self._collect(ids, None, "dev")
        finally:
            self.close()
        if show:
            from agl.trainer.report import print_dev_run

            print_dev_run(ids, finished, transitions, rewards, self._tokenizer)
            print(inspect_commands(self.run_dir, self.serving.store_url()))
        return [t for rid in ids for t in transitions.get(rid, [])]
