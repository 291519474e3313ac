"""examples/sql_agent: the data (deterministic, gold answers from SQLite), the execution-match reward,
``dev`` with the scripted model (good, fixed, wrong and hopeless answers, failing SQL penalised by AIR
on the call that wrote it), and ``train`` for a few steps with a tiny random model."""

from __future__ import annotations

import math
import sqlite3
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from examples.sql_agent import data
from examples.sql_agent.reward import answers_with_count, execute, execution_match, extract_sql


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sql_data")
    data.build_databases(root)
    return root


def _dump(path: Path) -> list[str]:
    with sqlite3.connect(path) as conn:
        return list(conn.iterdump())


# ------------------------------------------------------------------------------------------ data


def test_databases_and_questions_are_deterministic(data_dir: Path, tmp_path: Path) -> None:
    again = data.build_databases(tmp_path)
    assert set(again) == set(data.DOMAINS) and len(again) == 8
    for db_id, path in again.items():
        assert _dump(path) == _dump(data.db_path(db_id, data_dir)), db_id
    for split in ("train", "test"):
        assert data.load_tasks(split, tmp_path) == data.load_tasks(split, data_dir)


def test_the_split_is_by_database_and_holds_a_few_hundred_questions(data_dir: Path) -> None:
    train, test = data.load_tasks("train", data_dir), data.load_tasks("test", data_dir)
    assert len(train) + len(test) >= 300
    assert {t["db_id"] for t in train} == set(data.TRAIN_DBS)
    assert {t["db_id"] for t in test} == set(data.TEST_DBS)
    assert not set(data.TRAIN_DBS) & set(data.TEST_DBS)
    assert len({t["id"] for t in train + test}) == len(train) + len(test)
    # limit= takes an interleaved prefix: every database is represented
    assert {t["db_id"] for t in data.load_tasks("train", data_dir, limit=6)} == set(data.TRAIN_DBS)
    with pytest.raises(ValueError, match="split"):
        data.load_tasks("dev", data_dir)
    with pytest.raises(ValueError, match="unknown database"):
        data.db_path("nope", data_dir)


def _kind(sql: str) -> str:
    for kind, mark in (("join", " JOIN "), ("group", " GROUP BY "), ("limit", " LIMIT ")):
        if mark in sql:
            return kind
    return "flat"


def test_every_gold_query_has_one_nonempty_answer(data_dir: Path) -> None:
    kinds: Counter[str] = Counter()
    for task in data.load_tasks("train", data_dir) + data.load_tasks("test", data_dir):
        db = data.db_path(task["db_id"], data_dir)
        rows = execute(db, task["gold_sql"])
        assert rows and all(v is not None for row in rows for v in row), task
        assert rows != [(0,)], task
        assert execution_match(db, task["gold_sql"], task["gold_sql"]) == 1.0
        sql = task["gold_sql"]
        kinds[_kind(sql)] += 1
        if " LIMIT " in sql:  # no tie at the boundary: the answer does not depend on SQLite's tie order
            column = sql.split(" ORDER BY ")[1].split()[0]
            table = sql.split(" FROM ")[1].split()[0]
            k = int(sql.rsplit(" LIMIT ", 1)[1])
            values = [r[0] for r in execute(db, f"SELECT {column} FROM {table} ORDER BY {column} DESC")]
            values = values if " DESC " in sql else values[::-1]
            assert len(set(values[: k + 1])) == k + 1, task
    assert kinds["join"] >= 40 and kinds["limit"] >= 20 and kinds["group"] >= 8, kinds


# ---------------------------------------------------------------------------------------- reward


def test_execution_match(data_dir: Path) -> None:
    db = data.db_path("shop", data_dir)
    gold = "SELECT COUNT(*) FROM customers WHERE city = 'Paris'"
    assert execution_match(db, "select count(id) from customers where city='Paris'", gold) == 1.0
    assert execution_match(db, "SELECT COUNT(*) FROM customers", gold) == 0.0
    assert execution_match(db, "SELECT COUNT(*) FROM customer", gold) == 0.0  # fails to run
    assert execution_match(db, "", gold) == 0.0
    # a count answers only a counting question, even when the numbers coincide
    n = execute(db, "SELECT COUNT(*) FROM customers")[0][0]
    same = f"SELECT MAX(n) FROM (SELECT {n} AS n)"  # a non-count gold whose value is the row count
    assert execute(db, same) == [(n,)]
    assert execution_match(db, "SELECT COUNT(*) FROM customers", same) == 0.0
    assert execution_match(db, f"SELECT {n}", same) == 1.0
    assert execution_match(db, "SELECT city, COUNT(*) AS n FROM customers GROUP BY city",
                           "SELECT city, COUNT(id) FROM customers GROUP BY city") == 1.0  # fmt: skip
    for task in data.load_tasks("test", data_dir):  # COUNT(*) wins no non-count question of the split
        if not answers_with_count(task["gold_sql"]):
            table = task["gold_sql"].split(" FROM ")[1].split()[0]
            task_db = data.db_path(task["db_id"], data_dir)
            assert execution_match(task_db, f"SELECT COUNT(*) FROM {table}", task["gold_sql"]) == 0.0
    # unordered gold: row order is free; ordered gold: it is not
    names = "SELECT name FROM customers WHERE age > 30"
    assert execution_match(db, names + " ORDER BY name DESC", names) == 1.0
    top = "SELECT name FROM customers ORDER BY age DESC LIMIT 3"
    assert execution_match(db, "SELECT name FROM customers ORDER BY age ASC LIMIT 3", top) == 0.0
    rev = "SELECT name FROM (SELECT name, age FROM customers ORDER BY age DESC LIMIT 3) ORDER BY age DESC"
    assert execution_match(db, rev, top) == 1.0
    # the same number computed another way (float rounding) matches
    assert (
        execution_match(
            db, "SELECT SUM(age) * 1.0 / COUNT(*) FROM customers", "SELECT AVG(age) FROM customers"
        )
        == 1.0
    )
    # a multiset: duplicates count
    assert execution_match(db, "SELECT DISTINCT city FROM customers", "SELECT city FROM customers") == 0.0


def test_the_reward_never_writes_and_stops_runaway_queries(data_dir: Path) -> None:
    db = data.db_path("shop", data_dir)
    before = _dump(db)
    assert execution_match(db, "DELETE FROM customers", "SELECT COUNT(*) FROM customers") == 0.0
    assert execution_match(db, "DROP TABLE orders", "SELECT COUNT(*) FROM orders") == 0.0
    t0 = time.perf_counter()
    huge = "SELECT COUNT(*) FROM orders a, orders b, orders c, orders d, orders e"
    assert execution_match(db, huge, "SELECT COUNT(*) FROM orders") == 0.0
    assert time.perf_counter() - t0 < 30
    assert _dump(db) == before


def test_extract_sql() -> None:
    assert extract_sql("```sql\nSELECT 1\n```") == "SELECT 1"
    assert extract_sql("Here you go:\n```\nSELECT a FROM t;\n```\nDone.") == "SELECT a FROM t"
    assert (
        extract_sql("The answer is SELECT name FROM t WHERE x = 1; thanks")
        == "SELECT name FROM t WHERE x = 1"
    )
    assert extract_sql("no query here") == "no query here"
    assert extract_sql("```sql\nSELECT 2") == "SELECT 2"  # generation stopped before the fence closed


# --------------------------------------------------------------------------- dev, scripted model


def _expected(kind: str) -> tuple[list[str], list[float], float]:
    """(agents of the LLM calls, their AIR rewards, the final reward) for a scripted behaviour."""
    air = -0.1
    return {
        "good": (["writer"], [0.0], 1.0),
        "fixed": (["writer", "rewriter"], [air, 0.0], 1.0),
        "wrong": (["writer"], [0.0], 0.0),
        "broken": (["writer", "rewriter", "rewriter"], [air, air, air], 0.0),
    }[kind]


def test_dev_with_the_scripted_model(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    pytest.importorskip("transformers")  # Trainer.dev tokenises with it
    import agl.store
    from agl import semconv as sc
    from agl.adapter import Adapter
    from examples.sql_agent import cli
    from examples.sql_agent.scripted import behaviour

    store = agl.store.open(f"sqlite:///{tmp_path / 'dev.db'}")
    args = cli.parser().parse_args(["--data-dir", str(data_dir), "dev", "--backend", "scripted", "-n", "10"])
    transitions = cli.dev(args, store=store)
    out = capsys.readouterr().out
    assert "10 rollouts" in out and "agent=writer" in out

    rollouts = {r.id: r for r in store.query_rollouts()}
    assert len(rollouts) == 10 and all(r.status == "succeeded" for r in rollouts.values())
    by_rollout: dict[str, list[Any]] = defaultdict(list)
    for t in transitions:
        by_rollout[t.rollout_id].append(t)
    kinds = Counter()
    for rid, rollout in rollouts.items():
        task = rollout.input
        kind = behaviour(task)
        kinds[kind] += 1
        agents, air, final = _expected(kind)
        ts = sorted(by_rollout[rid], key=lambda t: t.index)
        assert [t.agent for t in ts] == agents, (kind, task)
        assert [t.intermediate_reward for t in ts] == pytest.approx(air), (kind, task)
        assert all(t.final_reward == final and t.exact for t in ts), (kind, task)
        # the final reward is the execution match of the last query the agent wrote
        last_sql = extract_sql(ts[-1].response_text or "")
        db = data.db_path(task["db_id"], data_dir)
        assert execution_match(db, last_sql, task["gold_sql"]) == final

        spans = store.query_spans(rollout_id=rid)
        tools = [s for s in spans if s.name == sc.SPAN_EXECUTE_TOOL]
        failed = [s for s in tools if s.status.code == "ERROR"]
        assert len(tools) == len(agents) and len(failed) == sum(1 for r in air if r)
        assert all(s.attributes[sc.GEN_AI_TOOL_NAME] == "execute_sql" for s in tools)
        checkers = [
            s
            for s in spans
            if s.name == sc.SPAN_INVOKE_AGENT and s.attributes[sc.GEN_AI_AGENT_NAME] == "checker"
        ]
        assert len(checkers) == len(agents)  # one check per query written
    assert all(kinds[k] for k in ("good", "fixed", "wrong", "broken")), kinds

    # selecting the writer alone: only its calls, the same ids
    writer_only = Adapter(agents=["writer"]).from_store(store, list(rollouts))
    assert [t.agent for t in writer_only] == ["writer"] * len(rollouts)
    assert {(t.rollout_id, t.prompt_ids, t.response_ids) for t in writer_only} == {
        (t.rollout_id, t.prompt_ids, t.response_ids) for t in transitions if t.agent == "writer"
    }


# --------------------------------------------------------------------------- train, tiny model


def _tiny_model() -> Any:
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


def test_train_a_few_steps_with_a_tiny_model(data_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    import torch

    import agl.store
    from agl.adapter import Adapter
    from agl.trainer.trainer import load_tokenizer
    from examples.sql_agent import cli

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run_dir = tmp_path / "run"
    args = cli.parser().parse_args(
        ["--data-dir", str(data_dir), "train", "--run-dir", str(run_dir), "--steps", "2", "--tasks-per-step", "2",
         "--group-size", "2", "--val-tasks", "2", "--val-every", "1", "--max-tokens", "6", "--runners", "4",
         "--learning-rate", "1e-3", "--lora-r", "4", "--credit", "discounted", "--advantage-level", "transition",
         "--kl-coef", "0.05"]
    )  # fmt: skip
    try:
        summary = cli.train(args, model=_tiny_model(), tokenizer=load_tokenizer(), progress=False)
    finally:
        torch.set_num_threads(threads)

    steps = [h for h in summary["history"] if "train_reward" in h]
    assert [h["step"] for h in steps] == [0, 1]
    assert summary["val_reward_before"] is not None and summary["val_reward_after"] is not None
    assert (run_dir / "metrics.jsonl").exists()

    store = agl.store.open(f"sqlite:///{run_dir / 'store.db'}")
    train_ids = [r.id for r in store.query_rollouts(mode="train")]
    assert len(train_ids) == 2 * 2 * 2
    every = Adapter().from_store(store, train_ids)  # no selection: every agent's LLM calls
    assert every and {t.agent for t in every} <= {"writer", "rewriter"}
    for h in steps:
        # discounted credit + transition-level advantages: the AIR penalties tell the calls apart
        # (writer -0.3, rewriters -0.2 and -0.1), so every step updates the policy
        assert h["transitions"] == h["trained_transitions"] > 0
        assert math.isfinite(h["loss"]) and h["zero_variance_groups"] == 0
        assert math.isfinite(h["kl"]) and h["kl"] >= 0.0  # --kl-coef: the k3 estimate to the starting policy
    assert sum(h["transitions"] for h in steps) == len(every)
    # random tokens almost never make valid SQL; whatever ran, AIR charged each failed query (-0.1) to a
    # writer/rewriter call of the same rollout, and a rewriter ran after each failure but the third
    from agl import semconv as sc

    assert all(t.intermediate_reward <= 0.0 for t in every)
    for rid in train_ids:
        tools = [s for s in store.query_spans(rollout_id=rid, name=sc.SPAN_EXECUTE_TOOL) if not s.stale]
        failed = [s for s in tools if s.status.code == "ERROR"]
        mine = [t for t in every if t.rollout_id == rid]
        assert sum(t.intermediate_reward for t in mine) == pytest.approx(-0.1 * len(failed))
        assert Counter(t.agent for t in mine) == Counter(writer=1, rewriter=min(len(failed), 2))


def test_the_oracle_teacher_solves_every_question(data_dir: Path, tmp_path: Path) -> None:
    """``dev --oracle``: the unchanged LangGraph agent, served the gold SQL by the scripted backend,
    earns reward 1 on every question with one writer call and no AIR penalty — demonstrations for
    ``agl sft`` recorded in a store like any rollout."""
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    pytest.importorskip("transformers")
    import agl.store
    from agl.algorithms.sft import SFT
    from examples.sql_agent import cli

    db = f"sqlite:///{tmp_path / 'demos.db'}"
    args = cli.parser().parse_args(
        ["--data-dir", str(data_dir), "dev", "--oracle", "--split", "train", "-n", "8", "--store", db]
    )
    transitions = cli.dev(args)
    assert len({t.rollout_id for t in transitions}) == 8
    assert all(t.final_reward == 1.0 and t.intermediate_reward == 0.0 and t.exact for t in transitions)
    assert {t.agent for t in transitions} == {"writer"} and len(transitions) == 8
    store = agl.store.open(db)
    assert len(SFT(min_reward=1.0).read(store, agents=["writer"])) == 8
    store.close()


def test_every_broken_query_fails_and_every_kind_occurs(data_dir: Path) -> None:
    """The oracle's repair demonstrations: for every question, the broken gold query is refused by
    SQLite (so the checker sends it to the rewriter and AIR penalises it), and over the questions
    every way of breaking one occurs."""
    import sqlite3

    pytest.importorskip("langchain_core")  # scripted.py takes the agents' prompts from agent.py

    from examples.sql_agent.reward import execute
    from examples.sql_agent.scripted import BREAKS, break_query

    kinds = Counter()
    for i, task in enumerate(data.load_tasks("train", data_dir) + data.load_tasks("test", data_dir)):
        db = data.db_path(task["db_id"], data_dir)
        kind, sql = break_query(task, db, i)
        kinds[kind] += 1
        assert sql != task["gold_sql"]
        with pytest.raises(sqlite3.Error):
            execute(db, sql)
    assert all(kinds[k] for k in BREAKS), kinds


def test_the_oracle_demonstrates_repairs(data_dir: Path, tmp_path: Path) -> None:
    """``dev --oracle --repairs 2``: every other question the writer's query fails and the rewriter
    fixes it (reward 1, AIR's penalty on the writer's call); ``agl sft``'s selection keeps the
    rewriter's fix and leaves the broken call out, so the warm start has demonstrations for both
    agents."""
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    pytest.importorskip("transformers")
    import agl.store
    from agl.algorithms.sft import SFT
    from examples.sql_agent import cli

    db = f"sqlite:///{tmp_path / 'repairs.db'}"
    argv = ["--data-dir", str(data_dir), "dev", "--oracle", "--repairs", "2", "--split", "train", "-n", "8"]
    transitions = cli.dev(cli.parser().parse_args([*argv, "--store", db]))
    tasks = data.load_tasks("train", data_dir, limit=8)
    repaired = sum(1 for t in tasks if int(t["id"].rsplit("-", 1)[1]) % 2 == 0)
    assert 0 < repaired < 8
    assert all(t.final_reward == 1.0 and t.exact for t in transitions)
    assert Counter(t.agent for t in transitions) == Counter(writer=8, rewriter=repaired)
    penalised = [t for t in transitions if t.intermediate_reward < 0]
    assert len(penalised) == repaired and {t.agent for t in penalised} == {"writer"}
    store = agl.store.open(db)
    chosen = SFT(min_reward=1.0).select(SFT().read(store, agents=["writer", "rewriter"]))
    assert Counter(t.agent for t in chosen) == Counter(writer=8 - repaired, rewriter=repaired)
    store.close()
    with pytest.raises(SystemExit, match="--oracle"):
        cli.dev(
            cli.parser().parse_args(
                ["--data-dir", str(data_dir), "dev", "--backend", "scripted", "--repairs", "2"]
            )
        )


def test_the_agent_branches_at_the_rewriters_call(data_dir: Path) -> None:
    """sql_agent keeps the replay contract (issue 56): branched at the rewriter's call, the LangGraph app
    asks the gateway the writer's call again (answered from the parent's record, not the model) and the
    rewriter the very same prompt; the branches finish live and score."""
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    pytest.importorskip("transformers")  # the scripted backend tokenises with it
    import agl
    import agl.store
    from agl import semconv as sc
    from agl.adapter import Adapter
    from agl.gateway.testing import ScriptedBackend, serve_gateway
    from agl.runner import Runner
    from agl.trainer.branching import enqueue_branches, without_replayed
    from agl.types import LLM, NewRollout
    from examples.sql_agent.agent import make_rollout
    from examples.sql_agent.scripted import ScriptedSQL, behaviour

    task = next(t for t in data.load_tasks("train", data_dir) if behaviour(t) == "fixed")
    store = agl.store.open("memory://")
    agent = make_rollout(data_dir)
    assert agent.replayable
    try:
        with serve_gateway(ScriptedBackend(ScriptedSQL(data_dir)), store) as url:
            store.add_resources({"llm": LLM(base_url=str(url), model="m")})
            store.enqueue(
                [NewRollout(id="parent", input=task, group_id="q-s0", metadata={sc.ROLLOUT_SEED_KEY: 1})]
            )
            Runner(agent, store).run(until_idle=True)
            ids = enqueue_branches(store, "parent", 1, 3)
            Runner(agent, store, concurrency=3).run(until_idle=True)
            replayed = url.gateway.replays.replayed
    finally:
        agl.uninstrument()
    assert replayed == 3, "each branch's writer call came from the parent's record"
    adapter = Adapter(agents=["writer", "rewriter"])
    parent = adapter.from_store(store, [store.get_rollout("parent")])
    assert [t.agent for t in parent] == ["writer", "rewriter"]
    for rid in ids:
        r = store.get_rollout(rid)
        assert r.status == "succeeded"
        ts = without_replayed(store, r, adapter.from_store(store, [r]))
        assert [t.agent for t in ts] == ["rewriter"] and ts[0].final_reward == 1.0
        assert ts[0].prompt_ids == parent[1].prompt_ids, "the rewriter's prompt, token for token"
