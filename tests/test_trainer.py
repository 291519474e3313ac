"""Trainer.fit end to end on the mechanics: a tiny random Llama (with the shipped SmolLM2 tokenizer)
as the policy, the scripted gateway backend as the engine, the real openai client as the agent's LLM
client, a memory store, and runners that run (and die) for real.

Asserts: rewarded responses become likelier and penalised ones less likely; only the selected agent's
transitions are trained on; a runner that dies mid-rollout (lease expiry) has its rollout retried and
its stale spans are never trained on; metrics, checkpoints, resume, the plot and ``dev`` work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")
openai = pytest.importorskip("openai")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.algorithms.update import PolicyUpdate  # noqa: E402
from agl.config import LoopConfig, RolloutSettings, RunConfig  # noqa: E402
from agl.run.settings import Serving  # noqa: E402
from agl.runner.runner import Runner  # noqa: E402
from agl.store.memory import MemoryStore  # noqa: E402
from agl.tracing import provider as tracing  # noqa: E402
from agl.trainer.trainer import Trainer, load_tokenizer  # noqa: E402
from agl.types import Transition  # noqa: E402

GOOD = "Answer: 42"
BAD = "I am not sure."
CHECKED = "Looks fine to me."
STALE = "This reply belongs to a dead runner."


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _instrumented() -> Iterator[None]:
    agl.instrument("openai")
    yield
    agl.uninstrument()
    tracing.reset_tracing()


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=49152,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        )
    )


class Script:
    """The engine: the writer's replies alternate between a good and a bad answer (so every GRPO
    group has both); the checker always approves; a dying runner's call gets a marked reply."""

    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()

    def __call__(self, request: Any) -> str:
        system = request.messages[0]["content"] if request.messages else ""
        if "checker" in system:
            return CHECKED
        if "dying" in system:
            return STALE
        with self.lock:
            self.n += 1
            return GOOD if self.n % 2 else BAD


def _agent_span(name: str) -> Any:
    return tracing.get_tracer("tests.agent").start_as_current_span(
        sc.SPAN_INVOKE_AGENT,
        attributes={sc.GEN_AI_OPERATION_NAME: sc.OP_INVOKE_AGENT, sc.GEN_AI_AGENT_NAME: name},
    )


def _ask(client: Any, model: str, system: str, question: str) -> str:
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=16,
    )
    return out.choices[0].message.content or ""


def two_agent_app(task: dict, resources: agl.Resources, *, dying: bool = False) -> float:
    """A writer answers (trained); a checker reviews (not selected for training)."""
    llm = resources.llm
    assert llm is not None
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "x")
    with _agent_span("writer"):
        answer = _ask(client, llm.model, "dying writer" if dying else "You are the writer.", task["q"])
    with _agent_span("checker"):
        _ask(client, llm.model, "You are the checker.", f"Check: {answer}")
    return 1.0 if answer.strip() == GOOD else 0.0


class Spy:
    """Wraps the real PolicyUpdate.step: records what was trained on and the probe probabilities."""

    def __init__(self, tok: Any) -> None:
        self.batches: list[list[Transition]] = []
        self.before: list[float] | None = None
        self.probe: list[Transition] | None = None
        self.tok = tok

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = PolicyUpdate.step
        spy = self

        def step(self_: PolicyUpdate, transitions: Any, advantages: Any) -> dict[str, float]:
            spy.batches.append(list(transitions))
            if spy.probe is None:
                prompt = transitions[0].prompt_ids
                eos = (spy.tok.eos_token_id,)
                spy.probe = [
                    Transition(
                        rollout_id="probe",
                        attempt=1,
                        index=0,
                        prompt_ids=prompt,
                        response_ids=tuple(spy.tok(text, add_special_tokens=False)["input_ids"]) + eos,
                    )
                    for text in (GOOD, BAD)
                ]
                spy.before = [sum(x) for x in self_.response_logprobs(spy.probe)]
            return real(self_, transitions, advantages)

        monkeypatch.setattr(PolicyUpdate, "step", step)


def test_fit_trains_the_selected_agent_and_skips_stale_spans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = load_tokenizer()
    spy = Spy(tok)
    spy.install(monkeypatch)
    store = MemoryStore()
    algo = agl.LightningRL(group_size=4, learning_rate=2e-2, lora_r=8, lora_alpha=16)
    trainer = Trainer(
        algo,
        model=tiny_model(),
        serving=Serving(
            backend="scripted",
            script=Script(),
            store=store,
            runners=0,  # the test runs the runners itself: a healthy one and one that dies
            run_dir=tmp_path / "run",
            tokenizer=tok,
            progress=False,
        ),
        loop=LoopConfig(tasks_per_step=2, steps=4, val_every=2),
        rollout=RolloutSettings(lease_s=1.0, max_attempts=3),
        agents=["writer"],
    )
    train = [{"q": f"What is {i} * 6?"} for i in range(4)]
    val = [{"q": "What is 7 * 6?"}]

    def dying_agent(task: dict, resources: agl.Resources) -> float:
        reward = two_agent_app(task, resources, dying=True)
        time.sleep(2.5)  # no heartbeats (heartbeat_s=100): the lease expires, as when a host dies
        return reward

    dead = Runner(
        dying_agent, store, heartbeat_s=100, claim_timeout_s=0.5, modes=["train"], worker_id="dying"
    )
    healthy = Runner(two_agent_app, store, concurrency=4, claim_timeout_s=0.2, worker_id="healthy")
    fit_result: dict[str, Any] = {}
    fit_thread = threading.Thread(target=lambda: fit_result.update(trainer.fit(two_agent_app, train, val)))
    dead_thread = threading.Thread(target=lambda: asyncio.run(dead.run_async(max_rollouts=1)))
    dead_thread.start()  # waits for work before anyone else does, so it takes the first rollout
    fit_thread.start()
    deadline = time.monotonic() + 60
    while dead.stats.claimed == 0:
        assert time.monotonic() < deadline, "the dying runner never claimed"
        time.sleep(0.02)
    healthy_thread = threading.Thread(target=lambda: asyncio.run(healthy.run_async()))
    healthy_thread.start()
    fit_thread.join(timeout=120)
    healthy.stop(now=True)
    healthy_thread.join(timeout=30)
    dead_thread.join(timeout=30)
    assert not fit_thread.is_alive()
    assert fit_result, "fit() failed"

    # the dying runner's rollout was retried after its lease expired, and its spans are stale
    lost = [r for r in store.query_rollouts() if any(a.status == "lost" for a in r.attempts)]
    assert len(lost) == 1
    rollout = lost[0]
    assert rollout.status == "succeeded" and rollout.attempts[0].worker_id == "dying"
    stale = store.query_spans(rollout_id=rollout.id, attempt=1)
    assert stale and all(s.stale for s in stale)
    assert any(STALE in json.dumps(s.attributes) for s in stale)

    trained = [t for batch in spy.batches for t in batch]
    assert len(spy.batches) == 4
    # only the selected agent's calls, never the dying attempt's
    assert trained and {t.agent for t in trained} == {"writer"}
    assert all(t.response_text in (GOOD, BAD) for t in trained)
    assert not any(t.response_text == CHECKED for t in trained)
    assert [t.attempt for t in trained if t.rollout_id == rollout.id] == [2]
    assert all(t.exact for t in trained)

    # the update moved probability mass from the penalised to the rewarded reply
    after = [sum(x) for x in trainer.policy.response_logprobs(spy.probe)]
    assert spy.before is not None
    assert after[0] > spy.before[0] + 0.5, (spy.before, after)
    assert after[1] < spy.before[1] - 0.5, (spy.before, after)

    # metrics, resources versions, plot
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "train_reward" in r]
    assert [r["step"] for r in train_records] == [0, 1, 2, 3]
    assert [r["step"] for r in records if r.get("val_reward") is not None] == [0, 2, 4]
    for r in train_records:
        assert (
            r["exact_token_ratio"] == 1.0
            and r["transitions"] == 8
            and r["train_reward"] == pytest.approx(0.5, abs=0.26)
        )
        assert {"loss", "kl", "clip_fraction", "tokens_per_s", "zero_variance_groups", "grad_norm"} <= set(r)
        # merging diagnostics: the writer makes one call per rollout, so each is its own sequence,
        # nothing merges, nothing is saved and no prefix broke
        assert r["sequences"] <= r["transitions"] and r["update_tokens"] > 0
        assert (r["merge_rate"], r["tokens_saved"]) == (0.0, 0.0)
        assert all(
            r[f"breaks_{c}"] == 0.0 for c in ("retokenised", "edited", "rerendered", "truncated", "diverged")
        )
    versions = [r["resources_version"] for r in records]
    assert versions == sorted(set(versions))  # bumps every step
    for r in store.query_rollouts(status="succeeded"):
        assert r.resources_version in versions
    assert (tmp_path / "run" / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert any((tmp_path / "run" / "tb").iterdir())
    assert (tmp_path / "run" / "trainer_state.json").exists()


def test_resume_continues_from_the_checkpoint(tmp_path: Path) -> None:
    tok = load_tokenizer()
    serving = Serving(
        backend="scripted",
        script=Script(),
        store="memory://",  # a fresh store for each Trainer: what resumes comes from the run directory
        runners=4,
        run_dir=tmp_path / "run",
        tokenizer=tok,
        progress=False,
    )
    loop = LoopConfig(tasks_per_step=1, val_every=0)
    algo = agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8)

    def trainer(**more: Any) -> Trainer:
        return Trainer(
            algo,
            model=tiny_model(),
            serving=serving,
            loop=dataclasses.replace(loop, **more),
            agents=["writer"],
        )

    first = trainer(steps=1, checkpoint_every=1)
    first.fit(two_agent_app, [{"q": "a"}, {"q": "b"}])
    assert first.policy.global_step == 1
    trained = first.policy.merged_state_dict()
    same = trainer(steps=1, resume=True)  # nothing left to train
    same.fit(two_agent_app, [{"q": "a"}, {"q": "b"}])
    resumed = same.policy.merged_state_dict()
    assert same.policy.global_step == 1
    assert max((trained[k] - resumed[k]).abs().max().item() for k in trained) < 1e-6
    second = trainer(steps=2, resume=True)
    second.fit(two_agent_app, [{"q": "a"}, {"q": "b"}])
    assert second.policy.global_step == 2
    steps = [r["step"] for r in second.history if "train_reward" in r]
    assert steps == [0, 1]  # the first run's step 0 from its metrics, then the resumed step 1
    ckpt = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    assert ckpt["step"] == 2 and Path(ckpt["checkpoint"]).name == "checkpoint-2"


def one_task_trainer(
    tmp_path: Path,
    algo: Any = None,
    *,
    run: str = "run",
    script: Any = None,
    tokenizer: Any = None,
    config: RunConfig | None = None,
    report_to: Any = None,
    **loop: Any,
) -> Trainer:
    """A Trainer on a fresh tiny model and the scripted engine: one training task a step, one step,
    held-out checks at step 0 and the end only, the writer trained (``loop``: LoopConfig fields that
    change any of it; ``config``: the run's sampling; ``report_to``: trackers)."""
    serving = Serving(
        report_to=report_to,
        backend="scripted",
        script=script if script is not None else Script(),
        store="memory://",
        runners=4,
        run_dir=tmp_path / run,
        tokenizer=tokenizer if tokenizer is not None else load_tokenizer(),
        progress=False,
    )
    return Trainer(
        algo or agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8),
        model=tiny_model(),
        serving=serving,
        loop=LoopConfig(**{"tasks_per_step": 1, "steps": 1, "val_every": 0, **loop}),
        config=config,
        agents=["writer"],
    )


def test_resume_on_a_larger_held_out_set_reports_no_stale_before(tmp_path: Path) -> None:
    """Re-checking a finished run on more held-out tasks (--resume, larger --val-tasks) must not report
    the first run's step-0 figure, measured on fewer tasks, as its "before"; the same set still does."""
    algo = agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8)
    train = [{"q": "a"}, {"q": "b"}]
    small, large = [{"q": "What is 7 * 6?"}], [{"q": "What is 7 * 6?"}, {"q": "c"}, {"q": "d"}]
    first = one_task_trainer(tmp_path, algo).fit(two_agent_app, train, small)
    assert first["val_reward_before"] is not None
    recheck = one_task_trainer(tmp_path, algo, resume=True).fit(two_agent_app, train, large)
    assert recheck["history"][-1]["val_rollouts"] == recheck["history"][-1]["val_tasks"] == 3
    assert recheck["val_reward_before"] is None and recheck["val_reward_after"] is not None
    again = one_task_trainer(tmp_path, algo, resume=True).fit(two_agent_app, train, small)
    assert again["val_reward_before"] == first["val_reward_before"]


def test_a_cancelled_held_out_rollout_keeps_the_before_figure(tmp_path: Path) -> None:
    """The "before" figure is compared by the held-out tasks given, not the rollouts that finished with a reward:
    a held-out rollout cancelled by the step timeout in the step-0 check only (a crashed one still
    counts, as reward 0) must not make ``val_reward_before`` None."""
    stalled: list[str] = []

    def stalling_app(task: dict, resources: agl.Resources) -> float:
        if task["q"] == "d" and not stalled:
            stalled.append(task["q"])
            time.sleep(25)  # past step_timeout_s: the trainer cancels it
        return two_agent_app(task, resources)

    summary = one_task_trainer(tmp_path, step_timeout_s=15).fit(
        stalling_app, [{"q": "a"}, {"q": "b"}], [{"q": "What is 7 * 6?"}, {"q": "d"}]
    )
    checks = [h for h in summary["history"] if h.get("val_reward") is not None]
    assert [(h["val_rollouts"], h["val_tasks"]) for h in checks] == [(1, 2), (2, 2)]
    assert summary["val_reward_before"] == checks[0]["val_reward"] is not None


def test_val_before_false_skips_the_first_held_out_check(tmp_path: Path) -> None:
    """A second seed from a measured warm start need not re-measure it: val_before=False validates at
    val_every and at the end only, and reports no 'before' figure rather than a mid-run one."""
    algo = agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8)
    trainer = one_task_trainer(tmp_path, algo, steps=3, val_every=2, val_before=False)
    summary = trainer.fit(two_agent_app, [{"q": "a"}, {"q": "b"}], [{"q": "What is 7 * 6?"}])
    assert [h["step"] for h in summary["history"] if h.get("val_reward") is not None] == [2, 3]
    assert summary["val_reward_before"] is None and summary["val_reward_after"] is not None
    with pytest.raises(ValueError, match="val_before"):
        Trainer(
            algo,
            model=tiny_model(),
            serving=Serving(backend="scripted", script=Script()),
            loop=LoopConfig(val_before=0),
        )


class ByQuestion:
    """The engine for dynamic sampling: the writer always answers "easy" questions well (a group of
    equal rewards, zero variance) and alternates good and bad on the one "mixed" question."""

    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()

    def __call__(self, request: Any) -> str:
        system = request.messages[0]["content"] if request.messages else ""
        if "checker" in system:
            return CHECKED
        if "easy" in request.messages[-1]["content"]:
            return GOOD
        with self.lock:
            self.n += 1
            return GOOD if self.n % 2 else BAD


def test_dynamic_sampling_draws_fresh_tasks_until_a_group_has_variance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DAPO's dynamic sampling: a step whose groups all score the same draws more tasks (up to
    dynamic_sampling extra rounds) and trains on the informative group only; the metrics count every
    group drawn. The seed is picked so the mixed task comes last in the shuffled pass (3 extra rounds)."""
    from agl.trainer.order import TaskOrder

    tok = load_tokenizer()
    spy = Spy(tok)
    spy.install(monkeypatch)
    train = [{"q": "easy one"}, {"q": "easy two"}, {"q": "easy three"}, {"q": "mixed: 7 * 6?"}]
    seed = next(s for s in range(100) if TaskOrder(4, s).take(4)[-1] == 3)
    algo = agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8)
    trainer = one_task_trainer(
        tmp_path, algo, script=ByQuestion(), tokenizer=tok, dynamic_sampling=3, seed=seed
    )
    summary = trainer.fit(two_agent_app, train)
    record = summary["history"][0]
    assert record["resample_rounds"] == 3
    assert record["groups"] == 4 and record["zero_variance_groups"] == 3 and record["trained_groups"] == 1
    assert record["rollouts"] == 8 and record["train_reward"] == pytest.approx(7 / 8)
    assert len(spy.batches) == 1
    trained = spy.batches[0]
    assert len(trained) == 2 and all(t.group_id.endswith("-s0r3") for t in trained)
    assert sorted(t.final_reward for t in trained) == [0.0, 1.0]
    # only easy tasks: every round is zero-variance; the rounds stop at the cap and the step still counts
    trainer = one_task_trainer(
        tmp_path, algo, run="easy", script=ByQuestion(), tokenizer=tok, dynamic_sampling=1
    )
    record = trainer.fit(two_agent_app, train[:3])["history"][0]
    assert record["resample_rounds"] == 1 and record["groups"] == 2 and record["trained_groups"] == 0
    assert record["zero_variance_groups"] == 2 and trainer.policy.global_step == 1
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="dynamic_sampling"):
            Trainer(
                algo,
                model=tiny_model(),
                serving=Serving(backend="scripted", script=Script()),
                loop=LoopConfig(dynamic_sampling=bad),
            )


def test_a_step_without_an_update_says_so_and_two_say_what_to_do(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only easy tasks: every group's rollouts get the same reward, so no step updates the policy. Each
    step says so (log, metrics' no_update), and the second in a row gives the reasons and remedies."""
    trainer = one_task_trainer(tmp_path, script=ByQuestion(), steps=2)
    with caplog.at_level(logging.WARNING, "agl.trainer"):
        history = trainer.fit(two_agent_app, [{"q": "easy one"}, {"q": "easy two"}])["history"]
    steps = [h for h in history if "rollouts" in h]
    assert [h["no_update"] for h in steps] == [True, True]
    assert all(h["zero_variance_groups"] == h["groups"] == 1 for h in steps)
    notes = [r.getMessage() for r in caplog.records if "made no update" in r.getMessage()]
    assert len(notes) == 2 and "same reward" in notes[0] and "Two steps" not in notes[0]
    assert "Two steps in a row" in notes[1] and "dynamic_sampling" in notes[1] and "agl sft" in notes[1]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m.get("no_update") for m in metrics if "rollouts" in m] == [True, True]


def test_a_public_gateway_bind_needs_a_key_which_the_agents_receive(tmp_path: Path) -> None:
    """`agl gateway serve`'s rule holds for the trainer's own gateway: no key, no public bind. With a
    key, the gateway refuses callers without it and the published LLM resource carries it."""
    with pytest.raises(ValueError, match="refusing to listen on '0.0.0.0' without an API key"):
        Trainer(
            serving=Serving(
                backend="scripted", script=Script(), gateway_bind="0.0.0.0:0", run_dir=tmp_path / "a"
            )
        )
    store = MemoryStore()
    trainer = Trainer(
        agents=["writer"],
        serving=Serving(
            backend="scripted",
            script=Script(),
            store=store,
            runners=1,
            run_dir=tmp_path / "b",
            progress=False,
            gateway_api_key="sekret",
        ),
    )
    out = trainer.dev(two_agent_app, [{"q": "What is 6 * 7?"}], show=False)
    assert len(out) == 1  # the agent used the published key; the gateway accepted it
    llm = store.get_resources().llm
    assert llm is not None and llm.api_key == "sekret"

    def wrong_key_app(task: dict, resources: agl.Resources) -> float:
        client = openai.OpenAI(base_url=resources.llm.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(
                model=resources.llm.model, messages=[{"role": "user", "content": "hi"}]
            )
        return 0.0

    trainer.dev(wrong_key_app, [{"q": "x"}], show=False)
    # both rollouts succeeded: the wrong key was refused with a 401 (else the agent raised)
    assert [r.status for r in store.query_rollouts()] == ["succeeded", "succeeded"]
    gw = Trainer(
        serving=Serving(backend="scripted", script=Script(), run_dir=tmp_path / "c", gateway_api_key="k")
    )
    assert gw.gateway_api_key == "k"


def test_dev_prints_transitions_and_rewards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = Trainer(
        agents=["writer"],
        serving=Serving(
            backend="scripted", script=Script(), runners=2, run_dir=tmp_path / "dev", progress=False
        ),
    )
    out = trainer.dev(two_agent_app, [{"q": "What is 6 * 7?"}, {"q": "What is 1 + 1?"}])
    text = capsys.readouterr().out
    assert len(out) == 2 and {t.agent for t in out} == {"writer"}
    assert "agent=writer" in text and "response: " in text and "reward=" in text
    assert "2 rollouts, 2 transitions" in text
    assert trainer.policy is None  # dev never builds a policy
    # kept in a SQLite store in the run dir (as fit()), and the commands that look inside it printed
    store_url = f"sqlite:///{(tmp_path / 'dev' / 'store.db').resolve()}"
    assert f"agl rollouts list --store {store_url}" in text
    from agl.cli import main

    assert main(["rollouts", "list", "--store", store_url]) == 0
    assert "2 rollout(s): 2 succeeded" in capsys.readouterr().out


def test_plot_cli_and_bad_input(tmp_path: Path) -> None:
    from agl.cli import main

    run = tmp_path / "r"
    run.mkdir()
    rows = [
        {"step": i, "train_reward": i / 10, **({"val_reward": i / 8} if i % 2 == 0 else {})} for i in range(5)
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", str(tmp_path / "nope")]) == 2
    with pytest.raises(ValueError, match="backend"):
        Trainer(serving=Serving(backend="tpu"))
    with pytest.raises(ValueError, match="vllm_url"):
        Trainer(serving=Serving(backend="vllm"))
    with pytest.raises(ValueError, match="script"):
        Trainer(serving=Serving(backend="scripted"))
    with pytest.raises(ValueError, match="dev"):
        Trainer(serving=Serving(backend="openai", base_url="http://127.0.0.1:9/v1")).fit(
            two_agent_app, [{"q": "x"}]
        )
    # the run configuration: bad values and untrainable sampling are refused before anything starts
    with pytest.raises(ValueError, match="unknown sampling setting 'temp'"):
        RunConfig.resolve(sampling={"temp": 0.7})
    with pytest.raises(ValueError, match="RunConfig.lora_r must be an integer >= 1"):
        Trainer(serving=Serving(backend="scripted", script=["x"]), config=RunConfig(lora_r=0))
    greedy = Trainer(
        serving=Serving(backend="scripted", script=["x"], run_dir=tmp_path / "g"),
        config=RunConfig(temperature=0.0),
    )
    with pytest.raises(ValueError, match="temperature must be > 0 for training"):
        greedy.fit(two_agent_app, [{"q": "x"}])
    assert not (tmp_path / "g").exists()
    with pytest.raises(ValueError, match="LightningRL"):
        Trainer(
            agl.LightningRL(lora=False), serving=Serving(backend="vllm", vllm_url="http://127.0.0.1:9/v1")
        )


def test_plot_keeps_a_resumed_recheck_on_another_held_out_set_apart(tmp_path: Path) -> None:
    """A ``--resume`` re-check on a larger held-out set is not a step of the same curve: the plot
    draws one held-out series per set size, as the trainer's before/after summary compares them."""
    pytest.importorskip("matplotlib")
    from agl.cli import main
    from agl.run.plot import _val_series

    rows = [
        {"step": 0, "val_reward": 0.70, "val_tasks": 72},
        {"step": 1, "train_reward": 0.4},
        {"step": 2, "val_reward": 0.78, "val_tasks": 72},
        {"step": 2, "val_reward": 0.76, "val_tasks": 244},
        {"step": 2, "val_reward": 0.5, "val_rollouts": 8},  # written before val_tasks existed
    ]
    assert _val_series(rows) == [(72, [0.0, 2.0], [0.70, 0.78]), (244, [2.0], [0.76]), (8, [2.0], [0.5])]
    assert _val_series([{"step": 3, "val_reward": 1.0}, {"step": 4, "val_reward": True}]) == [
        (None, [3.0], [1.0])
    ]
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_learn_on_cpu_agent_rewards_only_the_strict_format(tmp_path: Path) -> None:
    """The CPU demo's agent, end to end through the gateway: tool spans, the strict reward."""
    import re
    import sys

    root = str(Path(__file__).resolve().parents[1])  # the examples package lives at the repo root
    if root not in sys.path:
        sys.path.insert(0, root)

    from examples.learn_on_cpu.agent import calc_agent, calculate, reward
    from examples.learn_on_cpu.data import split

    train, val = split(n_train=20, n_val=4)
    assert not {t["expression"] for t in train} & {t["expression"] for t in val}
    assert all(calculate(t["expression"]) == t["answer"] for t in train + val)
    assert reward("Answer: 37", 37) == 1.0 and reward(" Answer: 37\n", 37) == 1.0
    assert (
        reward("Answer: 36", 37) == 0.0 and reward("The answer is 37.", 37) == 0.0 and reward(None, 37) == 0.0
    )

    def script(request: Any) -> str:  # the final calculator line's result, right for even questions only
        last = re.findall(r"= (-?\d+)", request.messages[-1]["content"])[-1]
        return f"Answer: {last}" if int(last) % 2 == 0 else f"I think it is {last}."

    trainer = Trainer(
        serving=Serving(backend="scripted", script=script, runners=2, run_dir=tmp_path, progress=False)
    )
    out = trainer.dev(calc_agent, val, show=False)
    assert len(out) == 4 and {t.agent for t in out} == {"calculator_agent"}
    by_rollout = {t.rollout_id: t for t in out}
    for t in by_rollout.values():
        assert t.final_reward == (1.0 if t.response_text and t.response_text.startswith("Answer:") else 0.0)
    tools = [s for s in trainer.store.query_spans(name=sc.SPAN_EXECUTE_TOOL)]
    assert len(tools) == 4 and all(s.attributes[sc.GEN_AI_TOOL_NAME] == "calculator" for s in tools)


def _fit_on_fake_vllm(tmp_path: Path, tasks: list[dict], **loop: Any) -> tuple[Trainer, Any]:
    """A writer agent trained on the vllm backend in front of tests/gateway/fake_vllm.py (``loop``:
    LoopConfig fields); returns the trainer after ``fit`` and the fake server (its ``requests`` and
    ``control`` logs)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent / "gateway"))
    from fake_vllm import FakeVLLM

    from agl.gateway.testing import serve_asgi

    fake = FakeVLLM(["Answer: 42", "no idea"], model="policy")

    def agent(task: dict, resources: agl.Resources) -> float:
        client = openai.OpenAI(base_url=resources.llm.base_url, api_key="x")
        with _agent_span("writer"):
            reply = _ask(client, resources.llm.model, "You are the writer.", task["q"])
        return 1.0 if reply == GOOD else 0.0

    with serve_asgi(fake.app) as root:
        trainer = Trainer(
            agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8),
            model=tiny_model(),
            serving=Serving(
                backend="vllm",
                vllm_url=root + "/v1",
                model_name="policy",
                tokenizer=load_tokenizer(),
                store="memory://",
                runners=2,
                run_dir=tmp_path,
                progress=False,
            ),
            loop=LoopConfig(tasks_per_step=1, val_every=0, **loop),
        )
        trainer.fit(agent, tasks)
    return trainer, fake


def test_vllm_backend_gets_each_steps_lora_adapter(tmp_path: Path) -> None:
    """Weight sync to vLLM: the adapter is saved per step and loaded through the gateway's vllm
    backend (vLLM's runtime LoRA loading), and the policy's requests go to the newest adapter."""
    trainer, fake = _fit_on_fake_vllm(tmp_path, [{"q": "What is 6 * 7?"}], steps=2)
    loads = [body for kind, body in fake.requests if kind == "load_lora_adapter"]
    versions = [r["resources_version"] for r in trainer.history]
    assert [Path(b["lora_path"]).name for b in loads] == [f"v{v}" for v in versions]
    assert (Path(loads[-1]["lora_path"]) / "adapter_config.json").exists()
    # after the last load the policy's requests are routed to that adapter (rendered by agl with the
    # trainer's tokenizer: vLLM's completions route with the prompt ids)
    chats = [body for kind, body in fake.requests if kind == "completions"]
    assert chats and all(isinstance(b["prompt"], list) for b in chats)
    assert chats[-1]["model"] == loads[-1]["lora_name"]
    assert all(r["transitions"] == 2 and r["exact_token_ratio"] == 1.0 for r in trainer.history)


def test_async_training_on_the_vllm_backend_pauses_around_each_push(tmp_path: Path) -> None:
    """max_staleness=1 on the vLLM backend: runners keep running while the policy updates, each
    step's adapter is loaded inside a pause/resume of vLLM's own API (mode=keep: nothing in flight
    is dropped), no rollout is trained twice and no trained call is older than one version."""
    tasks = [{"q": "What is 6 * 7?"}, {"q": "What is 5 * 8?"}]
    trainer, fake = _fit_on_fake_vllm(tmp_path, tasks, steps=3, max_staleness=1)
    kinds = [kind for kind, _ in fake.control if kind in ("pause", "load_lora_adapter", "resume")]
    pushes = [r["resources_version"] for r in trainer.history]
    assert kinds == ["pause", "load_lora_adapter", "resume"] * len(pushes), fake.control
    assert {body["mode"] for kind, body in fake.control if kind == "pause"} == {"keep"}
    trained = [rid for r in trainer.history for rid in r["trained_rollout_ids"]]
    assert trained and len(trained) == len(set(trained))
    assert all(0 <= r["staleness_max"] <= 1 for r in trainer.history if r["trained_rollout_ids"])


def test_external_gateway_gets_weights_over_http(tmp_path: Path) -> None:
    """Serving(gateway_url=...): each step's LoRA adapter (not a merged copy of the model) reaches a
    separately served transformers gateway through POST /agl/v1/adapters, as that step's version."""
    import copy

    from peft import PeftModel

    from agl.gateway import TransformersBackend
    from agl.gateway.testing import serve_gateway

    tok = load_tokenizer()
    model = tiny_model()
    store = MemoryStore()
    backend = TransformersBackend(copy.deepcopy(model), tokenizer=tok, model_name="tiny")

    def agent(task: dict, resources: agl.Resources) -> float:
        llm = resources.llm
        client = openai.OpenAI(base_url=llm.base_url, api_key="x")
        with _agent_span("writer"):
            reply = _ask(client, llm.model, "You are the writer.", task["q"])
        return float(len(reply) % 2)

    with serve_gateway(backend, store) as url:
        trainer = Trainer(
            agl.LightningRL(group_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8),
            model=model,
            serving=Serving(
                gateway_url=url.root,
                model_name="tiny",
                tokenizer=tok,
                store=store,
                runners=2,
                run_dir=tmp_path,
                progress=False,
            ),
            loop=LoopConfig(tasks_per_step=1, steps=2, val_every=0),
            config=RunConfig(max_tokens=4),
        )
        trainer.fit(agent, [{"q": "hi"}])
        last = trainer.history[-1]["resources_version"]
        assert backend.weight_version == last
        served = backend.model
    assert isinstance(served, PeftModel)
    assert not (tmp_path / "weights").exists()  # no full-weight files for a LoRA run
    assert (tmp_path / "adapters" / f"v{last}" / "adapter_config.json").exists()
    # the gateway serves the adapter of the last sync (taken before the final update)
    expect = PeftModel.from_pretrained(tiny_model(), str(tmp_path / "adapters" / f"v{last}")).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(served(ids).logits, expect(ids).logits, atol=1e-5)
    spans = store.query_spans(name=sc.SPAN_CHAT)
    versions = {
        s.attributes.get(sc.AGL_LLM_WEIGHT_VERSION)
        for s in spans
        if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER
    }
    assert versions == {r["resources_version"] for r in trainer.history}


def sampling_writer(task: dict, resources: agl.Resources) -> float:
    """One "writer" call at the run's sampling settings (resources.llm.sampling); reward: reply length mod 2."""
    llm = resources.llm
    client = openai.OpenAI(base_url=llm.base_url, api_key="x")
    with _agent_span("writer"):
        out = client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["q"]}], **llm.sampling
        )
    return float(len(out.choices[0].message.content or "") % 2)


def test_fit_in_process_is_on_policy_at_the_run_temperature(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The embedded engine serves the policy itself (shared base weights, the LoRA pushed each step)
    and samples at the RunConfig's temperature, which the agent gets as resources.llm.sampling; so
    the update's ratio is 1 before each step's first optimizer step, at that same temperature."""
    tok = load_tokenizer()

    trainer = Trainer(
        agl.LightningRL(group_size=4, learning_rate=1e-2, lora_r=4, lora_alpha=8),
        model=tiny_model(),
        config=agl.RunConfig(temperature=0.7, max_tokens=6),
        serving=Serving(
            backend="transformers",
            model_name="tiny",
            tokenizer=tok,
            store="memory://",
            runners=4,
            run_dir=tmp_path,
            progress=False,
        ),
        loop=LoopConfig(tasks_per_step=2, steps=2, val_every=0),
    )
    assert trainer.sampling == {"temperature": 0.7, "top_p": 1.0, "max_tokens": 6}
    with caplog.at_level("WARNING", logger="agl.trainer"):
        trainer.fit(sampling_writer, [{"q": "hello"}, {"q": "count"}])
    assert trainer.policy.config.temperature == 0.7
    trained = [r for r in trainer.history if r.get("trained_transitions")]
    assert trained, trainer.history
    for r in trained:
        assert r["behaviour_ratio_dev"] < 1e-3
    for (
        r
    ) in trainer.history:  # the synchronous loop's engine share: busy while rollouts ran, idle in the update
        assert 0 < r["engine_busy_s"] <= r["step_s"] + 0.01
        assert r["engine_idle_s"] == pytest.approx(r["step_s"] - r["engine_busy_s"], abs=1e-6)
    assert "off by" not in caplog.text
    spans = [
        s
        for s in trainer.store.query_spans(name=sc.SPAN_CHAT)
        if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER
    ]
    assert {s.attributes[sc.GEN_AI_REQUEST_TEMPERATURE] for s in spans} == {0.7}
    assert {s.attributes[sc.AGL_LLM_WEIGHT_VERSION] for s in spans} == {
        r["resources_version"] for r in trainer.history
    }


def test_a_step_whose_agent_selection_matches_nothing_is_refused(tmp_path: Path) -> None:
    trainer = Trainer(
        agl.LightningRL(group_size=2, lora_r=4, lora_alpha=8),
        model=tiny_model(),
        serving=Serving(
            backend="scripted",
            script=Script(),
            store="memory://",
            runners=2,
            run_dir=tmp_path,
            tokenizer=load_tokenizer(),
            progress=False,
        ),
        loop=LoopConfig(tasks_per_step=1, steps=1, val_every=0),
        agents=["wirter"],  # a typo: no span has this name
    )
    with pytest.raises(RuntimeError, match=r"agents=\['wirter'\] matched 0 of 4 LLM calls") as err:
        trainer.fit(two_agent_app, [{"q": "What is 6 * 7?"}])
    assert "checker (2)" in str(err.value) and "writer (2)" in str(err.value)


def test_flat_groups_after_learning_say_the_tasks_look_learnt() -> None:
    """Two steps without an update after the reward rose to the run's best: no warm-start advice."""
    from agl.trainer.notes import ADVICE, no_update_note

    history = [
        {"step": 0, "rollouts": 16, "train_reward": 0.2, "trained_transitions": 16, "no_update": False},
        {"step": 1, "rollouts": 16, "train_reward": 1.0, "trained_transitions": 0, "no_update": True},
    ]
    record = {"step": 2, "rollouts": 16, "train_reward": 1.0, "groups": 4, "zero_variance_groups": 4}
    record["transitions"] = 16
    note = no_update_note(record, history) or ""
    assert "these tasks look learnt" in note and "up from 0.200" in note and ADVICE not in note
    flat_from_the_start = [dict(h, train_reward=1.0) for h in history]
    assert ADVICE in (no_update_note(dict(record), flat_from_the_start) or "")
