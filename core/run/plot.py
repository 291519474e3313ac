"""``agl plot RUN_DIR...``: the reward curve of training runs (train and held-out reward vs step).

Reads each run's ``metrics.jsonl`` (written by ``Trainer.fit``) and draws, like the LightningRL
paper's Figure 6, the training reward and the validation reward against the training step; several
run directories (e.g. seeds) go on one figure. APO runs (records with ``"algorithm": "apo"``) are
drawn against the round, with every new candidate's validation reward as a dot. A run that trained an
adapter per agent (records with ``train_reward/<adapter>``) gets a train-reward curve per adapter too,
named after it. Uses matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agl.errors import UsageError

__all__ = ["adapter_keys", "plot_run", "plot_runs", "read_metrics", "reward_figure"]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The metric records of a run, in order; a clear error when the directory holds none."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl (is it a Trainer.fit run_dir?)")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise UsageError(f"{path}:{n} is not JSON: {exc}") from None
        if not isinstance(rec, dict) or "step" not in rec:
            raise UsageError(f"{path}:{n} is not a metrics record (no 'step')")
        records.append(rec)
    return records


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(float(r["step"]))
            ys.append(float(v))
    return xs, ys


def _val_series(records: Sequence[dict[str, Any]]) -> list[tuple[int | None, list[float], list[float]]]:
    """The held-out reward as one series per held-out set size, in order of first appearance.

    A run re-checked with ``--resume`` on a larger held-out set (e.g. the first 72 test questions,
    then all 244) holds checks that are not comparable: one line through them would draw a drop or
    a gain that is only the change of set. The size is ``val_tasks`` (``val_rollouts`` for records
    older than it), as the trainer's own before/after summary compares them.
    """
    out: dict[int | None, tuple[list[float], list[float]]] = {}
    for r in records:
        v = r.get("val_reward")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            size = r.get("val_tasks", r.get("val_rollouts"))
            xs, ys = out.setdefault(size if isinstance(size, int) else None, ([], []))
            xs.append(float(r["step"]))
            ys.append(float(v))
    return [(size, xs, ys) for size, (xs, ys) in out.items()]


def decoding_title(runs: Sequence[Sequence[dict[str, Any]]]) -> str:
    """The held-out panel's title, saying how its checks were decoded (agl.trainer.heldout): greedy,
    or the mean of K samples with pass@K dashed; runs decoded in several ways say so, records older
    than ``val_decoding`` say nothing."""
    kinds = {(r["val_decoding"], r.get("val_samples", 1)) for rs in runs for r in rs if r.get("val_decoding")}
    if not kinds:
        return "held-out reward"
    if len(kinds) > 1:
        return "held-out reward (decoded in several ways: see val_decoding)"
    decoding, k = kinds.pop()
    if decoding == "greedy":
        return "held-out reward (greedy)"
    return f"held-out reward (mean of {k} sampled; dashed: pass@{k})"


def _draw_pass_at_k(ax: Any, records: Sequence[dict[str, Any]], color: Any) -> int:
    """A sampled run's ``val_pass_at_k``, dashed in its held-out colour; how many lines drawn."""
    pts = [
        (float(r["step"]), float(r["val_pass_at_k"])) for r in records if r.get("val_pass_at_k") is not None
    ]
    if not pts:
        return 0
    ax.plot([x for x, _ in pts], [y for _, y in pts], linestyle="--", marker=".", color=color)
    return 1


def adapter_keys(records: Sequence[dict[str, Any]]) -> list[str]:
    """The adapters with a per-adapter train reward (``train_reward/<adapter>``), in first-seen order."""
    seen: dict[str, None] = {}
    for r in records:
        for key in r:
            if key.startswith("train_reward/"):
                seen.setdefault(key.split("/", 1)[1], None)
    return list(seen)


def _draw_train(
    ax: Any,
    records: Sequence[dict[str, Any]],
    key: str,
    label: str | None,
    smooth: int,
    apo: bool,
    *,
    style: str = "-",
) -> int:
    """Draw ``key`` against the step on the train panel (APO: points; else faint raw values under
    their moving mean); returns how many curves were drawn (0: no values)."""
    xs, ys = _series(records, key)
    if not xs:
        return 0
    if apo:  # few rounds: points, no smoothing
        ax.plot(xs, ys, marker="o", linestyle=style, label=label)
        return 1
    line = ax.plot(xs, ys, alpha=0.25, linestyle=style)[0]
    ax.plot(xs, _smooth(ys, smooth), color=line.get_color(), linestyle=style, label=label)
    return 1


def _smooth(ys: list[float], k: int) -> list[float]:
    if k <= 1 or len(ys) < 3:
        return ys
    out = []
    for i in range(len(ys)):
        window = ys[max(0, i - k + 1) : i + 1]
        out.append(sum(window) / len(window))
    return out


def plot_runs(
    run_dirs: Sequence[str | Path],
    out: str | Path,
    *,
    title: str | None = None,
    smooth: int = 3,
    baselines: dict[str, float] | None = None,
) -> Path:
    """One figure, two panels (train reward, validation reward), one line per run; returns ``out``.

    ``baselines`` (label -> held-out reward) are drawn as dashed lines on the held-out panel: the
    figure a run started from when it did not re-measure it (``--no-val-before``), e.g. the warm start.
    """
    fig = reward_figure(run_dirs, title=title, smooth=smooth, baselines=baselines)
    import matplotlib.pyplot as plt  # after reward_figure chose the Agg backend

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def reward_figure(
    run_dirs: Sequence[str | Path],
    *,
    title: str | None = None,
    smooth: int = 3,
    baselines: dict[str, float] | None = None,
) -> Any:
    """The matplotlib figure :func:`plot_runs` saves (the caller closes it)."""
    if not run_dirs:
        raise UsageError("plot needs at least one run directory")
    runs = [(Path(d), read_metrics(d)) for d in run_dirs]  # the user's files are checked first
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    apo = all(r.get("algorithm") == "apo" for _, records in runs for r in records)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True, sharex=apo)
    drawn = 0
    per_adapter = False
    for d, records in runs:
        label = d.name if len(runs) > 1 else None
        drawn += _draw_train(axes[0], records, "train_reward", label, smooth, apo)
        for adapter in adapter_keys(records):
            per_adapter = True
            named = f"{label}: {adapter}" if label else adapter
            drawn += _draw_train(axes[0], records, f"train_reward/{adapter}", named, smooth, apo, style="--")
        series = _val_series(records)
        color = None  # one colour a run; a resumed re-check on another held-out set: its own marker, named
        for (size, xs, ys), marker in zip(series, itertools.cycle("osD^")):
            named = label
            if len(series) > 1:
                named = f"{label or 'held-out'}, n={size if size is not None else '?'}"
            color = axes[1].plot(xs, ys, marker=marker, color=color, label=named)[0].get_color()
            drawn += 1
        drawn += _draw_pass_at_k(axes[1], records, color)
    for (name, value), style in zip((baselines or {}).items(), itertools.cycle(("--", ":", "-."))):
        axes[1].axhline(float(value), linestyle=style, color="grey", label=f"{name} ({float(value):.3f})")
        axes[1].set_xlim(left=-0.5)
    if not drawn:
        plt.close(fig)
        raise UsageError(f"no train_reward or val_reward values in {', '.join(str(d) for d, _ in runs)}")
    if apo:  # APO: every candidate's validation reward as dots beside the best-in-beam line
        for _, records in runs:
            for r in records:
                ys = [v for v in r.get("candidate_val_rewards") or [] if isinstance(v, (int, float))]
                axes[1].scatter([r["step"]] * len(ys), ys, s=12, alpha=0.4, color="grey")
    axes[0].set_title(
        "beam reward on the training batch"
        if apo
        else (f"train reward (moving mean of {smooth})" if smooth > 1 else "train reward")
    )
    axes[1].set_title(
        "validation reward (best in beam; dots: candidates)" if apo else decoding_title([r for _, r in runs])
    )
    for ax in axes:
        ax.set_xlabel("APO round" if apo else "training step")
        if apo:
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward")
    if len(runs) > 1 or baselines or any(len(_val_series(r)) > 1 for _, r in runs):
        axes[1].legend(fontsize=8)
    if per_adapter:
        axes[0].legend(fontsize=8)
    fig.suptitle(title or ", ".join(d.name for d, _ in runs))
    fig.tight_layout()
    return fig


def plot_run(run_dir: str | Path, out: str | Path | None = None, **kw: Any) -> Path:
    """``run_dir/reward_curve.png`` (or ``out``) for one run."""
    return plot_runs([run_dir], out or Path(run_dir) / "reward_curve.png", **kw)
