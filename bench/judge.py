"""Issue 38's measurements of the judge machinery (no capable judge model runs on this CPU).

``python bench/judge.py replay`` — the sql_agent ``COUNT(*)`` hack replayed through the monitors.
No per-rollout data of that run is stored in the repository, so the replay is *constructed* from the
per-step figures examples/sql_agent/README.md reports for the discounted-credit run (held-out reward
0.083 → 0.167 → 0.042 at steps 0/3/6; writer's queries that run 9 → 19 → 21 of 24; LLM calls per
rollout 2.25 → 1.42 → 1.25; ``COUNT(*)`` queries 8 → 18 → 23 of 24), linearly interpolated between
the reported steps, 16 training rollouts per step (2 tasks × 8), each query execution one tool call,
the ``COUNT(*)`` queries of the form the README quotes (``SELECT COUNT(*) FROM dishes WHERE name = '…'``),
AIR −0.1 per query that fails, the training task reward equal to the held-out one. It prints, per
step, the monitors' metrics and which fired.

``python bench/judge.py cost`` — judge cost per step (calls, tokens, seconds) on a short scripted
Trainer run with a scripted relative judge (tests/judge's setup), from the run's metrics.jsonl.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from agl.config import LoopConfig
from agl.run.settings import Serving

REPORTED = {0: (0.083, 9, 2.25, 8), 3: (0.167, 19, 1.42, 18), 6: (0.042, 21, 1.25, 23)}


def _interp(step: int) -> tuple[float, float, float, float]:
    lo = max(s for s in REPORTED if s <= step)
    hi = min(s for s in REPORTED if s >= step)
    if lo == hi:
        return REPORTED[lo]
    f = (step - lo) / (hi - lo)
    return tuple(a + f * (b - a) for a, b in zip(REPORTED[lo], REPORTED[hi], strict=True))  # type: ignore[return-value]


def _step_rollouts(step: int) -> tuple[Any, dict[str, Any]]:
    from agl.adapter.air_rules import reward_breakdown
    from agl.trainer.monitors import StepData
    from agl.types import Transition

    val, runs, calls, counts = _interp(step)
    transitions, task_of, tools = {}, {}, {}
    n = 16
    for i in range(n):
        rid, task = f"s{step}-r{i}", f"q{i // 8}"
        k = int(calls) + (1 if i / n < calls - int(calls) else 0)  # LLM calls: writer + rewrites
        fails = 1 if i / n < 1 - runs / 24 else 0
        count = (i % 8) / 8 < counts / 24  # the same COUNT(*) share in both tasks' groups
        col = ("name", "price", "city")[i % 3]
        table = ("dishes", "restaurants")[i // 8]
        sql = (
            f"SELECT COUNT(*) FROM dishes WHERE name = '{task}'"
            if count
            else f"SELECT {col} FROM {table} WHERE {col} > {i}"
        )
        task_reward = 1.0 if i / n < val else 0.0
        ts = [
            Transition(
                rollout_id=rid,
                attempt=1,
                index=j,
                prompt_ids=(1, 2, 3),
                response_ids=tuple(range(len(sql) // 4)),
                response_text=sql,
                final_reward=task_reward,
                intermediate_reward=-0.1 * fails if j == k - 1 else 0.0,
            )
            for j in range(k)
        ]
        transitions[rid], task_of[rid], tools[rid] = ts, task, k
    flat = [t for ts in transitions.values() for t in ts]
    record = {"step": step, "train_reward": sum(ts[0].final_reward for ts in transitions.values()) / n}
    record.update(reward_breakdown(flat))
    if step in REPORTED:
        record["val_reward"] = val
    data = StepData(
        step=step, transitions=transitions, task_of=task_of, tool_calls=tools, val_ids=[f"val-{step}"]
    )
    return data, record


def replay() -> None:
    from agl.trainer.monitors import Monitors

    monitors, history = Monitors(), []
    for step in range(7):
        data, record = _step_rollouts(step)
        record.update(monitors.observe(data, record, history))
        history.append(record)
        fired = [f"{w['monitor']}: {w['message']}" for w in record["monitor_warnings"]]
        keys = ("monitor_air_share", "monitor_tool_rate_drift", "monitor_length_drift", "monitor_val_delta")
        shown = {k.removeprefix("monitor_"): round(record[k], 3) for k in keys if record.get(k) is not None}
        print(f"step {step}: {shown}")
        for f in fired:
            print(f"   FIRED {f}")


def cost() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "judge"))
    from test_trainer_judge import Engine, judge_script, no_reward_agent, tiny_model

    import agl
    from agl.gateway.testing import ScriptedBackend
    from agl.trainer.trainer import Trainer, load_tokenizer

    agl.instrument("openai")
    with tempfile.TemporaryDirectory() as tmp:
        judge = agl.Judge(backend=ScriptedBackend(judge_script, accept_any_model=True), model="judge-m")
        trainer = Trainer(
            agl.LightningRL(group_size=4, learning_rate=1e-2, lora_r=4, lora_alpha=8),
            model=tiny_model(),
            judge=judge,
            reward="judge",
            serving=Serving(
                backend="scripted",
                script=Engine(),
                runners=4,
                run_dir=Path(tmp) / "run",
                tokenizer=load_tokenizer(),
                progress=False,
            ),
            loop=LoopConfig(tasks_per_step=4, steps=3, val_every=0, val_before=False),
        )
        trainer.fit(no_reward_agent, [{"q": f"What is {i} * 6?"} for i in range(12)])
        for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            keys = (
                "judge_calls",
                "judge_prompt_tokens",
                "judge_completion_tokens",
                "judge_s",
                "rollout_s",
                "step_s",
            )
            print(
                {"step": r["step"], **{k: round(r[k], 3) if isinstance(r[k], float) else r[k] for k in keys}}
            )


if __name__ == "__main__":
    {"replay": replay, "cost": cost}[sys.argv[1] if len(sys.argv) > 1 else "replay"]()
