"""The held-out check's decoding (``LoopConfig.val_samples``, agl.trainer.heldout), end to end.

A real Trainer (tiny random Llama, the scripted engine behind agl's gateway, the real openai client,
in-process runners): greedy by default, every held-out call reaches the engine at temperature 0 even
when the program asks for 1.0, and the span says so; ``val_samples=K`` runs K sampled rollouts per
held-out task at the run's temperature and reports their mean and pass@K in metrics.jsonl, the
summary, the plot and the trackers' summary.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")
openai = pytest.importorskip("openai")

from test_trainer import BAD, GOOD, _agent_span, one_task_trainer  # noqa: E402

import agl  # noqa: E402
from agl import semconv as sc  # noqa: E402
from agl.config import LoopConfig  # noqa: E402
from agl.run.plot import decoding_title  # noqa: E402
from agl.tracing import provider as tracing  # noqa: E402

TRAIN = [{"q": "a"}, {"q": "b"}]
VAL = [{"q": "What is 7 * 6?"}, {"q": "What is 6 * 7?"}]


@pytest.fixture(autouse=True)
def _instrumented() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    agl.instrument("openai")
    yield
    agl.uninstrument()
    tracing.reset_tracing()
    torch.set_num_threads(n)


class Engine:
    """The scripted engine: records the temperature each call reached it with, by the question asked;
    answers alternate good and bad per question (so a sampled task's K >= 2 rollouts hold some of
    each, in whatever order the runners' concurrent calls arrive: one counter shared by all questions
    could hand one task every good answer and the other every bad one)."""

    def __init__(self) -> None:
        self.n: dict[str, int] = {}
        self.lock = threading.Lock()
        self.seen: list[tuple[str, float | None]] = []

    def __call__(self, request: Any) -> str:
        question = request.messages[-1]["content"]
        with self.lock:
            self.n[question] = self.n.get(question, 0) + 1
            self.seen.append((question, request.temperature))
            return GOOD if self.n[question] % 2 else BAD


def hot_app(task: dict, resources: agl.Resources) -> float:
    """An agent that asks for temperature 1.0 itself (as many pass the resource's sampling on)."""
    llm = resources.llm
    assert llm is not None
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "x")
    with _agent_span("writer"):
        out = client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": task["q"]}],
            max_tokens=16,
            temperature=1.0,
        )
    return 1.0 if (out.choices[0].message.content or "").strip() == GOOD else 0.0


def _llm_spans(trainer: agl.Trainer, mode: str) -> list[Any]:
    store = trainer.store
    spans = []
    for r in store.query_rollouts():
        if r.mode == mode:
            found = store.query_spans(rollout_id=r.id)
            spans += [s for s in found if sc.AGL_LLM_BACKEND in s.attributes]  # the gateway's
    return spans


def test_held_out_is_greedy_by_default_whatever_the_program_asks(tmp_path: Path) -> None:
    engine = Engine()
    trainer = one_task_trainer(tmp_path, script=engine)
    summary = trainer.fit(hot_app, TRAIN, VAL)
    held = {q: t for q, t in engine.seen if q in {v["q"] for v in VAL}}
    trained = [t for q, t in engine.seen if q in {v["q"] for v in TRAIN}]
    assert held and set(held.values()) == {0.0}  # the engine decoded every held-out call greedily
    assert trained and set(trained) == {1.0}  # training keeps the program's (and the run's) temperature
    spans = _llm_spans(trainer, "val")
    assert spans and {s.attributes[sc.GEN_AI_REQUEST_TEMPERATURE] for s in spans} == {0.0}
    assert {s.attributes[sc.AGL_LLM_TEMPERATURE_SOURCE] for s in spans} == {sc.TEMPERATURE_SOURCE_ROLLOUT}
    assert all(sc.AGL_LLM_TEMPERATURE_SOURCE not in s.attributes for s in _llm_spans(trainer, "train"))
    checks = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    checks = [c for c in checks if c.get("val_reward") is not None]
    assert [(c["val_decoding"], c["val_samples"], c["val_rollouts"]) for c in checks] == [
        ("greedy", 1, 2)
    ] * 2
    assert "val_pass_at_k" not in checks[0]
    assert summary["val_decoding"] == "greedy" and "val_pass_at_k_after" not in summary
    assert decoding_title([checks]) == "held-out reward (greedy)"


def test_k_samples_give_mean_and_pass_at_k(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    engine = Engine()
    trainer = one_task_trainer(
        tmp_path, script=engine, val_samples=3, config=agl.RunConfig(temperature=0.7), report_to="mlflow"
    )
    summary = trainer.fit(hot_app, TRAIN, VAL)
    held = [t for q, t in engine.seen if q in {v["q"] for v in VAL}]
    assert len(held) == 2 * 3 * 2 and set(held) == {1.0}  # 3 per task, two checks, the program's own
    store = trainer.store
    checks = [h for h in summary["history"] if h.get("val_reward") is not None]
    for check in checks:
        assert (check["val_decoding"], check["val_samples"], check["val_rollouts"]) == ("sampled", 3, 6)
        vals = [r for r in store.query_rollouts() if r.mode == "val" and r.metadata["step"] == check["step"]]
        rewards: dict[str, list[float]] = {}
        for r in vals:
            rewards.setdefault(r.input["q"], []).append(float(trainer.adapter.rollout_reward(store, r)))
        assert sorted(len(v) for v in rewards.values()) == [3, 3]
        assert check["val_reward"] == pytest.approx(sum(map(sum, rewards.values())) / 6)
        assert check["val_pass_at_k"] == pytest.approx(sum(map(max, rewards.values())) / 2)
        assert check["val_pass_at_k"] > check["val_reward"]  # alternating replies: some of each
    assert summary["val_decoding"] == "sampled" and summary["val_samples"] == 3
    assert summary["val_pass_at_k_before"] == checks[0]["val_pass_at_k"]
    assert summary["val_pass_at_k_after"] == checks[-1]["val_pass_at_k"]
    assert decoding_title([checks]) == "held-out reward (mean of 3 sampled; dashed: pass@3)"
    # the trackers: the setting in the run's parameters, pass@K a series, the decoding a tag
    client = MlflowClient(tracking_uri=f"sqlite:///{trainer.run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("agl").experiment_id])
    assert run.data.params["loop.val_samples"] == "3"
    assert run.data.tags["val_decoding"] == "sampled, 3 per task"
    series = client.get_metric_history(run.info.run_id, "val_pass_at_k")
    assert [m.value for m in series] == pytest.approx([c["val_pass_at_k"] for c in checks])


def test_val_samples_is_checked_and_a_flag_of_agl_train(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="val_samples"):
            LoopConfig(val_samples=bad)
    from agl.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.rsplit("--val-samples VAL_SAMPLES", 1)[-1][:400].split())
    assert "once greedily (temperature 0" in help_text
