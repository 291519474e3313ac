"""Training on SkyRL's real Tinker server (``skyrl-tx``, JAX on this CPU) through agl's ``tinker`` backend:
the SDK's clients against the server's own app, no stub. One server for the session (conftest.py); the
restart test starts its own through the run (``tinker_python``). Skipped without AGL_TINKER_PYTHON,
failed under AGL_TINKER_REQUIRED=1 (``tox -e tinker``)."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import agl
import agl.store
from agl import semconv as sc
from agl.config import RolloutSettings

pytest.importorskip("openai")

#: one shape for every run (a JAX server compiles once per request shape): learn_on_cpu's prompts
#: (one 96-token bucket), 16 new tokens, four sequences per sampling batch
MAX_TOKENS = 16


def _server_spans(store: Any) -> list[Any]:
    spans = [
        s for s in store.query_spans(name=sc.SPAN_CHAT) if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER
    ]
    return sorted(spans, key=lambda s: s.start_ns)


def _serving(run_dir: Path, server: Any, **kw: Any) -> agl.Serving:
    return agl.Serving(
        backend="tinker",
        tinker_url=server.url,
        base_model=server.base_model,
        run_dir=run_dir,
        progress=False,
        tinker_timeout_s=kw.pop("tinker_timeout_s", 300.0),
        **kw,
    )


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_seeded_sampling_through_the_gateway_repeats_with_exact_ids(skyrl: Any, tmp_path: Path) -> None:
    """``dev`` twice with the same seed: every call goes through agl's gateway to the service's
    sampler as token ids and comes back with the service's ids and log-probs (exact on every span), and
    the run's seeds give the same replies both times."""
    from examples.learn_on_cpu.agent import calc_agent
    from examples.learn_on_cpu.data import split

    _, val = split(n_val=4)
    replies = []
    for k in range(2):
        trainer = agl.Trainer(
            serving=_serving(tmp_path / f"dev{k}", skyrl, runners=1),
            loop=agl.LoopConfig(seed=3),
            config=agl.RunConfig(max_tokens=MAX_TOKENS),
        )
        ts = trainer.dev(calc_agent, val, show=False)
        spans = _server_spans(trainer.store)
        assert len(ts) == len(spans) == 4
        for span in spans:
            a = span.attributes
            assert a[sc.AGL_LLM_EXACT] is True
            assert a[sc.AGL_LLM_PROMPT_TOKEN_IDS] and a[sc.AGL_LLM_RESPONSE_TOKEN_IDS]
        assert all(t.exact and t.response_logprobs is not None for t in ts)
        assert all(len(t.response_logprobs) == len(t.response_ids) for t in ts)
        replies.append(sorted(t.response_ids for t in ts))
    assert replies[0] == replies[1]


def test_an_update_on_the_service_changes_the_samplers_logprobs(skyrl: Any) -> None:
    """One ``TinkerPolicy.step`` on a real sample (advantage +1): the service's training forward scores
    the sampled tokens as its sampler did (ratio ~1 before the step), and after ``optim_step`` the new
    sampler gives those tokens other log-probs (higher: the reply was rewarded)."""
    import tinker

    from agl.algorithms.tinker_update import TinkerPolicy
    from agl.config import RunConfig
    from agl.tinker.service import TinkerService
    from agl.types import Transition

    service = TinkerService(skyrl.url, base_model=skyrl.base_model, lora_rank=8, server=None, timeout_s=300)
    config = RunConfig(learning_rate=5e-3, lora_r=8, max_tokens=MAX_TOKENS)
    policy = TinkerPolicy(service, config, output_dir="/tmp/agl-unused")
    try:
        service.publish(1)
        prompt = list(range(200, 270))  # a 70-token prompt: the 96-token bucket of the runs
        future, version = service.sample_future(None, prompt, 1, {"max_tokens": MAX_TOKENS, "seed": 5})
        seq = future.result(timeout=300).sequences[0]
        assert version == 1 and len(seq.logprobs) == len(seq.tokens)
        t = Transition(
            rollout_id="r",
            attempt=1,
            index=0,
            prompt_ids=tuple(prompt),
            response_ids=tuple(seq.tokens),
            response_logprobs=tuple(seq.logprobs),
            reward=1.0,
        )
        metrics = policy.step([t], [1.0])
        assert metrics["behaviour_ratio_dev"] < 0.05 and math.isfinite(metrics["loss"])
        assert metrics["tinker_data"] == 4.0  # one sequence, padded to the server's micro-batch
        service.publish(2)
        sampler, v2 = service.sampler(None)
        after = sampler.compute_logprobs(tinker.ModelInput.from_ints(prompt + list(seq.tokens))).result(
            timeout=300
        )
        after = [float(x) for x in after[-len(seq.tokens) :]]  # the prompt's first token has none
        assert v2 == 2
        assert max(abs(a - b) for a, b in zip(after, seq.logprobs, strict=True)) > 1e-3
        assert sum(after) > sum(seq.logprobs)  # the rewarded reply became more likely
    finally:
        service.close()


def test_learn_on_cpu_trains_through_the_service_and_resumes(skyrl: Any, tmp_path: Path) -> None:
    """learn_on_cpu's agent, unchanged, trained two steps on the service: exact ids on every span, each
    span's weight version the step's, the update's ratio ~1 (the service scores what it sampled), the
    held-out reward before and after; then ``resume=True`` goes on from the service's saved state."""
    from examples.learn_on_cpu.agent import calc_agent
    from examples.learn_on_cpu.data import split

    train, val = split(n_val=4)
    run = tmp_path / "run"

    def trainer(steps: int, resume: bool) -> agl.Trainer:
        return agl.Trainer(
            agl.LightningRL(group_size=4, learning_rate=3e-3, lora_r=8, kl_coef=0.0),
            agents=["calculator_agent"],
            serving=_serving(run, skyrl, runners=4),
            loop=agl.LoopConfig(
                tasks_per_step=1, steps=steps, val_every=steps, checkpoint_every=1, resume=resume, seed=0
            ),
            config=agl.RunConfig(max_tokens=MAX_TOKENS),
        )

    first = trainer(2, False)
    out = first.fit(calc_agent, train, val)
    print(f"\nheld-out reward before {out['val_reward_before']} after {out['val_reward_after']}")
    steps = [r for r in _records(run) if "rollouts" in r]
    assert len(steps) == 2 and all(r["rollouts_failed"] == 0 and r["exact_token_ratio"] == 1.0 for r in steps)
    assert out["val_reward_before"] is not None and out["val_reward_after"] is not None
    for r in steps:
        if r.get("tinker_data"):
            assert r["behaviour_ratio_dev"] < 0.05
            assert r["forward_backward_s"] > 0 and r["optim_step_s"] > 0
    versions = {r["resources_version"] for r in first.history if "resources_version" in r}
    for span in _server_spans(first.store):
        assert span.attributes[sc.AGL_LLM_EXACT] is True
        assert span.attributes[sc.AGL_LLM_WEIGHT_VERSION] in versions
    state = json.loads((run / "tinker" / "versions.json").read_text())
    assert sorted(state["states"]) == ["1", "2"] and state["last_good_step"] == 2
    checkpoint = run / "checkpoints" / "checkpoint-2" / "tinker_state.json"
    assert json.loads(checkpoint.read_text())["adapters"]["policy"].startswith("tinker://")

    second = trainer(3, True)
    second.fit(calc_agent, train, val)
    assert second.policy.global_step == 3
    steps = [r for r in _records(run) if "rollouts" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]  # step 2 only was run again


def _two_agents(task: dict[str, Any], resources: agl.Resources) -> float:
    import openai

    from examples.learn_on_cpu.agent import build_messages, calculator, reward

    llm = resources.llm
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "agl", max_retries=0)
    got = 0.0
    for agent in ("solver", "checker"):
        with agl.agent(agent):
            out = client.chat.completions.create(
                model=llm.model,
                messages=build_messages(task["question"], calculator(task["expression"])),
                max_tokens=MAX_TOKENS,
                temperature=1.0,
            )
        got += reward(out.choices[0].message.content, task["answer"])
    client.close()
    return got / 2


def test_an_adapter_per_agent_routes_each_agents_calls_to_its_own_sampler(skyrl: Any, tmp_path: Path) -> None:
    """``adapter_per_agent``: one LoRA training client per agent on the same base, each agent's calls
    served by its own adapter's sampler (the span names it), each adapter trained on its own calls."""
    from examples.learn_on_cpu.data import split

    train, _ = split(n_val=4)
    trainer = agl.Trainer(
        agl.LightningRL(group_size=2, learning_rate=3e-3, lora_r=8, kl_coef=0.0),
        agents=["solver", "checker"],
        serving=_serving(tmp_path / "run", skyrl, runners=2),
        loop=agl.LoopConfig(adapter_per_agent=True, tasks_per_step=1, steps=1, val_every=0, seed=0),
        config=agl.RunConfig(max_tokens=MAX_TOKENS),
    )
    agl.instrument(
        "openai"
    )  # idempotent; learn_on_cpu's module turned it on too (left on for the next tests)
    trainer.fit(_two_agents, train[:1])
    states = json.loads((tmp_path / "run" / "tinker" / "versions.json").read_text())["states"]["1"]
    assert sorted(states) == ["checker", "solver"]  # two training clients, two models on the service
    assert len({path.split("/")[2] for path in states.values()}) == 2
    spans = _server_spans(trainer.store)
    assert len(spans) == 4
    for span in spans:
        agent = span.attributes.get(sc.GEN_AI_AGENT_NAME)
        assert span.attributes[sc.AGL_LLM_ADAPTER] in ("solver", "checker")
        if agent:
            assert span.attributes[sc.AGL_LLM_ADAPTER] == agent
    record = [r for r in trainer.history if "rollouts" in r][0]
    for name in ("solver", "checker"):
        assert record[f"trained_transitions/{name}"] <= 2.0


def _kill_during(trainer: agl.Trainer, step: int, done: threading.Event) -> None:
    """SIGKILL the run's server as soon as a rollout of ``step`` runs (its LLM call is then in flight)."""
    while not done.is_set():
        env = trainer.env
        if len(trainer.history) >= step and env is not None and env.tinker is not None and trainer.store:
            if trainer.store.query_rollouts(status=["running"]):
                time.sleep(0.3)
                env.tinker.server.kill()
                return
        time.sleep(0.05)


def test_a_killed_managed_server_is_restarted_and_the_run_goes_on(tinker_python: str, tmp_path: Path) -> None:
    """``tinker_python``: the run starts SkyRL's server itself; SIGKILLed during step 1's rollouts, its
    calls fail as infrastructure failures (requeued, never scored), the server is restarted on the
    state saved after step 0's update, and the run finishes every rollout."""
    from examples.learn_on_cpu.agent import calc_agent
    from examples.learn_on_cpu.data import split

    agl.instrument("openai")  # the agent's client spans name its calls (idempotent)
    train, _ = split(n_val=4)
    run = tmp_path / "run"
    trainer = agl.Trainer(
        agl.LightningRL(group_size=4, learning_rate=3e-3, lora_r=8, kl_coef=0.0),
        agents=["calculator_agent"],
        serving=agl.Serving(
            backend="tinker",
            tinker_python=tinker_python,
            runners=4,
            run_dir=run,
            progress=False,
            tinker_timeout_s=300.0,
        ),
        loop=agl.LoopConfig(tasks_per_step=1, steps=2, val_every=0, seed=0),
        # one attempt per rollout: a call the kill cuts fails its rollout, which the trainer requeues
        # (with more attempts the store retries the rollout itself, also without scoring the failure)
        rollout=RolloutSettings(max_attempts=1, infra_retries=3),
        config=agl.RunConfig(max_tokens=MAX_TOKENS),
    )
    done = threading.Event()
    killer = threading.Thread(target=_kill_during, args=(trainer, 1, done), daemon=True)
    killer.start()
    try:
        out = trainer.fit(calc_agent, train)
    finally:
        done.set()
    steps = [r for r in _records(run) if "rollouts" in r]
    assert out["steps"] == 2 and len(steps) == 2
    assert all(r["rollouts_failed"] == 0 and r["exact_token_ratio"] == 1.0 for r in steps)
    assert steps[1]["requeued_rollouts"] >= 1 and steps[1]["errored_rollouts/infra"] >= 1
    assert steps[1]["engine_restarts"] == 1
    log = (run / "tinker" / "tinker.log").read_text()
    assert log.count("=== agl:") == 2  # started, then restarted after the kill


def test_a_lost_service_fails_the_run_in_bounded_time_naming_it(tinker_python: str, tmp_path: Path) -> None:
    """A service agl does not manage (``tinker_url``) that goes away after step 0: the run fails within
    a few ``tinker_timeout_s``, with an InfraError naming the URL and the last good step."""
    from agl.chat.models import prepare_default_model
    from agl.errors import InfraError
    from agl.tinker.server import SkyRLServer
    from examples.learn_on_cpu.agent import calc_agent
    from examples.learn_on_cpu.data import split

    server = SkyRLServer(
        prepare_default_model(progress=False), python=tinker_python, state_dir=tmp_path / "skyrl", lora_rank=8
    ).start()
    from agl.tinker.service import TinkerService

    # the engine loads the model after the API answers (~40 s): wait for it here, so the run's short
    # timeout measures the lost service, not the start
    TinkerService(server.url, base_model=server.base_model, lora_rank=8, timeout_s=300).connect().close()
    agl.instrument("openai")  # the agent's client spans name its calls (idempotent)
    train, _ = split(n_val=4)
    trainer = agl.Trainer(
        agl.LightningRL(group_size=4, learning_rate=3e-3, lora_r=8, kl_coef=0.0),
        agents=["calculator_agent"],
        serving=_serving(tmp_path / "run", server, runners=4, tinker_timeout_s=20.0),
        loop=agl.LoopConfig(tasks_per_step=1, steps=3, val_every=0, seed=0),
        rollout=RolloutSettings(infra_retries=1),
        config=agl.RunConfig(max_tokens=MAX_TOKENS),
    )

    killed: list[float] = []

    def kill_after_first_update() -> None:
        while not any("rollouts" in r for r in trainer.history):
            time.sleep(0.2)
        server.kill()
        killed.append(time.monotonic())

    threading.Thread(target=kill_after_first_update, daemon=True).start()
    try:
        with pytest.raises(InfraError) as info:
            trainer.fit(calc_agent, train)
    finally:
        server.stop()
    assert killed and time.monotonic() - killed[0] < 8 * 20.0  # a few timeouts, not the SDK's two hours
    assert server.url in str(info.value) and "last good step was 1" in str(info.value)


def test_agl_train_backend_tinker_trains_the_unchanged_agent(skyrl: Any, tmp_path: Path) -> None:
    """``agl train --backend tinker --tinker-url URL --base-model NAME``: the command line a user types
    trains learn_on_cpu's agent, unchanged, one step on the service, exact ids on every span, and the
    run's config records the service but no key."""
    from agl.cli import main
    from examples.learn_on_cpu.data import split

    train, _ = split(n_val=4)
    tasks = tmp_path / "train.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in train[:4]))
    run = tmp_path / "run"
    argv = [
        "train", "--agent", "examples.learn_on_cpu.agent:calc_agent", "--train", str(tasks),
        "--backend", "tinker", "--tinker-url", skyrl.url, "--base-model", skyrl.base_model,
        "--tinker-timeout-s", "300", "--steps", "1", "--tasks-per-step", "1", "--group-size", "4",
        "--lora-r", "8", "--learning-rate", "3e-3", "--max-tokens", str(MAX_TOKENS), "--val-every", "0",
        "--run-dir", str(run), "--seed", "0",
    ]  # fmt: skip
    assert main(argv) == 0
    steps = [r for r in _records(run) if "rollouts" in r]
    assert len(steps) == 1 and steps[0]["rollouts_failed"] == 0 and steps[0]["exact_token_ratio"] == 1.0
    store = agl.store.open(f"sqlite:///{run / 'store.db'}")
    try:
        spans = _server_spans(store)
        assert len(spans) == 4 and all(s.attributes[sc.AGL_LLM_EXACT] is True for s in spans)
    finally:
        store.close()
    saved = (run / "config.yaml").read_text()
    assert "backend: tinker" in saved and skyrl.url in saved and "sk-" not in saved
