"""APO — automatic prompt optimisation: rewrite an agent's prompts from critiques of its failures.

``agl.Trainer(algorithm=agl.APO(...)).fit(agent, train, val)`` (or ``agl apo``) improves the prompt
templates an agent reads with :func:`agl.prompt`, using any OpenAI-compatible LLM as the optimiser:
no GPU, no gradient, the same store, runners, gateway and traces as LightningRL.

Each round (docs/architecture.md §9, "APO"):

1. every candidate of the beam runs ``rollouts_per_candidate`` training tasks (one resources version
   per candidate: its prompts plus the agent's LLM, so each rollout records the version it used);
2. its failures (reward below ``failure_below``, or errors) are read back from the store and their
   spans turned into readable traces (:func:`summarize_trace`);
3. the optimiser LLM writes a critique of the prompt from those traces (the *textual gradient*), then
   a rewrite that answers it (the *edit*), ``branch_factor`` children per beam candidate;
4. each child runs every validation task; 5. the ``beam_width`` best by validation reward stay.

The optimiser's calls go through an agl gateway of their own, each as a rollout in the optimiser
store (``run_dir/optimizer.db`` by default), so ``agl spans`` shows every critique and rewrite with
its prompt. Budgets: ``rounds``, ``beam_width``, ``branch_factor``, ``rollouts_per_candidate`` and
``max_optimizer_tokens`` (a call is made only when its estimated size fits what is left).
Optimiser failures — an HTTP error, a reply that is not the asked-for JSON (one repair request is
sent), an empty rewrite, a rewrite that drops or adds ``{placeholders}`` — cost that child only;
the round goes on and the failure is counted in the metrics.

``run_dir`` receives ``metrics.jsonl`` (one record per round, ``agl plot`` draws it),
``candidates.jsonl`` (every candidate with its prompts, versions, scores, parent and critique),
``prompts/round-N.json`` (the best prompts after round N), ``best_prompts.json`` and
``reward_curve.png``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from agl import semconv as sc
from agl.algorithms.apo_text import (
    CRITIQUE_SYSTEM,
    JSON_ASK,
    REPAIR_ASK,
    REWRITE_SYSTEM,
    TEXT_ASK,
    OptimizerError,
    clip,
    estimate_tokens,
    parse_rewrite,
    summarize_trace,
)
from agl.prompts import placeholders, prompt_version
from agl.types import LLM, NewRollout, PromptTemplate, Rollout, RolloutConfig, Span, Task

__all__ = [
    "APO",
    "Candidate",
    "CRITIQUE_SYSTEM",
    "OptimizerError",
    "REWRITE_SYSTEM",
    "load_jsonl",
    "parse_rewrite",
    "register_cli",
    "summarize_trace",
]

log = logging.getLogger("agl.apo")


class _BudgetExhausted(Exception):
    """The next optimiser call would not fit in ``max_optimizer_tokens``."""


@dataclass
class Candidate:
    """One set of prompts under evaluation: the initial prompts or a rewrite of a beam member."""

    id: str
    prompts: dict[str, str]
    round: int
    resources_version: int = 0
    parent: str | None = None
    edited: str | None = None  #: the prompt name this candidate rewrote (None for the initial one)
    critique: str | None = None
    val_reward: float | None = None
    val_rollouts: int = 0
    train_rewards: list[float] = field(default_factory=list)

    @property
    def versions(self) -> dict[str, str]:
        return {name: prompt_version(text) for name, text in self.prompts.items()}

    def record(self) -> dict[str, Any]:
        out = asdict(self)
        out["versions"] = self.versions
        return out


# ------------------------------------------------------------------------------------ settings


@dataclass
class _Setup:
    """What APO needs from the run it is part of (the Trainer's settings, or the CLI's)."""

    backend: Any = "transformers"
    model: Any = None
    model_name: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    vllm_url: str | None = None
    script: Any = None
    gateway_url: str | None = None
    store: Any = None
    runners: int = 4
    run_dir: Path = Path("runs/apo")
    sampling: dict[str, Any] = field(default_factory=dict)
    agents: Any = None
    seed: int = 0
    progress: bool = True
    rollout_config: RolloutConfig = field(default_factory=RolloutConfig)
    round_timeout_s: float | None = None

    @classmethod
    def from_trainer(cls, trainer: Any) -> _Setup:
        """The trainer's run settings (read by name, so the Trainer can keep its own structure)."""
        cfg = getattr(trainer, "config", None)

        def get(name: str, default: Any = None, *aliases: str) -> Any:
            for key in (name, *aliases):
                for obj in (trainer, cfg):
                    if obj is not None and hasattr(obj, key):
                        return getattr(obj, key)
            return default

        return cls(
            backend=get("backend_arg", "transformers", "backend"),
            model=get("model_arg", None, "model"),
            model_name=get("model_name"),
            base_url=get("base_url"),
            api_key=get("api_key"),
            vllm_url=get("vllm_url"),
            script=get("script"),
            gateway_url=get("gateway_url"),
            store=get("store_arg", None, "store"),
            runners=int(get("runners", 4)),
            run_dir=Path(get("run_dir", "runs/apo")),
            sampling=dict(get("sampling", {}) or {}),
            agents=get("agents"),
            seed=int(get("seed", 0)),
            progress=bool(get("progress", True)),
            rollout_config=get("rollout_config", None) or RolloutConfig(),
            round_timeout_s=get("step_timeout_s"),
        )


def _as_tasks(data: Iterable[Any] | None, mode: Literal["train", "val", "test"]) -> list[Task]:
    tasks: list[Task] = []
    for i, item in enumerate(data or []):
        if isinstance(item, Task):
            tasks.append(item.model_copy(update={"mode": mode}))
        else:
            tasks.append(Task(id=f"{mode}-{i}", input=item, mode=mode))
    return tasks


def _mean(xs: Sequence[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None


# ------------------------------------------------------------------------------------ environment


class _Env:
    """The running pieces: the agent's store, gateway and runners, and the optimiser's gateway."""

    def __init__(self, apo: APO, setup: _Setup, agent: Any) -> None:
        self.apo = apo
        self.setup = setup
        self._stack = contextlib.ExitStack()
        self._runner: Any = None
        self._runner_thread: threading.Thread | None = None
        try:
            self._start(agent)
        except BaseException:
            self.close()
            raise

    def _open(self, spec: Any, default_path: Path) -> Any:
        import agl.store

        if spec is None:
            default_path.parent.mkdir(parents=True, exist_ok=True)
            return agl.store.open(f"sqlite:///{default_path.resolve()}")
        return agl.store.open(spec) if isinstance(spec, str) else spec

    def _agent_backend(self) -> Any:
        s = self.setup
        backend = s.backend
        if not isinstance(backend, str):
            return backend
        from agl import gateway

        if backend == "scripted":
            if s.script is None:
                raise ValueError(
                    "backend='scripted' needs script= (replies, see agl.gateway.ScriptedBackend)"
                )
            return gateway.ScriptedBackend(s.script, accept_any_model=True, on_exhausted="repeat")
        if backend == "openai":
            if not s.base_url or not s.model_name:
                raise ValueError(
                    "the openai backend needs base_url (an OpenAI-compatible endpoint) and the model's "
                    "name (Trainer model_name=, agl apo --model)"
                )
            return gateway.OpenAIBackend(
                s.base_url, api_key=s.api_key, models=[s.model_name] if s.model_name else []
            )
        if backend == "vllm":
            if not s.vllm_url:
                raise ValueError("backend='vllm' needs vllm_url")
            return gateway.VLLMBackend(s.vllm_url, model=s.model_name)
        if backend != "transformers":
            raise ValueError(f"unknown backend {backend!r}")
        model = s.model
        if model is None:
            from agl.gateway.models import prepare_default_model

            model = str(prepare_default_model(progress=s.progress))
        name = s.model_name or (Path(str(model)).name if isinstance(model, (str, os.PathLike)) else None)
        return gateway.TransformersBackend(
            str(model) if isinstance(model, os.PathLike) else model, model_name=name
        )

    def _serve(self, backend: Any, store: Any) -> str:
        from agl.gateway.app import create_app
        from agl.gateway.testing import serve_asgi

        root = self._stack.enter_context(serve_asgi(create_app(backend, store), startup_timeout_s=900.0))
        return root + "/v1"

    def _start(self, agent: Any) -> None:
        from agl.runner import Runner

        s, apo = self.setup, self.apo
        self.store = self._open(s.store, s.run_dir / "store.db")
        if s.gateway_url:
            url = s.gateway_url.rstrip("/")
            self.agent_url = url if url.endswith("/v1") else url + "/v1"
            self.model_name = s.model_name or "model"
        else:
            backend = self._agent_backend()
            self.agent_url = self._serve(backend, self.store)
            models = backend.models()
            self.model_name = s.model_name or (models[0] if models else "model")
        # The optimiser: its own backend, or any OpenAI-compatible URL, or (by default) the agent's own
        # model through the agent's gateway — always behind a gateway that records its calls.
        self.opt_store = self._open(apo.optimizer_store, s.run_dir / "optimizer.db")
        if self.opt_store is self.store:
            raise ValueError(
                "optimizer_store must not be the agent's store: runners would claim the optimiser's rollouts"
            )
        if apo.optimizer_backend is not None:
            opt_backend = apo.optimizer_backend
        else:
            from agl import gateway

            url = apo.optimizer_base_url or self.agent_url
            opt_backend = gateway.OpenAIBackend(
                url,
                api_key=apo.optimizer_api_key or (None if apo.optimizer_base_url else "agl"),
                models=[apo.optimizer_model] if apo.optimizer_model else [],
                timeout_s=apo.optimizer_timeout_s,
            )
        self.opt_url = self._serve(opt_backend, self.opt_store)
        opt_models = opt_backend.models() if hasattr(opt_backend, "models") else []
        self.opt_model = apo.optimizer_model or (opt_models[0] if opt_models else self.model_name)
        if s.runners > 0:
            self._runner = Runner(
                agent, self.store, concurrency=s.runners, claim_timeout_s=1.0, worker_id="agl-apo"
            )
            self._runner_thread = threading.Thread(
                target=self._run_runner, name="agl-apo-runners", daemon=True
            )
            self._runner_thread.start()

    def _run_runner(self) -> None:
        import asyncio

        try:
            asyncio.run(self._runner.run_async())
        except Exception:  # noqa: BLE001
            log.exception("agl apo: the in-process runner crashed")

    def close(self) -> None:
        if self._runner is not None:
            self._runner.stop(now=True)
            if self._runner_thread is not None:
                self._runner_thread.join(timeout=30)
            self._runner = None
        with contextlib.suppress(Exception):
            from agl.tracing import flush

            flush(10.0)
        self._stack.close()


# ------------------------------------------------------------------------------------ algorithm


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

    rounds: int = 3
    beam_width: int = 2
    branch_factor: int = 2
    rollouts_per_candidate: int = 8
    max_optimizer_tokens: int | None = None
    prompts: dict[str, str] | None = None
    agents: Sequence[str] | None = None
    optimizer_base_url: str | None = None
    optimizer_model: str | None = None
    optimizer_api_key: str | None = None
    optimizer_backend: Any = None
    optimizer_store: Any = None
    optimizer_sampling: dict[str, Any] = field(
        default_factory=lambda: {"temperature": 1.0, "max_tokens": 1024}
    )
    optimizer_timeout_s: float = 600.0
    rewrite_format: Literal["json", "text"] = "json"
    repair_retries: int = 1
    failure_below: float = 1.0
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
                raise ValueError(
                    f"APO {name} must be an integer >= {0 if name == 'rounds' else 1}, got {value!r}"
                )
        if self.max_optimizer_tokens is not None and (
            isinstance(self.max_optimizer_tokens, bool)
            or not isinstance(self.max_optimizer_tokens, int)
            or self.max_optimizer_tokens < 1
        ):
            raise ValueError(
                f"max_optimizer_tokens must be a positive integer or None, got {self.max_optimizer_tokens!r}"
            )
        if self.rewrite_format not in ("json", "text"):
            raise ValueError(f"rewrite_format must be 'json' or 'text', got {self.rewrite_format!r}")
        if self.repair_retries < 0:
            raise ValueError("repair_retries must be >= 0")
        if not math.isfinite(self.failure_below):
            raise ValueError("failure_below must be finite")
        if self.prompts is not None:
            if not isinstance(self.prompts, dict) or not self.prompts:
                raise ValueError("prompts must be a non-empty dict {name: template} or None")
            for name, text in self.prompts.items():
                if not isinstance(name, str) or not name or not isinstance(text, str) or not text.strip():
                    raise ValueError(f"prompts: {name!r} must map to a non-empty template string")
                try:
                    placeholders(text)
                except ValueError as exc:
                    raise ValueError(f"prompts[{name!r}] is not a valid f-string template: {exc}") from None
        if isinstance(self.agents, str):
            self.agents = [self.agents]
        if self.optimizer_base_url is not None and self.optimizer_backend is not None:
            raise ValueError("give optimizer_base_url or optimizer_backend, not both")

    # ---------------------------------------------------------------------------- entry points
    def fit(
        self, trainer: Any, agent: Any, train: Iterable[Any], val: Iterable[Any] | None = None
    ) -> dict[str, Any]:
        """The Trainer's entry point: run APO with the trainer's model, backend, store, runners and
        run directory."""
        return self.optimize(agent, train, val, setup=_Setup.from_trainer(trainer))

    def optimize(
        self,
        agent: Any,
        train: Iterable[Any],
        val: Iterable[Any] | None,
        *,
        test: Iterable[Any] | None = None,
        setup: _Setup | None = None,
        **settings: Any,
    ) -> dict[str, Any]:
        """Run APO; ``settings`` are the run's settings when not given as ``setup`` (``backend``,
        ``model``, ``base_url``, ``store``, ``runners``, ``run_dir``, ``sampling``, ...). ``test``:
        tasks held out from selection, run with the initial and the best prompts at the end."""
        setup = setup or _Setup(**{k: (Path(v) if k == "run_dir" else v) for k, v in settings.items()})
        train_tasks = _as_tasks(train, "train")
        val_tasks = _as_tasks(val, "val")
        test_tasks = _as_tasks(test, "test")
        if not train_tasks:
            raise ValueError("APO needs at least one training task (their failures drive the rewrites)")
        if not val_tasks:
            raise ValueError("APO needs validation tasks (val=...): candidates are chosen on them")
        return _Run(self, setup, agent, train_tasks, val_tasks, test_tasks).run()


# ------------------------------------------------------------------------------------------ run


class _Run:
    """One APO run: the loop of the module docstring, its bookkeeping and its files."""

    def __init__(
        self, apo: APO, setup: _Setup, agent: Any, train: list[Task], val: list[Task], test: list[Task]
    ) -> None:
        self.apo, self.setup, self.agent = apo, setup, agent
        self.train, self.val, self.test = train, val, test
        self.run_dir = setup.run_dir
        self.rng = random.Random(setup.seed)
        self.history: list[dict[str, Any]] = []
        self.candidates: list[Candidate] = []
        self.tokens_used = 0
        self.opt_calls = 0
        self.opt_failures: dict[str, int] = {}
        self.budget_exhausted = False
        self._order: list[int] = []
        self._known: set[tuple[tuple[str, str], ...]] = set()
        self._next_id = 1
        self._bar: Any = None
        self.env: _Env | None = None

    # -------------------------------------------------------------------------------- files
    def _reset_files(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "candidates.jsonl", "optimizer_failures.jsonl", "best_prompts.json"):
            with contextlib.suppress(FileNotFoundError):
                (self.run_dir / name).unlink()
        prompts_dir = self.run_dir / "prompts"
        if prompts_dir.is_dir():
            for p in prompts_dir.glob("round-*.json"):
                p.unlink()

    def _append(self, name: str, record: dict[str, Any]) -> None:
        with open(self.run_dir / name, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _write_json(self, path: Path, data: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)

    # --------------------------------------------------------------------------------- rollouts
    def _publish(self, prompts: dict[str, str] | None) -> int:
        env = self.env
        assert env is not None
        items: dict[str, Any] = {
            "main": LLM(base_url=env.agent_url, model=env.model_name, sampling=dict(self.setup.sampling))
        }
        for name, text in (prompts or {}).items():
            items[name] = PromptTemplate(template=text)
        return env.store.add_resources(items).version

    def _run_rollouts(
        self, jobs: Sequence[tuple[Candidate | None, int, Task]], label: str
    ) -> list[tuple[Candidate | None, Task, Rollout, float]]:
        """Enqueue (candidate, resources version, task) jobs, wait for all, return their rewards."""
        env = self.env
        assert env is not None
        news = []
        for cand, version, task in jobs:
            meta: dict[str, Any] = {"apo": {"label": label}}
            if cand is not None:
                meta["apo"].update(
                    {"candidate": cand.id, "round": cand.round, "prompt_versions": cand.versions}
                )
            news.append(
                NewRollout.from_task(
                    task,
                    group_id=f"apo-{label}-{cand.id if cand else 'base'}",
                    resources_version=version,
                    config=self.setup.rollout_config,
                    metadata=meta,
                )
            )
        stored = env.store.enqueue(news) if news else []
        ids = [r.id for r in stored]
        pending = set(ids)
        done: dict[str, Rollout] = {}
        deadline = (
            None if self.setup.round_timeout_s is None else time.monotonic() + self.setup.round_timeout_s
        )
        shown = -1
        while pending:
            for r in env.store.wait_for_rollouts(sorted(pending), timeout_s=0.5):
                if r.id in pending:
                    pending.discard(r.id)
                    done[r.id] = r
            if self._bar is not None and len(done) != shown:
                shown = len(done)
                self._bar.set_postfix_str(f"{label}: {len(done)}/{len(ids)} rollouts", refresh=True)
            if deadline is not None and pending and time.monotonic() > deadline:
                log.warning(
                    "agl apo: %s: %d rollouts did not finish in time; cancelling them", label, len(pending)
                )
                for rid in list(pending):
                    with contextlib.suppress(Exception):
                        env.store.cancel(rid)
                deadline = None
        out = []
        for (cand, _, task), rid in zip(jobs, ids, strict=True):
            r = done[rid]
            out.append((cand, task, r, self._reward(r)))
        return out

    def _attempt_spans(self, rollout: Rollout) -> list[Span]:
        from agl.adapter import finishing_attempt

        att = finishing_attempt(rollout)
        if att is None:
            return []
        assert self.env is not None
        return self.env.store.query_spans(rollout_id=rollout.id, attempt=att, include_stale=False)

    def _reward(self, rollout: Rollout) -> float:
        """The attempt's last primary reward; 0 for a rollout that failed without one or was cancelled."""
        if rollout.status == "cancelled":
            return 0.0
        from agl.adapter import finishing_attempt

        att = finishing_attempt(rollout)
        if att is None:
            return 0.0
        assert self.env is not None
        spans = self.env.store.query_spans(
            rollout_id=rollout.id, attempt=att, name=sc.SPAN_REWARD, include_stale=False
        )
        values = [
            s.attributes.get(sc.AGL_REWARD_VALUE)
            for s in spans
            if s.attributes.get(sc.AGL_REWARD_PRIMARY, True)
        ]
        values = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
        return values[-1] if values else 0.0

    def _evaluate(self, cands: Sequence[Candidate], label: str) -> None:
        jobs = [(c, c.resources_version, t) for c in cands for t in self.val]
        results = self._run_rollouts(jobs, label)
        for c in cands:
            rs = [rew for cand, _, _, rew in results if cand is c]
            c.val_reward, c.val_rollouts = _mean(rs), len(rs)

    def _train_batch(self) -> list[Task]:
        batch = []
        while len(batch) < self.apo.rollouts_per_candidate:
            if not self._order:
                self._order = list(range(len(self.train)))
                self.rng.shuffle(self._order)
            batch.append(self.train[self._order.pop()])
        return batch

    # ---------------------------------------------------------------------------- the optimiser
    def _chat(self, messages: list[dict[str, str]], kind: str, meta: dict[str, Any]) -> str:
        """One optimiser call through its gateway, recorded as a rollout of the optimiser store."""
        import httpx

        env = self.env
        assert env is not None
        sampling = dict(self.apo.optimizer_sampling)
        max_tokens = int(sampling.pop("max_tokens", 1024))
        if self.apo.max_optimizer_tokens is not None:
            left = self.apo.max_optimizer_tokens - self.tokens_used - estimate_tokens(messages)
            if left < min(64, max_tokens):
                self.budget_exhausted = True
                raise _BudgetExhausted()
            max_tokens = min(max_tokens, left)
        rid = f"apo-opt-{uuid.uuid4().hex[:12]}"
        env.opt_store.enqueue(
            [
                NewRollout(
                    id=rid,
                    input={"kind": kind, **meta},
                    mode="test",
                    config=RolloutConfig(lease_s=max(3600.0, 2 * self.apo.optimizer_timeout_s)),
                    metadata={"apo": {"optimizer": kind, **meta}},
                )
            ]
        )
        claim = env.opt_store.claim("agl-apo-optimizer", timeout_s=5.0, modes=["test"])
        if claim is None or claim.rollout.id != rid:  # someone else shares the optimiser store
            raise RuntimeError("the optimiser store handed out another rollout: give APO a store of its own")
        self.opt_calls += 1
        body = {"model": env.opt_model, "messages": messages, "max_tokens": max_tokens, **sampling}
        url = f"{env.opt_url[: -len('/v1')]}/rollouts/{rid}/attempts/1/v1/chat/completions"
        status, error = "failed", None
        try:
            try:
                resp = httpx.post(url, json=body, timeout=self.apo.optimizer_timeout_s)
            except httpx.HTTPError as exc:
                raise OptimizerError("http_error", f"the optimiser call failed: {exc!r}") from None
            data: Any = None
            with contextlib.suppress(ValueError):
                data = resp.json()
            usage = (data or {}).get("usage") if isinstance(data, dict) else None
            if isinstance(usage, dict):
                self.tokens_used += int(usage.get("prompt_tokens") or 0) + int(
                    usage.get("completion_tokens") or 0
                )
            else:
                self.tokens_used += estimate_tokens(messages)
            if resp.status_code >= 400:
                detail = (data or {}).get("error", {}).get("message") if isinstance(data, dict) else resp.text
                raise OptimizerError(
                    "http_error", f"the optimiser answered {resp.status_code}: {str(detail)[:300]}"
                )
            try:
                text = data["choices"][0]["message"].get("content") or ""
            except (TypeError, KeyError, IndexError, AttributeError):
                raise OptimizerError("bad_response", f"not a chat completion: {str(data)[:200]}") from None
            status = "succeeded"
            return str(text)
        except OptimizerError as exc:
            from agl.types import AttemptError

            error = AttemptError(type=exc.reason, message=str(exc))
            raise
        finally:
            with contextlib.suppress(Exception):
                env.opt_store.finish_attempt(rid, 1, status, error=error)

    def _critique(
        self, cand: Candidate, name: str, failures: list[tuple[Task, Rollout, float]], meta: dict[str, Any]
    ) -> str:
        apo = self.apo
        rewards = cand.train_rewards
        parts = [
            f'The agent "{name}" runs with this prompt:\n<prompt>\n{cand.prompts[name]}\n</prompt>\n',
            f"With it the agent scored a mean reward of {_mean(rewards) or 0.0:.2f} on {len(rewards)} "
            f"training tasks. Here are {len(failures)} tasks it failed, with what happened:\n",
        ]
        for i, (task, rollout, reward) in enumerate(failures, 1):
            trace = summarize_trace(self._attempt_spans(rollout), max_chars=apo.trace_chars)
            err = rollout.attempts[-1].error if rollout.attempts else None
            parts.append(
                f"### Failure {i} (reward {reward:g})\nTask: {clip(json.dumps(task.input, ensure_ascii=False), 600)}\n"
                + (f"Error: {err.type}: {clip(err.message, 300)}\n" if err is not None else "")
                + f"Trace:\n{trace}\n"
            )
        parts.append(
            "What in the prompt makes the agent fail on these tasks, and what should the prompt say "
            "instead? Be brief and concrete."
        )
        messages = [
            {"role": "system", "content": apo.critique_system},
            {"role": "user", "content": "\n".join(parts)},
        ]
        critique = self._chat(messages, "critique", meta).strip()
        if not critique:
            raise OptimizerError("empty_critique", "the optimiser's critique was empty")
        return critique

    def _rewrite(self, cand: Candidate, name: str, critique: str, meta: dict[str, Any]) -> str:
        apo = self.apo
        old = cand.prompts[name]
        keep = sorted(placeholders(old))
        ask = JSON_ASK if apo.rewrite_format == "json" else TEXT_ASK
        user = (
            f'The agent "{name}" runs with this prompt:\n<prompt>\n{old}\n</prompt>\n\n'
            f"A critique of it, from traces of tasks it failed:\n{critique}\n\n"
            "Write the improved prompt."
            + (
                " Keep these placeholders exactly as they are: "
                + ", ".join("{" + k + "}" for k in keep)
                + "."
                if keep
                else " Do not use curly braces."
            )
            + f" {ask}"
        )
        messages = [{"role": "system", "content": apo.rewrite_system}, {"role": "user", "content": user}]
        reply = self._chat(messages, "rewrite", meta)
        for attempt in range(apo.repair_retries + 1):
            try:
                new = parse_rewrite(reply, apo.rewrite_format)
                break
            except OptimizerError as exc:
                if exc.reason != "bad_json" or attempt == apo.repair_retries:
                    raise
                self._note_failure(exc, meta, retried=True)
                messages = [
                    *messages,
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": REPAIR_ASK},
                ]
                reply = self._chat(messages, "rewrite-repair", meta)
        try:
            got = placeholders(new)
        except ValueError as exc:
            raise OptimizerError("bad_template", f"the rewrite is not a valid template ({exc})") from None
        if got != set(keep):
            raise OptimizerError(
                "placeholders",
                f"the rewrite has placeholders {sorted(got)}, the prompt needs exactly {keep}",
            )
        return new

    def _note_failure(self, exc: OptimizerError, meta: dict[str, Any], *, retried: bool = False) -> None:
        key = exc.reason + ("_retried" if retried else "")
        self.opt_failures[key] = self.opt_failures.get(key, 0) + 1
        self._append(
            "optimizer_failures.jsonl",
            {**meta, "reason": exc.reason, "message": str(exc), "retried": retried},
        )
        log.warning(
            "agl apo: optimiser %s (%s): %s",
            "reply sent back for repair" if retried else "failure",
            exc.reason,
            exc,
        )

    def _expand(
        self, parent: Candidate, failures: list[tuple[Task, Rollout, float]], names: list[str], rnd: int
    ) -> list[Candidate]:
        children: list[Candidate] = []
        known = self._known
        for b in range(self.apo.branch_factor):
            name = names[(rnd + b + len(self.candidates)) % len(names)]
            meta = {"round": rnd, "parent": parent.id, "branch": b, "prompt": name}
            try:
                critique = self._critique(parent, name, failures, meta)
                new = self._rewrite(parent, name, critique, meta)
            except _BudgetExhausted:
                break
            except OptimizerError as exc:
                self._note_failure(exc, meta)
                continue
            prompts = {**parent.prompts, name: new}
            child = Candidate(
                id=f"c{self._next_id}",
                prompts=prompts,
                round=rnd,
                parent=parent.id,
                edited=name,
                critique=critique,
            )
            key = tuple(sorted(child.versions.items()))
            if key in known:
                self._note_failure(
                    OptimizerError("duplicate", "the rewrite repeats a prompt already tried"), meta
                )
                continue
            known.add(key)
            self._next_id += 1
            children.append(child)
        return children

    # ---------------------------------------------------------------------------------- the loop
    def _discover(self, results: list[tuple[Candidate | None, Task, Rollout, float]]) -> dict[str, str]:
        """The agent's default prompts, from the ``agl.prompt`` spans of a baseline run."""
        found: dict[str, str] = {}
        assert self.env is not None
        for _, _, rollout, _ in results:
            for s in self.env.store.query_spans(rollout_id=rollout.id, name=sc.SPAN_PROMPT):
                name, text = s.attributes.get(sc.AGL_PROMPT_NAME), s.attributes.get(sc.AGL_PROMPT_TEMPLATE)
                if isinstance(name, str) and isinstance(text, str) and name not in found:
                    found[name] = text
        return found

    def _selected(self, prompts: dict[str, str]) -> list[str]:
        wanted = self.apo.agents if self.apo.agents is not None else self.setup.agents
        if wanted is None:
            return sorted(prompts)
        if isinstance(wanted, str):
            wanted = [wanted]
        names = [str(n) for n in wanted]
        missing = [n for n in names if n not in prompts]
        if missing:
            raise ValueError(
                f"APO agents {missing} have no prompt (prompts: {', '.join(sorted(prompts)) or 'none'}); "
                "the agent must read them with agl.prompt(name, default=...), or pass APO(prompts=...)"
            )
        return names

    def _log_round(
        self,
        rnd: int,
        beam: list[Candidate],
        new: list[Candidate],
        round_s: float,
        train_reward: float | None,
    ) -> None:
        best = beam[0]
        record: dict[str, Any] = {
            "step": rnd,
            "round": rnd,
            "algorithm": "apo",
            "val_reward": best.val_reward,
            "train_reward": train_reward,
            "best_candidate": best.id,
            "beam": [c.id for c in beam],
            "beam_val_rewards": [c.val_reward for c in beam],
            "new_candidates": [c.id for c in new],
            "candidate_val_rewards": [c.val_reward for c in new],
            "candidates_total": len(self.candidates),
            "optimizer_calls": self.opt_calls,
            "optimizer_tokens": self.tokens_used,
            "optimizer_failures": sum(self.opt_failures.values()),
            "budget_exhausted": self.budget_exhausted,
            "resources_version": best.resources_version,
            "round_s": round_s,
        }
        self.history.append(record)
        self._append("metrics.jsonl", record)
        self._write_json(
            self.run_dir / "prompts" / f"round-{rnd}.json",
            {
                "round": rnd,
                "candidate": best.id,
                "val_reward": best.val_reward,
                "prompts": best.prompts,
                "versions": best.versions,
            },
        )
        if self._bar is not None:
            self._bar.set_postfix(
                {
                    "best_val": f"{best.val_reward:.3f}" if best.val_reward is not None else "-",
                    "opt_tokens": self.tokens_used,
                },
                refresh=True,
            )

    def run(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        apo, t_start = self.apo, time.perf_counter()
        self._reset_files()
        self.env = _Env(apo, self.setup, self.agent)
        try:
            self._bar = tqdm(
                total=apo.rounds + 1,
                desc="agl apo",
                unit="round",
                disable=not self.setup.progress,
                dynamic_ncols=True,
            )
            t0 = time.perf_counter()
            # Round 0: the initial prompts on the validation set (and, without prompts=, learn them).
            if apo.prompts is None:
                base_version = self._publish(None)
                results = self._run_rollouts([(None, base_version, t) for t in self.val], "round0-val")
                initial = self._discover(results)
                if not initial:
                    raise ValueError(
                        "the agent read no prompt through agl.prompt(): make it read its prompt with "
                        "agl.prompt(name, default=...) or pass APO(prompts={name: template})"
                    )
                c0 = Candidate(id="c0", prompts=initial, round=0)
                rs = [rew for *_, rew in results]
                c0.val_reward, c0.val_rollouts = _mean(rs), len(rs)
                c0.resources_version = self._publish(c0.prompts)
            else:
                c0 = Candidate(id="c0", prompts=dict(apo.prompts), round=0)
                c0.resources_version = self._publish(c0.prompts)
                self._evaluate([c0], "round0-val")
            names = self._selected(c0.prompts)
            self.candidates.append(c0)
            self._known.add(tuple(sorted(c0.versions.items())))
            self._append("candidates.jsonl", c0.record())
            beam = [c0]
            self._bar.update(1)
            self._log_round(0, beam, [c0], time.perf_counter() - t0, None)
            for rnd in range(1, apo.rounds + 1):
                if self.budget_exhausted:
                    break
                t0 = time.perf_counter()
                batch = self._train_batch()
                results = self._run_rollouts(
                    [(c, c.resources_version, t) for c in beam for t in batch], f"round{rnd}-train"
                )
                children: list[Candidate] = []
                train_all: list[float] = []
                for parent in beam:
                    mine = [(task, r, rew) for cand, task, r, rew in results if cand is parent]
                    parent.train_rewards = [rew for *_, rew in mine]
                    train_all.extend(parent.train_rewards)
                    failures = sorted(
                        [m for m in mine if m[2] < apo.failure_below or m[1].status != "succeeded"],
                        key=lambda m: m[2],
                    )[: apo.max_failures]
                    if not failures:
                        continue
                    children.extend(self._expand(parent, failures, names, rnd))
                    if self.budget_exhausted:
                        break
                for child in children:
                    child.resources_version = self._publish(child.prompts)
                if children:
                    self._evaluate(children, f"round{rnd}-val")
                for child in children:
                    self.candidates.append(child)
                    self._append("candidates.jsonl", child.record())
                order = {c.id: i for i, c in enumerate(self.candidates)}
                pool = beam + children
                pool.sort(
                    key=lambda c: (-(c.val_reward if c.val_reward is not None else -math.inf), order[c.id])
                )
                beam = pool[: apo.beam_width]
                self._bar.update(1)
                self._log_round(rnd, beam, children, time.perf_counter() - t0, _mean(train_all))
            best = beam[0]
            summary: dict[str, Any] = {
                "run_dir": str(self.run_dir),
                "rounds": len(self.history) - 1,
                "val_reward_before": c0.val_reward,
                "val_reward_after": best.val_reward,
                "best_candidate": best.id,
                "best_prompts": best.prompts,
                "best_versions": best.versions,
                "best_resources_version": best.resources_version,
                "candidates": len(self.candidates),
                "optimizer_calls": self.opt_calls,
                "optimizer_tokens": self.tokens_used,
                "optimizer_failures": dict(self.opt_failures),
                "budget_exhausted": self.budget_exhausted,
            }
            if self.test:
                ends = [c0] if best is c0 else [c0, best]
                jobs = [(c, c.resources_version, t) for c in ends for t in self.test]
                results = self._run_rollouts(jobs, "test")
                for c, key in ((c0, "test_reward_before"), (best, "test_reward_after")):
                    summary[key] = _mean([rew for cand, _, _, rew in results if cand is c])
                summary["test_tasks"] = len(self.test)
            summary["wall_s"] = time.perf_counter() - t_start
            self._bar.close()
        finally:
            self.env.close()
        self._write_json(
            self.run_dir / "best_prompts.json", {k: v for k, v in summary.items() if k != "history"}
        )
        with contextlib.suppress(Exception):
            from agl.plot import plot_run

            plot_run(self.run_dir)
        summary["history"] = self.history
        return summary


# ------------------------------------------------------------------------------------------ CLI


def load_jsonl(path: str | os.PathLike[str]) -> list[Any]:
    """Task inputs, one JSON value per line (blank lines skipped); errors name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such task file: {p}")
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as exc:
            raise ValueError(f"{p}:{n} is not JSON: {exc}") from None
    if not out:
        raise ValueError(f"{p} holds no tasks")
    return out


def register_cli(parser: Any) -> None:
    """``agl apo``: optimise an agent's prompts (see the module docstring)."""
    a = parser.add_argument
    a("--agent", required=True, help="the agent function as module:function (reads agl.prompt)")
    a("--train", required=True, help="training tasks (JSONL, one task input per line)")
    a("--val", required=True, help="validation tasks (JSONL): candidates are chosen on them")
    a("--test", default=None, help="held-out tasks (JSONL): initial vs best prompt at the end")
    a(
        "--prompt",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="a starting prompt (default: the agent's own)",
    )
    a("--agents", action="append", default=None, metavar="NAME", help="optimise only these prompts")
    g = parser.add_argument_group("optimiser (any OpenAI-compatible endpoint; default: the agent's model)")
    g.add_argument("--optimizer-base-url", default=None)
    g.add_argument("--optimizer-model", default=None)
    g.add_argument("--optimizer-api-key", default=None, help="default: $OPENAI_API_KEY")
    g.add_argument("--optimizer-temperature", type=float, default=1.0)
    g.add_argument("--optimizer-max-tokens", type=int, default=1024, help="per optimiser reply")
    g.add_argument("--rewrite-format", choices=["json", "text"], default="json")
    b = parser.add_argument_group("budgets")
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--beam-width", type=int, default=2)
    b.add_argument("--branch-factor", type=int, default=2)
    b.add_argument("--rollouts-per-candidate", type=int, default=8)
    b.add_argument("--max-optimizer-tokens", type=int, default=None)
    b.add_argument("--failure-below", type=float, default=1.0, help="a reward below this is a failure")
    m = parser.add_argument_group("the agent's model")
    m.add_argument("--base-url", default=None, help="an OpenAI-compatible endpoint for the agent")
    m.add_argument("--model", default=None, help="model name at --base-url, or a local model path")
    m.add_argument("--api-key", default=None, help="API key for --base-url (default: $OPENAI_API_KEY)")
    m.add_argument("--vllm-url", default=None, help="a vLLM server for the agent instead")
    m.add_argument("--temperature", type=float, default=0.0)
    m.add_argument("--max-tokens", type=int, default=256)
    r = parser.add_argument_group("run")
    r.add_argument("--store", default=None, help="store URL (default: sqlite in --run-dir)")
    r.add_argument("--runners", type=int, default=4, help="rollouts run at once (0: external agl runner)")
    r.add_argument("--run-dir", default="runs/apo")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=_cli)


def _cli(args: Any) -> int:
    from agl.runner import load_agent
    from agl.trainer import Trainer

    prompts: dict[str, str] = {}
    for spec in args.prompt:
        name, sep, path = spec.partition("=")
        if not sep or not name:
            raise ValueError(f"--prompt must be NAME=FILE, got {spec!r}")
        prompts[name] = Path(path).read_text().strip()
    apo = APO(
        rounds=args.rounds,
        beam_width=args.beam_width,
        branch_factor=args.branch_factor,
        rollouts_per_candidate=args.rollouts_per_candidate,
        max_optimizer_tokens=args.max_optimizer_tokens,
        prompts=prompts or None,
        agents=args.agents,
        optimizer_base_url=args.optimizer_base_url,
        optimizer_model=args.optimizer_model,
        optimizer_api_key=args.optimizer_api_key,
        optimizer_sampling={
            "temperature": args.optimizer_temperature,
            "max_tokens": args.optimizer_max_tokens,
        },
        rewrite_format=args.rewrite_format,
        failure_below=args.failure_below,
    )
    train, val = load_jsonl(args.train), load_jsonl(args.val)
    test = load_jsonl(args.test) if args.test else None
    agent = load_agent(args.agent)
    backend = "openai" if args.base_url else ("vllm" if args.vllm_url else "transformers")
    trainer = Trainer(
        apo,
        model=args.model if backend == "transformers" else None,
        backend=backend,
        base_url=args.base_url,
        api_key=args.api_key,
        vllm_url=args.vllm_url,
        model_name=args.model if backend != "transformers" else None,
        store=args.store,
        runners=args.runners,
        run_dir=args.run_dir,
        sampling={"temperature": args.temperature, "max_tokens": args.max_tokens},
        seed=args.seed,
        progress=not args.no_progress,
    )
    if test is None:
        summary = trainer.fit(agent, train, val)
    else:  # the Trainer's fit has no held-out test split; the same run, with one
        summary = apo.optimize(agent, train, val, test=test, setup=_Setup.from_trainer(trainer))
    summary.pop("history", None)
    print(json.dumps(summary, indent=2))
    return 0
