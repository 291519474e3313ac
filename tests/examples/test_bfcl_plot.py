"""examples/bfcl_agent/plot.py: the committed results.json is well formed and draws to a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "examples" / "bfcl_agent" / "results.json"


def test_results_json_counts_fit_their_n() -> None:
    results = json.loads(RESULTS.read_text())
    cats, n = results["categories"], results["n"]
    assert set(n) == set(cats)
    for label, per_cat in results["models"].items():
        assert set(per_cat) == set(cats), label
        assert all(0 <= per_cat[c] <= n[c] for c in cats), label
    for label, per_cat in results["seeds"].items():
        counts = {len(per_cat[c]) for c in cats}
        assert counts == {len(results["seed_ids"][label])}, label  # every category has every seed
        assert all(0 <= v <= n[c] for c in cats for v in per_cat[c]), label


def test_the_plot_draws_every_model_and_category(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from examples.bfcl_agent import plot

    results = json.loads(RESULTS.read_text())
    fig = plot.figure(results)
    assert len(fig.axes[0].patches) == len(results["categories"]) * (
        len(results["models"]) + len(results["seeds"])
    )
    out = tmp_path / "bfcl.png"
    assert plot.main([str(RESULTS), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_refuses_bad_input_and_writes_nothing(tmp_path: Path) -> None:
    from examples.bfcl_agent import plot

    out = tmp_path / "out.png"
    with pytest.raises(SystemExit, match="usage"):
        plot.main(["only-one-argument"])
    with pytest.raises(SystemExit, match="no such file"):
        plot.main([str(tmp_path / "missing.json"), str(out)])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit, match="not JSON"):
        plot.main([str(tmp_path / "bad.json"), str(out)])
    (tmp_path / "partial.json").write_text('{"categories": []}')
    with pytest.raises(SystemExit, match="no n, models"):
        plot.main([str(tmp_path / "partial.json"), str(out)])
    with pytest.raises(SystemExit, match="folder does not exist"):
        plot.main([str(RESULTS), str(tmp_path / "no" / "out.png")])
    assert not out.exists()
