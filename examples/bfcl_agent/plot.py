"""``python -m examples.bfcl_agent.plot RESULTS.json OUT.png``: the held-out table as a bar chart.

RESULTS.json holds ``{"categories": [...], "n": {category: cases}, "models": {label: {category:
correct}}, "seeds": {label: {category: [correct per seed]}}, "seed_ids": {label: [seed, ...]}}``:
the figures that ``eval`` printed, one JSON line per category and model (results.json beside this
file is the 2026-12-04 run, with each model's failure kinds under ``failures``). A model with
seeds is drawn at its mean, with each seed as a dot and the min-max range as the bar's whisker.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def figure(results: dict[str, Any]) -> Any:
    """The matplotlib figure: accuracy (%) per category, one bar per model (the caller saves it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats: list[str] = results["categories"]
    n: dict[str, int] = results["n"]
    models: dict[str, dict[str, float]] = results["models"]
    seeds: dict[str, dict[str, list[int]]] = results.get("seeds", {})
    labels = list(models) + [m for m in seeds if m not in models]
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, label in enumerate(labels):
        xs = [c + (i - (len(labels) - 1) / 2) * width for c in range(len(cats))]
        if label in seeds:
            per = [[100 * v / n[cat] for v in seeds[label][cat]] for cat in cats]
            means = [sum(p) / len(p) for p in per]
            err = [
                [m - min(p) for m, p in zip(means, per, strict=True)],
                [max(p) - m for m, p in zip(means, per, strict=True)],
            ]
            ax.bar(xs, means, width, yerr=err, capsize=3, label=f"{label} (mean of {len(per[0])} seeds)")
            for x, m, p in zip(xs, means, per, strict=True):  # above the whisker, not on it
                ax.text(x, max(p) + 1.5, f"{m:.0f}", ha="center", va="bottom", fontsize=6)
            for x, p in zip(xs, per, strict=True):
                ax.plot([x] * len(p), p, "k.", markersize=4)
        else:
            values = [100 * models[label][cat] / n[cat] for cat in cats]
            bars = ax.bar(xs, values, width, label=label)
            ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], fontsize=6, padding=2)
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels([f"{c}\n(n={n[c]})" for c in cats], fontsize=8)
    ax.set_ylabel("held-out accuracy, BFCL's checker (%)")
    ax.set_ylim(0, 128)  # room above 100 for the legend
    ax.set_yticks(range(0, 101, 20))
    ax.set_title(results.get("title", "BFCL, held-out, greedy"), fontsize=10)
    ax.legend(fontsize=7, loc="upper center", ncol=3)
    fig.tight_layout()
    return fig


def load(path: Path) -> dict[str, Any]:
    """RESULTS.json, refused in one line when it is missing, not JSON or lacks a key the plot reads."""
    try:
        results = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{path}: not JSON ({exc})") from None
    missing = [k for k in ("categories", "n", "models") if k not in results]
    if missing:
        raise SystemExit(f"{path}: no {', '.join(missing)} (see this module's docstring)")
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: python -m examples.bfcl_agent.plot RESULTS.json OUT.png")
    results = load(Path(argv[0]))
    if not Path(argv[1]).parent.is_dir():
        raise SystemExit(f"{argv[1]}: its folder does not exist")
    fig = figure(results)
    fig.savefig(argv[1], dpi=120)
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
