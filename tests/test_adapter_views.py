"""An adapter per agent in the read-side tools (issue 35): ``agl plot`` draws a train-reward curve per
adapter, and ``agl export --adapter NAME`` / the dashboard's transitions API keep what one adapter
trains on (its agents' calls that it served itself)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from test_export import read, run_rollout

from agl.cli import main
from agl.dashboard import create_dashboard_app
from agl.errors import UsageError
from agl.lora import lora_pattern
from agl.store import open as open_store
from agl.types import NewRollout


def test_plot_draws_a_train_reward_curve_per_adapter(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from agl.run.plot import adapter_keys, reward_figure

    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": i, "train_reward": i / 10, "train_reward/writer": i / 5, "train_reward/re_writer": 1 - i / 5}
        for i in range(4)
    ]
    rows[1].pop("train_reward/re_writer")  # the rewriter ran on no task of that step
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert adapter_keys(rows) == ["writer", "re_writer"]
    fig = reward_figure([run])
    try:
        _, labels = fig.axes[0].get_legend_handles_labels()
        assert labels == ["writer", "re_writer"]
        writer = [line for line in fig.axes[0].lines if line.get_label() == "re_writer"][0]
        assert list(writer.get_xdata()) == [0.0, 2.0, 3.0]  # a step without the adapter's reward: no point
    finally:
        plt.close(fig)
    assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_adapter_pattern_selects_the_agents_an_adapter_serves() -> None:
    pattern = lora_pattern("re_writer")
    assert [
        a for a in ("re_writer", "re.writer", "re writer", "rewriter", "re-writer") if pattern.fullmatch(a)
    ] == [
        "re_writer",
        "re.writer",
        "re writer",
    ]
    for bad in ("", "re.writer", "a:b"):
        with pytest.raises(UsageError, match="is not an adapter name"):
            lora_pattern(bad)


@pytest.fixture()
def per_agent_db(tmp_path: Path) -> str:
    """Two rollouts of a run with an adapter per agent: the writer, the ``re.writer`` (adapter
    ``re_writer``) and an unselected checker; in the second, the writer's call was served by the
    re_writer adapter (a routing mistake: not the writer's behaviour policy)."""
    url = f"sqlite:///{tmp_path / 'agl.db'}"
    store = open_store(url)
    store.enqueue([NewRollout(id=i, group_id="g1") for i in ("ro-1", "ro-2")])
    calls = [("writer", "42", [42, 0]), ("re.writer", "42!", [42, 1, 0]), ("checker", "ok", [7])]
    served = {"writer": "writer", "re.writer": "re_writer", "checker": "__base__"}
    run_rollout(store, "ro-1", calls, 1.0, served=served)
    run_rollout(store, "ro-2", calls, 0.0, served={**served, "writer": "re_writer"})
    store.close()
    return url


def test_export_keeps_one_adapters_transitions(per_agent_db: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "t.jsonl"
    args = ["export", "--store", per_agent_db, "--format", "transitions", "--out", str(out)]
    assert main([*args, "--adapter", "re_writer"]) == 0
    assert [(r["rollout_id"], r["agent"]) for r in read(out)] == [
        ("ro-1", "re.writer"),
        ("ro-2", "re.writer"),
    ]
    assert main([*args, "--adapter", "writer"]) == 0
    assert [(r["rollout_id"], r["agent"]) for r in read(out)] == [
        ("ro-1", "writer")
    ]  # ro-2's: another served it
    capsys.readouterr()
    assert main([*args, "--adapter", "re.writer"]) == 2
    assert "is not an adapter name" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one selection at a time
        main([*args, "--adapter", "writer", "--agents", "writer"])


def test_dashboard_transitions_filter_by_adapter(per_agent_db: str) -> None:
    store = open_store(per_agent_db)
    try:
        with TestClient(create_dashboard_app(store)) as client:
            url = "/api/rollouts/ro-2/attempts/1/transitions"
            data = client.get(url, params={"adapter": "re_writer"}).json()
            assert [t["agent"] for t in data["transitions"]] == ["re.writer"]
            data = client.get(url, params={"adapter": "writer"}).json()
            assert data["transitions"] == [] and data["stats"]["other_adapter"] == 1
            everyone = client.get(url).json()
            # no selection: the checker's call (the base model served it) and the misrouted writer's are out
            assert [t["agent"] for t in everyone["transitions"]] == ["re.writer"]
            assert everyone["stats"]["other_adapter"] == 2
            bad = client.get(url, params={"adapter": "a:b"})
            assert bad.status_code == 400 and "is not an adapter name" in bad.json()["error"]["message"]
    finally:
        store.close()
