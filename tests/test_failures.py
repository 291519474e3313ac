"""Failure kinds (issue 64): an infrastructure failure is told apart from the agent's own failure and
from an honest outcome, from what the store and the spans hold.

Real pieces: agl's gateway on 127.0.0.1 with the scripted backend, whose script answers with an error on
chosen calls (the gateway then answers a real 502 and records its ERROR span), the real openai client
in the agent, the real Runner and memory store.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

import agl
from agl.adapter import Adapter, failure_kind
from agl.adapter.failures import attempt_kind, is_infra_error
from agl.errors import InfraError, UsageError
from agl.runner.runner import Runner
from agl.store.memory import MemoryStore
from agl.tracing import provider as tracing
from agl.types import LLM, NewRollout, RolloutConfig

openai = pytest.importorskip("openai")


@pytest.fixture()
def store() -> Iterator[MemoryStore]:
    s = MemoryStore()
    yield s
    tracing.reset_tracing()
    s.close()


def script(request: Any) -> Any:
    """The fault switch: a call whose last message says FAIL gets an engine failure (a 502)."""
    from agl.gateway.backends.scripted import reply

    text = str(request.messages[-1]["content"]) if request.messages else ""
    return reply(error="the engine restarted under the call") if "FAIL" in text else "ok"


def _ask(resources: agl.Resources, text: str) -> str:
    client = openai.OpenAI(base_url=resources.llm.base_url, api_key="x", max_retries=0)
    out = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": text}], max_tokens=8
    )
    return out.choices[0].message.content or ""


def agent(task: dict, resources: agl.Resources) -> float | None:
    """What each task's ``do`` asks: the ways an attempt ends."""
    do = task["do"]
    if do == "caught_502":  # many agents turn a failed model call into a 0 of their own
        try:
            _ask(resources, "FAIL")
        except openai.InternalServerError:
            return 0.0
    if do == "raised_502":
        _ask(resources, "FAIL")
    if do == "bug":
        _ask(resources, "hi")
        raise KeyError("the agent's own bug")
    if do == "infra_error":
        raise InfraError("the tool server is down")
    if do == "said_infra":
        agl.emit_exception(ConnectionRefusedError("sandbox gone"), infra=True)
        return 0.0
    if do == "no_reward":
        _ask(resources, "hi")
        return None
    return 1.0 if _ask(resources, "hi") == "right" else 0.0  # "wrong": a reward of 0 for a wrong answer


CASES = {
    "caught_502": "infra",
    "raised_502": "infra",
    "bug": "agent",
    "infra_error": "infra",
    "said_infra": "infra",
    "no_reward": "no_reward",
    "wrong": "task",
}


def test_each_way_an_attempt_ends_gets_its_kind(store: MemoryStore) -> None:
    from agl.gateway.testing import ScriptedBackend, serve_gateway

    with serve_gateway(ScriptedBackend(script), store) as url:
        store.add_resources({"main": LLM(base_url=str(url), model="scripted")})
        cfg = RolloutConfig(max_attempts=1)
        made = store.enqueue([NewRollout(id=f"ro-{do}", input={"do": do}, config=cfg) for do in CASES])
        Runner(agent, store, concurrency=2, claim_timeout_s=0.05).run(until_idle=True)
    adapter = Adapter()
    rollouts = store.query_rollouts(ids=[r.id for r in made])
    transitions = adapter.from_store(store, rollouts)
    for r in rollouts:
        kind = adapter.failure_kind(store, r)
        assert kind == CASES[r.input["do"]], (r.input["do"], r.status, r.attempts[-1].error)
        spans = store.query_spans(rollout_id=r.id, attempt=1)
        assert failure_kind(r, spans) == kind  # the function alone says the same
        assert attempt_kind(r, 1, spans) == kind  # and so does the one attempt's own kind
    # every transition carries its rollout's kind: the "wrong" answer's call is a task, its reward 0
    kinds = {t.rollout_id: t.failure_kind for t in transitions}
    assert kinds["ro-wrong"] == "task" and kinds["ro-bug"] == "agent" and kinds["ro-no_reward"] == "no_reward"
    assert [t.final_reward for t in transitions if t.rollout_id == "ro-wrong"] == [0.0]
    # `agl rollouts list` shows each rollout's kind
    from agl.reports.inspect import failure_kind_of, format_rollouts

    table = format_rollouts(rollouts, kinds={r.id: failure_kind_of(store, r) for r in rollouts})
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:-1]}
    assert table.splitlines()[0].split()[5] == "KIND"
    assert {rid: row[5] for rid, row in rows.items()} == {f"ro-{do}": kind for do, kind in CASES.items()}


def test_each_retried_attempt_says_why_it_was_retried(store: MemoryStore) -> None:
    """A rollout tried three times by the store: a 502 (infra), then the agent's bug (agent), then an
    answer (task). Each attempt carries its own kind in `agl rollouts show` and on the dashboard's
    rollout page; the rollout's kind is its deciding attempt's."""
    from starlette.testclient import TestClient

    from agl.dashboard import create_dashboard_app
    from agl.gateway.testing import ScriptedBackend, serve_gateway
    from agl.reports.inspect import attempt_kinds_of, failure_kind_of, format_rollout

    tries: list[int] = []

    def flaky(task: dict, resources: agl.Resources) -> float:
        tries.append(1)
        if len(tries) == 1:
            _ask(resources, "FAIL")  # the gateway's 502: the client raises
        if len(tries) == 2:
            raise KeyError("the agent's own bug")
        return 1.0 if _ask(resources, "hi") == "ok" else 0.0

    with serve_gateway(ScriptedBackend(script), store) as url:
        store.add_resources({"main": LLM(base_url=str(url), model="scripted")})
        (r,) = store.enqueue([NewRollout(id="ro-thrice", config=RolloutConfig(max_attempts=3))])
        Runner(flaky, store, concurrency=1, claim_timeout_s=0.05).run(until_idle=True)
    rollout = store.get_rollout(r.id)
    assert [a.status for a in rollout.attempts] == ["failed", "failed", "succeeded"]
    kinds = attempt_kinds_of(store, rollout)
    assert kinds == {1: "infra", 2: "agent", 3: "task"} and failure_kind_of(store, rollout) == "task"
    shown = format_rollout(rollout, kinds=kinds).splitlines()
    lines = {n: next(line for line in shown if line.startswith(f"  #{n} ")) for n in kinds}
    assert all(line.rstrip().endswith(kinds[n]) for n, line in lines.items()), lines
    with TestClient(create_dashboard_app(store)) as client:
        page = client.get(f"/api/rollouts/{r.id}").json()
    assert page["failure_kind"] == "task"
    assert [a["failure_kind"] for a in page["attempts"]] == ["infra", "agent", "task"]


def test_an_attempt_whose_runner_died_is_infra(store: MemoryStore) -> None:
    """A runner that claimed and then vanished (no heartbeat, no finish): the lease lapses, the store
    ends the attempt, and no attempt finished: infra."""
    (r,) = store.enqueue([NewRollout(config=RolloutConfig(lease_s=0.1, max_attempts=1))])
    claim = store.claim("dead-worker", timeout_s=1.0)
    assert claim is not None and claim.rollout.id == r.id
    deadline = time.monotonic() + 10
    while store.get_rollout(r.id).status != "failed":
        assert time.monotonic() < deadline, "the lease never lapsed"
        store.claim("other", timeout_s=0.05)  # the store reaps lapsed leases as it is used
        time.sleep(0.05)
    rollout = store.get_rollout(r.id)
    assert [a.status for a in rollout.attempts][-1] in ("lost", "timed_out")
    assert failure_kind(rollout, []) == "infra"


def test_infra_errors_are_named_by_type_or_5xx() -> None:
    assert is_infra_error("BackendError") and is_infra_error("openai.APIConnectionError")
    assert is_infra_error("APIStatusError", "Error code: 503 - {'error': ...}")
    assert not is_infra_error("KeyError", "boom") and not is_infra_error("BadRequestError", "Error code: 400")
    with pytest.raises(TypeError, match="True or False"):
        agl.emit_exception(ValueError("x"), infra="yes")  # type: ignore[arg-type]


def _t(rollout: str, group: str | None, reward: float = 0.0) -> Any:
    from agl.types import Transition

    return Transition(
        rollout_id=rollout,
        attempt=1,
        group_id=group,
        index=0,
        prompt_ids=(1,),
        response_ids=(2,),
        reward=reward,
        final_reward=reward,
        failure_kind="task",
    )


def test_a_group_under_the_floor_is_dropped_whole_and_reported() -> None:
    algo = agl.LightningRL(group_size=4, min_group_fraction=0.75)
    full = [_t(f"a{i}", "A", float(i)) for i in range(4)]
    three = [_t(f"b{i}", "B", float(i)) for i in range(3)]
    two = [_t(f"c{i}", "C", float(i)) for i in range(2)] + [_t("c0", "C", 0.0)]  # c0 made 2 calls
    kept, stats = algo.viable_groups(full + three + two + [_t("lone", None)])
    assert {t.group_id for t in kept} == {"A", "B", None}  # C: 2 of 4 members < ceil(0.75 * 4) = 3
    assert stats["dropped_groups"] == 1 and stats["dropped_group_ids"] == ["C"]
    assert stats["effective_group_size"] == 3.0 and stats["effective_group_size_min"] == 2
    advantages, _ = algo.compute_advantages(kept)
    assert all(a == a for a in advantages)  # no NaN
    # every group gone: nothing to train, no NaN either
    none, stats = algo.viable_groups(two)
    assert none == [] and stats["dropped_groups"] == 1
    assert agl.LightningRL(min_group_fraction=0.0).viable_groups(two)[0] == two
    with pytest.raises(ValueError, match="min_group_fraction"):
        agl.LightningRL(min_group_fraction=1.5)


def test_a_nan_reward_is_refused_naming_the_rollout() -> None:
    with (
        agl.rollout_context("ro-nan", 2, span=False),
        pytest.raises(ValueError, match="rollout ro-nan attempt 2"),
    ):
        agl.emit_reward(float("nan"))
    with pytest.raises(UsageError, match="missing_reward"):
        Adapter(missing_reward=float("inf"))
    assert Adapter().missing_reward is None  # unset by default: a silent zero is never a reward


def test_a_resumed_pipeline_counts_a_requeued_member_once(store: MemoryStore) -> None:
    """The asynchronous schedule's restore (after a trainer kill): a member that failed on the
    infrastructure and was requeued before the kill gives its place to its replacement, so the group
    has its group_size members, not one more, and the failed one is never requeued again."""
    from agl.trainer.pipeline import PIPELINE_KEY, REQUEUED_FROM_KEY, GroupPipeline

    meta = {PIPELINE_KEY: True}
    a, b = store.enqueue([NewRollout(group_id="g", mode="train", metadata=meta) for _ in range(2)])
    (again,) = store.enqueue(
        [NewRollout(group_id="g", mode="train", metadata={**meta, REQUEUED_FROM_KEY: b.id})]
    )
    pipe = GroupPipeline(store, lambda r: ([], None), 2, RolloutConfig())
    assert pipe.restore({"consumed_groups": []}) == 1
    group = pipe.outstanding["g"]
    assert group.ids == [a.id, again.id] and group.replaced == [b.id]


def slow_agent(task: dict, resources: agl.Resources) -> float:
    """Runs past its rollout's timeout: waiting on a blocked engine, or in its own code."""
    if task["do"] == "blocked_engine":
        _ask(resources, "BLOCK")  # the engine holds the call past the rollout's timeout
    else:
        _ask(resources, "hi")  # answered at once: no call is left waiting
        time.sleep(TIMEOUT_S * 2)  # the agent's own slow code
    return 1.0


TIMEOUT_S = 1.5


def blocking_script(request: Any) -> Any:
    from agl.gateway.backends.scripted import reply

    text = str(request.messages[-1]["content"]) if request.messages else ""
    return reply("late", delay_s=TIMEOUT_S * 2) if "BLOCK" in text else "ok"


@pytest.mark.parametrize("first", ["runner", "store"])
def test_a_timeout_while_a_call_waits_on_the_engine_is_infra_one_in_the_agents_code_is_not(
    store: MemoryStore, first: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both rollouts run past their timeout. One's LLM call was still waiting on a blocked engine
    (the runner saw the call's span open: ``open_llm_calls``) — infra; the other's call had been
    answered and its own code was slow — the agent's failure. ``first``: who ends the attempt. A live
    runner stops the agent just before the store's deadline and finishes it ``failed``; with the
    runner late (``store``), the store ends it ``timed_out`` and the runner's stale exception span still
    gives the verdict (before, every store timeout was infra)."""
    from agl.gateway.testing import ScriptedBackend, serve_gateway
    from agl.runner import runner as runner_module

    if first == "store":  # the runner's timer fires after the store's deadline
        monkeypatch.setattr(runner_module, "report_margin", lambda timeout_s: -0.3)

    agl.instrument("openai")  # as `agl runner` does: the client's call spans say what is in flight
    with serve_gateway(ScriptedBackend(blocking_script), store) as url:
        store.add_resources({"main": LLM(base_url=str(url), model="scripted")})
        cfg = RolloutConfig(max_attempts=1, timeout_s=TIMEOUT_S)
        made = store.enqueue(
            [
                NewRollout(id=f"ro-{do}", input={"do": do}, config=cfg)
                for do in ("blocked_engine", "slow_code")
            ]
        )
        try:
            stats = Runner(slow_agent, store, concurrency=2, claim_timeout_s=0.05).run(until_idle=True)
        finally:
            agl.uninstrument()
    assert stats.timed_out == 2
    adapter = Adapter()
    kinds = {r.id: adapter.failure_kind(store, r) for r in store.query_rollouts(ids=[r.id for r in made])}
    assert kinds == {"ro-blocked_engine": "infra", "ro-slow_code": "agent"}
    ended = {r.id: [a.status for a in r.attempts] for r in store.query_rollouts(ids=[r.id for r in made])}
    assert ended == {rid: ["failed" if first == "runner" else "timed_out"] for rid in ended}
    if first == "runner":
        blocked = store.get_rollout("ro-blocked_engine")
        assert "waited on a reply" in (blocked.attempts[-1].error.message or "")
        assert "waited" not in (store.get_rollout("ro-slow_code").attempts[-1].error.message or "")
