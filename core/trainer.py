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

``dev(agent, data)`` runs rollouts against any endpoint without training and prints the transitions
and rewards a run would train on.

Torch, transformers and TRL are imported only when a policy is built: ``import agl.trainer`` is light.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.config import RunConfig
from agl.trajectories import BREAK_CAUSES
from agl.types import LLM, NewRollout, Rollout, RolloutConfig, Task, Transition

if TYPE_CHECKING:
    from agl.store.base import Store

__all__ = ["Trainer", "load_tokenizer"]

log = logging.getLogger("agl.trainer")

_BACKENDS = ("transformers", "vllm", "scripted", "openai")


# ------------------------------------------------------------------------------------ helpers


def load_tokenizer(model: Any = None) -> Any:
    """A Hugging Face tokenizer for ``model`` (a path, a loaded model or None for the shipped SmolLM2
    tokenizer, which is also what the gateway's scripted backend tokenises with)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = (
        model
        if isinstance(model, (str, os.PathLike))
        else getattr(getattr(model, "config", None), "_name_or_path", None)
    )
    if path and Path(path, "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(path))
    assets = Path(__file__).parent / "gateway" / "assets"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(assets / "tokenizer.json"))
    cfg = json.loads((assets / "tokenizer_config.json").read_text())
    for key in ("eos_token", "bos_token", "unk_token", "pad_token"):
        value = cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value:
            setattr(tok, key, value)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.chat_template = (assets / "chat_template.jinja").read_text()
    return tok


def _as_tasks(data: Iterable[Any], mode: str) -> list[Task]:
    tasks = []
    for i, item in enumerate(data):
        if isinstance(item, Task):
            tasks.append(item.model_copy(update={"mode": mode}))
        else:
            tasks.append(Task(id=f"{mode}-{i}", input=item, mode=mode))  # type: ignore[arg-type]
    return tasks


def _val_set_size(record: dict[str, Any]) -> int | None:
    """How many held-out tasks a check was given (``val_rollouts`` for records older than ``val_tasks``)."""
    return record.get("val_tasks", record.get("val_rollouts"))


def _mean(xs: Sequence[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None


class _ServedGateway:
    """The gateway app under uvicorn in a daemon thread with its own event loop, so the trainer can
    run backend coroutines (weight swaps) on the loop that serves requests."""

    def __init__(
        self,
        backend: Any,
        store: Store | None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
    ) -> None:
        import uvicorn

        from agl.gateway.app import create_app

        self.backend = backend
        self.app = create_app(backend, store, api_key=api_key)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.root = f"http://{host}:{self._sock.getsockname()[1]}"
        self.url = self.root + "/v1"
        from agl.http_limits import HttpLimits

        config = uvicorn.Config(
            self.app,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=1,
            http=HttpLimits().protocol(),
        )
        self._server = uvicorn.Server(config)
        self.loop = asyncio.new_event_loop()
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="agl-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 600  # the lifespan loads the model (minutes on a first prepare)
        while not self._server.started:
            if self._error or not self._thread.is_alive():
                raise RuntimeError(
                    f"the gateway failed to start: {self._error[0] if self._error else 'it exited'}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway did not start")
            time.sleep(0.02)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
            self._error.append(exc)

    def call(self, coro_fn: Callable[[], Coroutine[Any, Any, Any]], timeout_s: float = 600.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout_s)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
        self._sock.close()


class _RunnerThread:
    """In-process runners: the Runner's asyncio workers on their own loop in a daemon thread."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._thread = threading.Thread(target=self._run, name="agl-runners", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            asyncio.run(self.runner.run_async())
        except Exception:  # noqa: BLE001
            log.exception("agl trainer: the in-process runner crashed")

    def close(self) -> None:
        self.runner.stop(now=True)
        self._thread.join(timeout=30)


# ------------------------------------------------------------------------------------ trainer


class Trainer:
    """Train an agent's LLM with LightningRL.

    ``algorithm``: a ``LightningRL`` (credit, advantages, update settings). ``model``: a local path or
    a loaded ``PreTrainedModel`` (None: the embedded SmolLM2-135M-Instruct). ``backend``: what serves
    the policy to the agent — ``"transformers"`` (embedded, in-process weight swaps), ``"vllm"``
    (``vllm_url``; LoRA adapters loaded at run time), ``"scripted"`` (``script``; tests), ``"openai"``
    (``base_url``; ``dev`` only), or a ``agl.gateway`` ``Backend`` instance. ``store``: a Store or URL
    (default: SQLite in ``run_dir``). ``runners``: in-process concurrency (0: rollouts are run by
    ``agl runner`` processes against ``store``). The in-process gateway binds ``gateway_bind``
    (``"127.0.0.1:0"``: a free local port; ``"0.0.0.0:8765"`` for runners on other hosts, published as
    ``gateway_advertise`` or this host's name; a non-loopback bind needs ``gateway_api_key`` or
    ``AGL_GATEWAY_API_KEY``, which the published ``LLM`` resource carries to the agents). With
    ``gateway_url`` the trainer uses a gateway started
    elsewhere (``agl gateway serve``) and sends it new weights through its ``/agl/v1`` endpoints (the
    saved files must be readable there).
    """

    def __init__(
        self,
        algorithm: Any = None,
        model: Any = None,
        backend: Any = "transformers",
        store: Store | str | None = None,
        runners: int = 4,
        *,
        run_dir: str | os.PathLike[str] = "runs/agl",
        agents: Any = None,
        adapter: Any = None,
        tokenizer: Any = None,
        model_name: str | None = None,
        sampling: dict[str, Any] | None = None,
        tasks_per_step: int = 8,
        steps: int = 20,
        val_every: int = 5,
        val_before: bool = True,
        dynamic_sampling: int = 0,
        checkpoint_every: int = 0,
        resume: bool = False,
        seed: int = 0,
        rollout_timeout_s: float | None = None,
        lease_s: float = 120.0,
        max_attempts: int = 2,
        step_timeout_s: float | None = None,
        gateway_url: str | None = None,
        gateway_bind: str = "127.0.0.1:0",
        gateway_advertise: str | None = None,
        gateway_api_key: str | None = None,
        vllm_url: str | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        script: Any = None,
        behaviour_logprobs: bool | None = None,
        progress: bool = True,
        update_options: dict[str, Any] | None = None,
        config: RunConfig | None = None,
    ) -> None:
        from agl.algorithms.lightning_rl import LightningRL

        self.algorithm = algorithm if algorithm is not None else LightningRL()
        if not isinstance(self.algorithm, LightningRL) and not callable(getattr(self.algorithm, "fit", None)):
            raise ValueError(
                f"algorithm must be an agl.LightningRL or agl.APO, got {type(self.algorithm).__name__}"
            )
        if isinstance(backend, str) and backend not in _BACKENDS:
            raise ValueError(
                f"backend must be one of {', '.join(_BACKENDS)} or a Backend instance, got {backend!r}"
            )
        for name, value in (("runners", runners), ("tasks_per_step", tasks_per_step), ("steps", steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if tasks_per_step < 1:
            raise ValueError("tasks_per_step must be >= 1")
        if val_every < 0 or checkpoint_every < 0:
            raise ValueError("val_every and checkpoint_every must be >= 0")
        if not isinstance(val_before, bool):
            raise ValueError(f"val_before must be True or False, got {val_before!r}")
        if (
            isinstance(dynamic_sampling, bool)
            or not isinstance(dynamic_sampling, int)
            or dynamic_sampling < 0
        ):
            raise ValueError(
                f"dynamic_sampling must be an integer >= 0 (extra sampling rounds), got {dynamic_sampling!r}"
            )
        if runners == 0 and gateway_url is None and backend in ("transformers", "scripted"):
            log.info("agl trainer: runners=0 — rollouts wait for external `agl runner` processes")
        if backend == "vllm" and not vllm_url:
            raise ValueError(
                "backend='vllm' needs vllm_url (the vLLM OpenAI server, e.g. http://host:8000/v1)"
            )
        #: the one run configuration: sampling published to the agents and used by the in-process
        #: gateway, and the update settings (temperature included) the policy update reads
        self.config = RunConfig.resolve(self.algorithm, sampling=sampling, update=update_options, base=config)
        if backend == "vllm" and not self.config.lora:
            raise ValueError(
                "the vllm backend takes new weights as LoRA adapters: use LightningRL(lora=True) "
                "(for full fine-tuning serve with backend='transformers' or restart vLLM on a checkpoint)"
            )
        if backend == "scripted" and script is None:
            raise ValueError("backend='scripted' needs script= (replies, see agl.gateway.ScriptedBackend)")
        self.model_arg = model
        self.backend_arg = backend
        self.store_arg = store
        self.runners = runners
        self.run_dir = Path(run_dir)
        self.agents = agents
        self.adapter_arg = adapter
        self.tokenizer_arg = tokenizer
        self.model_name = model_name
        self.tasks_per_step = tasks_per_step
        self.steps = steps
        self.val_every = val_every
        #: validate before the first update; False skips it when the starting policy was already
        #: measured (a second seed from the same warm start re-measures the same greedy figure)
        self.val_before = val_before
        #: DAPO's dynamic sampling: up to this many extra rounds of fresh tasks when a step's groups
        #: have zero variance (no gradient), so an update is not spent on nothing (0: off)
        self.dynamic_sampling = dynamic_sampling
        self.checkpoint_every = checkpoint_every
        self.resume = resume
        self.seed = seed
        self.rollout_config = RolloutConfig(
            timeout_s=rollout_timeout_s, lease_s=lease_s, max_attempts=max_attempts
        )
        self.step_timeout_s = step_timeout_s
        self.gateway_url = gateway_url
        host, _, port = gateway_bind.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"gateway_bind must be HOST:PORT (port 0 for a free one), got {gateway_bind!r}")
        self.gateway_bind = (host, int(port))
        # The in-process gateway follows `agl gateway serve`'s rule: a public bind needs a key, which
        # the published LLM resource then carries to the runners' agents.
        from agl.gateway.cli import API_KEY_ENV, check_public_bind

        self.gateway_api_key = gateway_api_key or os.environ.get(API_KEY_ENV) or None
        if gateway_url is None:
            check_public_bind(host, self.gateway_api_key)
        self.gateway_advertise = gateway_advertise
        self.vllm_url = vllm_url
        self.base_url = base_url
        self.api_key = api_key
        self.script = script
        if behaviour_logprobs is None:
            # Only an engine serving the trained weights reports the behaviour policy's log-probs.
            behaviour_logprobs = backend in ("transformers", "vllm")
        self.behaviour_logprobs = behaviour_logprobs
        self.progress = progress
        self.history: list[dict[str, Any]] = []
        self._warned_off_policy = False
        self._warned_unattributed = False
        self.policy: Any = None
        self.store: Store | None = None
        self._gateway: _ServedGateway | None = None
        self._runner: _RunnerThread | None = None
        self._tb: Any = None
        self._tokenizer: Any = None
        self._served_model_name: str | None = None

    @property
    def sampling(self) -> dict[str, Any]:
        """The sampling settings published to the agents (``self.config.sampling``)."""
        return self.config.sampling

    # ------------------------------------------------------------------------------ setup
    def _open_store(self) -> Store:
        import agl.store

        if self.store_arg is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            return agl.store.open(f"sqlite:///{(self.run_dir / 'store.db').resolve()}")
        if isinstance(self.store_arg, str):
            return agl.store.open(self.store_arg)
        return self.store_arg

    def _model_source(self) -> Any:
        if self.model_arg is not None:
            return self.model_arg
        from agl.gateway.models import prepare_default_model

        return str(prepare_default_model(progress=self.progress))

    def _make_tokenizer(self, source: Any) -> Any:
        if self.tokenizer_arg is not None:
            return self.tokenizer_arg
        return load_tokenizer(source)

    def _make_backend(self, source: Any, *, for_training: bool, base_url: str | None = None) -> Any:
        backend = self.backend_arg
        if not isinstance(backend, str):
            return backend
        from agl import gateway

        if base_url is not None or backend == "openai":
            url = base_url or self.base_url
            if not url:
                raise ValueError("the openai backend needs base_url (an OpenAI-compatible endpoint)")
            models = [self.model_name] if self.model_name else []
            return gateway.OpenAIBackend(url, api_key=self.api_key, models=models)
        if backend == "scripted":
            return gateway.ScriptedBackend(self.script, accept_any_model=True, on_exhausted="repeat")
        if backend == "vllm":
            return gateway.VLLMBackend(self.vllm_url, model=self.model_name)
        sampling = {
            "default_temperature": self.config.temperature,
            "default_top_p": self.config.top_p,
        }
        if for_training and self.policy is not None:
            # the engine serves the policy itself: frozen base weights shared, LoRA tensors pushed
            return gateway.TransformersBackend.for_policy(
                self.policy, tokenizer=self._tokenizer, model_name=self._model_name_for(source), **sampling
            )
        model = copy.deepcopy(source) if not isinstance(source, (str, os.PathLike)) else str(source)
        return gateway.TransformersBackend(
            model,
            tokenizer=self._tokenizer if not isinstance(model, str) else None,
            model_name=self._model_name_for(source),
            **sampling,
        )

    def _model_name_for(self, source: Any) -> str | None:
        if self.model_name:
            return self.model_name
        return Path(str(source)).name if isinstance(source, (str, os.PathLike)) else None

    def _start(self, agent: Any, *, training: bool, base_url: str | None = None) -> None:
        from agl.adapter import Adapter
        from agl.runner import Runner

        self.store = self._open_store()
        source = (
            self._model_source()
            if training or (self.backend_arg == "transformers" and base_url is None)
            else None
        )
        # Training needs the policy's tokenizer; dev uses one to print prompts and to re-tokenise calls
        # of an endpoint without token ids (the shipped SmolLM2 one when nothing better is known).
        self._tokenizer = self._make_tokenizer(source if source is not None else self.model_arg)
        if training:
            # built before the engine, which shares the policy's frozen weights instead of loading its own
            self._build_policy(source)
        if self.gateway_url is None or base_url is not None:
            backend = self._make_backend(source, for_training=training, base_url=base_url)
            host, port = self.gateway_bind
            self._gateway = _ServedGateway(
                backend, self.store, host=host, port=port, api_key=self.gateway_api_key
            )
            gw_url = self._gateway.url
            if self.gateway_advertise:
                gw_url = self.gateway_advertise.rstrip("/")
                gw_url = gw_url if gw_url.endswith("/v1") else gw_url + "/v1"
            elif host in ("0.0.0.0", "::"):
                gw_url = gw_url.replace(f"//{host}:", f"//{socket.getfqdn()}:", 1)
            models = backend.models()
        else:
            self._gateway = None
            gw_url = self.gateway_url.rstrip("/")
            gw_url = gw_url if gw_url.endswith("/v1") else gw_url + "/v1"
            models = [self.model_name] if self.model_name else []
        self._gateway_v1 = gw_url
        self._served_model_name = self.model_name or (models[0] if models else "model")
        if self.adapter_arg is not None:
            self.adapter = self.adapter_arg
        else:
            self.adapter = Adapter(agents=self.agents, tokenizer=self._tokenizer, algorithm=self.algorithm)
        if self.runners > 0:
            runner = Runner(
                agent, self.store, concurrency=self.runners, claim_timeout_s=1.0, worker_id="agl-trainer"
            )
            self._runner = _RunnerThread(runner)

    def _build_policy(self, source: Any) -> None:
        import torch

        from agl.algorithms.update import PolicyUpdate

        torch.manual_seed(self.seed)
        self.policy = PolicyUpdate(
            source,
            self._tokenizer,
            self.config,
            output_dir=self.run_dir / "checkpoints",
            seed=self.seed,
        )

    def close(self) -> None:
        """Stop the in-process runners and gateway, flush the spans and close TensorBoard."""
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        with contextlib.suppress(Exception):
            from agl.tracing import flush

            flush(10.0)
        if self._gateway is not None:
            self._gateway.close()
            self._gateway = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    # -------------------------------------------------------------------------- weight sync
    def sync_weights(self, version: int) -> float:
        """Push the policy's weights to the inference engine as ``version`` (``Backend.push``: shared
        tensors in process, a LoRA adapter or full weights as files elsewhere); returns seconds taken."""
        t0 = time.perf_counter()
        policy = self.policy
        if policy is None:
            return 0.0
        staging = self.run_dir / ("adapters" if policy.is_lora else "weights")
        if self._gateway is not None:
            backend = self._gateway.backend
            if not backend.can_push:  # scripted replies: there is nothing to serve new weights with
                return 0.0
            self._gateway.call(lambda: backend.push(policy, version=version, staging_dir=staging))
        else:
            self._push_remote(policy, version, staging)
        # Old weight files are dead weight (a full model each); vLLM keeps the last adapters loaded.
        _prune(self.run_dir / "weights", keep=1)
        _prune(self.run_dir / "adapters", keep=3)
        return time.perf_counter() - t0

    def _push_remote(self, policy: Any, version: int, staging: Path) -> None:
        """An external gateway (``agl gateway serve``): save the adapter (or, under full fine-tuning,
        the weights) where it can read them and tell it through its ``/agl/v1`` API."""
        import httpx

        root = self._gateway_v1[: -len("/v1")]
        target = staging / f"v{version}"
        if policy.is_lora:
            path, route = policy.save_adapter(target), "/agl/v1/adapters"
        else:
            path, route = policy.save_weights(target), "/agl/v1/weights"
        headers = {"Authorization": f"Bearer {self.gateway_api_key}"} if self.gateway_api_key else {}
        resp = httpx.post(
            root + route,
            json={"path": str(Path(path).resolve()), "version": version},
            headers=headers,
            timeout=600,
        )
        if resp.status_code >= 400:
            raise RuntimeError(f"the gateway refused the new weights: {resp.text[:300]}")

    # ------------------------------------------------------------------------------ rollouts
    def _publish(self) -> int:
        llm = LLM(
            base_url=self._gateway_v1,
            model=self._served_model_name or "model",
            sampling=self.config.sampling,
            api_key=self.gateway_api_key,
        )
        return self.store.add_resources({"main": llm}).version

    def _enqueue(
        self, tasks: Sequence[Task], version: int, step: int, repeat: int, group_suffix: str = ""
    ) -> list[str]:
        rollouts = []
        for task in tasks:
            # a task drawn again in a later sampling round of the same step is a group of its own
            group = f"{task.id}-s{step}{group_suffix}"
            for _ in range(repeat):
                rollouts.append(
                    NewRollout.from_task(
                        task,
                        group_id=group,
                        resources_version=version,
                        config=self.rollout_config,
                        metadata={"step": step},
                    )
                )
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
        deadline = None if self.step_timeout_s is None else time.monotonic() + self.step_timeout_s
        while pending:
            done = [
                r for r in self.store.wait_for_rollouts(sorted(pending), timeout_s=0.5) if r.id in pending
            ]
            for r in done:
                pending.discard(r.id)
                ts = self.adapter.from_store(self.store, [r.id]) if r.status != "cancelled" else []
                transitions[r.id] = ts
                if r.status != "cancelled":
                    rewards[r.id] = self._rollout_reward(r, ts)
                finished.append(r)
            if bar is not None and done:
                train = [rewards[r.id] for r in finished if r.mode == "train" and r.id in rewards]
                val = [rewards[r.id] for r in finished if r.mode == "val" and r.id in rewards]
                post = {"rollouts": f"{len(ids) - len(pending)}/{len(ids)}"}
                if train:
                    post["reward"] = f"{sum(train) / len(train):.3f}"
                if val:
                    post["val"] = f"{sum(val) / len(val):.3f}"
                bar.set_postfix(post, refresh=True)
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

    # ------------------------------------------------------------------------------- metrics
    def _log(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tb"))
            except Exception:  # noqa: BLE001 - TensorBoard is optional
                self._tb = False
        if self._tb:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self._tb.add_scalar(key, value, record["step"])
            self._tb.flush()

    # ----------------------------------------------------------------------------------- fit
    def fit(self, agent: Any, train: Iterable[Any], val: Iterable[Any] | None = None) -> dict[str, Any]:
        """Train ``agent`` on ``train`` tasks, measuring held-out reward on ``val``; returns a summary
        (``val_reward_before``/``after``, ``steps``, ``run_dir``, the history)."""
        from tqdm.auto import tqdm

        if callable(getattr(self.algorithm, "fit", None)):  # an algorithm that runs itself (agl.APO)
            return self.algorithm.fit(self, agent, train, val)
        if self.backend_arg == "openai":
            raise ValueError(
                "the openai backend serves a hosted model that agl cannot update: use it with dev()"
            )
        self.config.check_trainable()
        train_tasks = _as_tasks(train, "train")
        val_tasks = _as_tasks(val, "val") if val is not None else []
        if not train_tasks:
            raise ValueError("fit() needs at least one training task")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.resume and (self.run_dir / "metrics.jsonl").exists():
            (self.run_dir / "metrics.jsonl").unlink()
        from agl import malloc

        malloc.tune()  # freed activations leave the process instead of fragmenting the heap (agl.malloc)
        self._start(agent, training=True)
        order = _TaskOrder(len(train_tasks), self.seed)
        try:
            start_step = self._resume(order)
            bar = tqdm(
                total=self.steps,
                initial=start_step,
                desc="agl fit",
                unit="step",
                disable=not self.progress,
                dynamic_ncols=True,
            )
            for step in range(start_step, self.steps + 1):
                final = step == self.steps
                if step == start_step and not final:
                    periodic = self.val_before
                else:
                    periodic = bool(self.val_every and step % self.val_every == 0)
                do_val = bool(val_tasks) and (final or periodic)
                if final and not do_val:
                    break
                batch = [] if final else [train_tasks[i] for i in order.take(self.tasks_per_step)]
                record = self._step(
                    step,
                    batch,
                    val_tasks if do_val else [],
                    bar,
                    draw=lambda k: [train_tasks[i] for i in order.take(k)],
                )
                malloc.trim()
                self._log(record)
                if not final:
                    self._show_progress(bar, record)
                    done = step + 1
                    if (self.checkpoint_every and done % self.checkpoint_every == 0) or done == self.steps:
                        self._checkpoint(order)
            bar.close()
        finally:
            self.close()
        with contextlib.suppress(Exception):
            from agl.plot import plot_run

            plot_run(self.run_dir)
        return self._summary()

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
        version = self._publish()
        sync_s = self.sync_weights(version)
        ids = self._enqueue(batch, version, step, self.algorithm.group_size)
        val_ids = self._enqueue(val_tasks, version, step, 1)
        t0 = time.perf_counter()
        stats_before = self.adapter.stats.copy()
        transitions, rewards, finished = self._collect(ids + val_ids, bar, f"step {step}")
        sampled: dict[str, Any] = {}
        if batch and self.dynamic_sampling and draw is not None:
            ids, sampled = self._resample(
                step, len(batch), version, ids, transitions, rewards, finished, bar, draw
            )
        rollout_s = time.perf_counter() - t0
        self._check_adapted(step, self.adapter.stats.since(stats_before))
        record: dict[str, Any] = {"step": step, "resources_version": version}
        if val_ids:
            vr = [rewards[r] for r in val_ids if r in rewards]
            record.update(val_reward=_mean(vr), val_rollouts=len(vr), val_tasks=len(val_tasks))
        if batch:
            train_ids = set(ids)
            train_ts = [t for rid in ids for t in transitions.get(rid, [])]
            record.update(
                train_reward=_mean([rewards[r] for r in ids if r in rewards]),
                rollouts=len(ids),
                rollouts_failed=sum(1 for r in finished if r.id in train_ids and r.status != "succeeded"),
                transitions=len(train_ts),
                exact_token_ratio=(sum(1 for t in train_ts if t.exact) / len(train_ts)) if train_ts else None,
            )
            record.update(_reward_split(train_ts, self.history))
            if sampled:
                keep = set(sampled.pop("kept_groups"))
                # nothing informative after every round: the update still runs (it skips zero
                # advantages), so the step count, schedule and checkpoints stay in step with `step`
                record.update(self._update([t for t in train_ts if t.group_id in keep] or train_ts))
                record.update(sampled)  # groups counted over every round, not only the ones trained
            else:
                record.update(self._update(train_ts))
        record.update(rollout_s=rollout_s, sync_s=sync_s, step_s=time.perf_counter() - t_step)
        return record

    def _informative_groups(
        self, ids: Sequence[str], transitions: dict[str, list[Transition]]
    ) -> tuple[list[str], int]:
        """The groups among ``ids``' rollouts whose rewards differ (in the order drawn), and how many
        groups there are: the same statistic the advantages use, so "informative" means a gradient."""
        from agl.algorithms.lightning_rl import group_statistics

        stats = group_statistics([t for rid in ids for t in transitions.get(rid, [])], self.algorithm)
        return [gid for gid, gs in stats.items() if not gs.zero_variance], len(stats)

    def _resample(
        self,
        step: int,
        want: int,
        version: int,
        ids: list[str],
        transitions: dict[str, list[Transition]],
        rewards: dict[str, float],
        finished: list[Rollout],
        bar: Any,
        draw: Callable[[int], list[Task]],
    ) -> tuple[list[str], dict[str, Any]]:
        """Dynamic sampling (DAPO, Yu et al. 2025): while fewer than ``want`` groups have any reward
        variance, draw fresh tasks (as many as the informative rate so far says are needed, at most
        ``want``) for up to ``dynamic_sampling`` extra rounds. A group whose rollouts all score the same
        has zero advantage and teaches nothing; without this, a step of such groups is a wasted update.
        Returns every training rollout id and the sampling metrics with the groups to train on."""
        informative, n_groups = self._informative_groups(ids, transitions)
        rounds = 0
        while len(informative) < want and rounds < self.dynamic_sampling:
            rounds += 1
            rate = max(len(informative), 1) / max(n_groups, 1)
            k = min(want, math.ceil((want - len(informative)) / rate))
            more = self._enqueue(draw(k), version, step, self.algorithm.group_size, group_suffix=f"r{rounds}")
            t, r, f = self._collect(more, bar, f"step {step} round {rounds}")
            transitions.update(t)
            rewards.update(r)
            finished.extend(f)
            ids = ids + more
            informative, n_groups = self._informative_groups(ids, transitions)
        return ids, {
            "kept_groups": informative[:want],
            "groups": n_groups,
            "zero_variance_groups": n_groups - len(informative),
            "trained_groups": len(informative[:want]),
            "resample_rounds": rounds,
        }

    def _update(self, train_ts: list[Transition]) -> dict[str, Any]:
        """Advantages and one policy update over a step's transitions; returns their metrics."""
        if not train_ts:
            return {}
        if not self.behaviour_logprobs:
            train_ts = [t.model_copy(update={"response_logprobs": None}) for t in train_ts]
        advantages, adv_stats = self.algorithm.compute_advantages(train_ts)
        update = self.policy.step(train_ts, advantages)
        self._check_on_policy(update.get("behaviour_ratio_dev"))
        return {
            "zero_variance_groups": adv_stats["zero_variance_groups"],
            "groups": adv_stats["groups"],
            "loss": update["loss"],
            "kl": update["kl"],
            "clip_fraction": update["clip_fraction"],
            "entropy": update.get("entropy"),
            "grad_norm": update["grad_norm"],
            "tokens_per_s": update["tokens_per_s"],
            "update_s": update.get("update_s"),
            "trained_transitions": update["transitions"],
            # calls the engine cut at max_tokens (left out of the loss with mask_truncated)
            "truncated_calls": update.get("truncated_calls"),
            "behaviour_ratio_dev": update.get("behaviour_ratio_dev"),
            # multi-turn merging (agl.trajectories): sequences trained, tokens encoded, share of
            # calls that extended a sequence, tokens saved, and the calls that could not extend their
            # agent's sequence by cause (retokenised, edited, rerendered, truncated, diverged)
            "sequences": update.get("sequences"),
            "update_tokens": update.get("tokens"),
            "merge_rate": update.get("merge_rate"),
            "tokens_saved": update.get("tokens_saved"),
            **{f"breaks_{cause}": update.get(f"breaks_{cause}") for cause in BREAK_CAUSES},
        }

    def _resume(self, order: _TaskOrder) -> int:
        """With ``resume=True`` and a saved state: restore the policy, task order, RNG and history, and
        cancel rollouts a crashed run left; returns the step to continue from (0 otherwise)."""
        state_file = self.run_dir / "trainer_state.json"
        if not (self.resume and state_file.exists()):
            return 0
        state = json.loads(state_file.read_text())
        start_step = self.policy.load_checkpoint(state["checkpoint"])
        order.restore(state)
        self.history = [
            json.loads(line)
            for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()
        ]
        for r in self.store.query_rollouts(status=["queued", "running"]):
            with contextlib.suppress(Exception):
                self.store.cancel(r.id)
        log.info("agl trainer: resumed at step %d from %s", start_step, state["checkpoint"])
        return start_step

    def _show_progress(self, bar: Any, record: dict[str, Any]) -> None:
        bar.update(1)
        reward = record.get("train_reward")
        post = {"reward": f"{reward:.3f}" if reward is not None else "-"}
        last_val = next(
            (h["val_reward"] for h in reversed(self.history) if h.get("val_reward") is not None), None
        )
        if last_val is not None:
            post["val"] = f"{last_val:.3f}"
        bar.set_postfix(post)

    def _summary(self) -> dict[str, Any]:
        checks = [h for h in self.history if h.get("val_reward") is not None]
        after = checks[-1] if checks else None
        # the held-out reward before any update: the step-0 check (None when val_before=False skipped
        # it), and only when it was given as many held-out tasks as the last check -- a resumed run
        # re-checked on a larger held-out set must not be compared with the smaller set's figure. The
        # tasks given, not the rollouts that finished with a reward: a held-out rollout the step timeout
        # cancelled must not hide the comparison (histories written before val_tasks existed fall back).
        before = next((h for h in checks if h["step"] == 0), None)
        if before is not None and after is not None and _val_set_size(before) != _val_set_size(after):
            before = None
        return {
            "run_dir": str(self.run_dir),
            "steps": self.steps,
            "val_reward_before": before["val_reward"] if before else None,
            "val_reward_after": after["val_reward"] if after else None,
            "history": self.history,
        }

    def _check_adapted(self, step: int, stats: Any) -> None:
        """Refuse a step whose agent selection matched none of its LLM calls (the update would
        silently train on nothing), and warn once when calls lost their agent spans."""
        if stats.unattributed_calls and not self._warned_unattributed:
            self._warned_unattributed = True
            from agl.instrumentation.registry import instrumented

            log.warning(
                "agl trainer: step %d: %d LLM calls went through the gateway but none is inside an agent "
                "span, although %s is instrumented. The framework's hooks were bypassed or removed — e.g. "
                "an Agents SDK app calling set_trace_processors() after agl.instrument(), or an agent run "
                "outside the rollout's context — so agents= cannot select these calls",
                step,
                stats.unattributed_calls,
                ", ".join(instrumented()),
            )
        if stats.llm_calls and stats.unselected == stats.llm_calls and stats.transitions == 0:
            seen = ", ".join(f"{name or '<no agent span>'} ({n})" for name, n in sorted(stats.agents.items()))
            raise RuntimeError(
                f"step {step}: the agent selection agents={self.adapter.agents!r} matched 0 of "
                f"{stats.llm_calls} LLM calls, so there is nothing to train on. Agents seen: {seen}. "
                "Check the names given as agents= (they match invoke_agent span names) and that the "
                "agent framework is instrumented (agl.instrument()) before the agent is built"
            )

    #: a first-micro-batch ratio further than this from 1 means the recorded behaviour policy is not
    #: the policy the update scores (bf16 on a GPU stays well under it)
    OFF_POLICY_WARN = 0.05

    def _check_on_policy(self, ratio_dev: float | None) -> None:
        if ratio_dev is None or ratio_dev <= self.OFF_POLICY_WARN or self._warned_off_policy:
            return
        self._warned_off_policy = True
        log.warning(
            "agl trainer: before its first optimizer step the update's PPO ratio is off by %.3g: the "
            "log-probs the engine recorded are not the policy's at temperature %g. Most likely the agent "
            "sends its own temperature/top_p instead of resources.llm.sampling (%s), or the engine "
            "serves other weights than the policy's",
            ratio_dev,
            self.config.temperature,
            self.config.sampling,
        )

    def _checkpoint(self, order: _TaskOrder) -> None:
        path = self.policy.save_checkpoint()
        state = {"checkpoint": str(Path(path).resolve()), "step": self.policy.global_step, **order.state()}
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
        if model is not None:
            self.model_name = model
        if api_key is not None:
            self.api_key = api_key
        tasks = _as_tasks(data, "test")
        if not tasks:
            raise ValueError("dev() needs at least one task")
        if self.store_arg is None:
            self.store_arg = "memory://"
        self._start(agent, training=False, base_url=base_url)
        try:
            version = self._publish()
            ids = self._enqueue(tasks, version, 0, repeat)
            transitions, rewards, finished = self._collect(ids, None, "dev")
        finally:
            self.close()
        out: list[Transition] = []
        by_id = {r.id: r for r in finished}
        for rid in ids:
            ts = transitions.get(rid, [])
            out.extend(ts)
            if show:
                self._print_rollout(by_id.get(rid), ts, rewards.get(rid))
        if show:
            rs = [rewards[r] for r in ids if r in rewards]
            print(
                f"\n{len(ids)} rollouts, {len(out)} transitions, mean reward {_mean(rs) if rs else float('nan'):.3f}"
            )
        return out

    def _print_rollout(self, rollout: Rollout | None, ts: list[Transition], reward: float | None) -> None:
        if rollout is None:
            return
        err = rollout.attempts[-1].error if rollout.attempts else None
        print(
            f"\n=== rollout {rollout.id} [{rollout.status}] reward={reward} input={json.dumps(rollout.input)[:120]}"
        )
        if err is not None:
            print(f"    error: {err.type}: {err.message}")
        tok = self._tokenizer
        for t in ts:
            prompt_tail = ""
            if tok is not None:
                with contextlib.suppress(Exception):
                    prompt_tail = tok.decode(list(t.prompt_ids)[-40:])
            print(
                f"  [{t.index}] agent={t.agent} prompt={len(t.prompt_ids)} tok response={len(t.response_ids)} tok "
                f"exact={t.exact} reward={t.reward:g} (final {t.final_reward:g}, intermediate {t.intermediate_reward:g})"
            )
            if prompt_tail:
                print("      prompt …" + prompt_tail.replace("\n", "\\n")[-160:])
            print("      response: " + (t.response_text or "").replace("\n", "\\n")[:200])


class _TaskOrder:
    """Which training tasks each step takes: every task once per shuffled pass, seeded, resumable."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.rng = random.Random(seed)
        self.order: list[int] = []

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if not self.order:
                self.order = list(range(self.n))
                self.rng.shuffle(self.order)
            out.append(self.order.pop())
        return out

    def state(self) -> dict[str, Any]:
        return {"order": list(self.order), "rng": _rng_json(self.rng.getstate())}

    def restore(self, state: dict[str, Any]) -> None:
        self.order = list(state.get("order", []))
        self.rng.setstate(_rng_state(state["rng"]))


def _reward_split(transitions: Sequence[Transition], history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The step's reward split into task and AIR parts (:func:`agl.rewards.reward_breakdown`), and
    each part's gain since the first training step: how much of a reward gain is shaping."""
    from agl.rewards import reward_breakdown

    out: dict[str, Any] = dict(reward_breakdown(transitions))
    first = next((h for h in history if h.get("task_reward") is not None), None)
    if first is not None and out["task_reward"] is not None:
        out["task_reward_gain"] = out["task_reward"] - first["task_reward"]
        out["air_reward_gain"] = out["air_reward"] - first["air_reward"]
    return out


def _prune(folder: Path, keep: int) -> None:
    """Remove all but the ``keep`` newest ``v<N>`` directories in ``folder``."""
    import shutil

    if not folder.is_dir():
        return
    versions = sorted((int(p.name[1:]), p) for p in folder.iterdir() if p.is_dir() and p.name[1:].isdigit())
    for _, path in versions[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def _rng_json(state: Any) -> Any:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_state(data: Any) -> Any:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)
