"""Experiment trackers a run reports to: ``report_to=[...]`` (``--report-to``).

Each step's metrics record — what :class:`agl.run.metrics.MetricsLog` appends to ``metrics.jsonl``,
the held-out checks (``val_reward``) and the per-agent and per-adapter series
(``train_reward/<adapter>``, named as the dashboard names them) included — goes to every tracker
named, at the record's ``step``; so do the run's resolved configuration (when the run starts), the
reward-curve plot (when it ends) and the held-out reward before and after (the run's summary).
How the held-out checks were decoded (``LoopConfig.val_samples``, :mod:`agl.trainer.heldout`) is in
the configuration (``loop.val_samples``), in each check's metrics (``val_samples``, and
``val_pass_at_k`` when sampled), in W&B's summary (``val_decoding``), as TensorBoard text and as an
MLflow tag (``val_decoding``: ``greedy`` or ``sampled, K per task``).

==============  =========================  =========================================================
name            extra                      where it writes
==============  =========================  =========================================================
``tensorboard`` ``agl[train]``             ``run_dir/tb`` (``tensorboard --logdir run_dir/tb``)
``trackio``     ``agl[trackio]``           trackio's local database (``$TRACKIO_DIR``, default
                                           ``~/.cache/huggingface/trackio``): ``trackio show``
``wandb``       ``agl[wandb]``             Weights & Biases (``WANDB_MODE=offline``: ``run_dir/wandb``,
                                           ``wandb sync`` later)
``mlflow``      ``agl[mlflow]``            ``$MLFLOW_TRACKING_URI``, else ``run_dir/mlflow.db`` and
                                           ``run_dir/mlflow-artifacts`` (``mlflow ui
                                           --backend-store-uri sqlite:///run_dir/mlflow.db``); a
                                           ``file:`` URI is refused before the run starts (MLflow 3
                                           opens no file store)
==============  =========================  =========================================================

A tracker's client is imported only when it is named, and a named tracker whose package is missing
is refused before the run starts, naming the extra to install. ``report_to=None`` is TensorBoard
when it is installed and nothing otherwise (what runs did before trackers could be named);
``"none"`` or ``[]`` is no tracker; ``"all"`` is every tracker whose package is installed. The
project is ``project`` (default ``agl``; W&B's ``WANDB_PROJECT`` and MLflow's
``MLFLOW_EXPERIMENT_NAME`` win over the default) and the run's name ``run_name`` (default: the run
directory's name). A resumed run (``resume=True``) continues the same W&B and MLflow run: their ids
are kept in ``run_dir/trackers.json``.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from agl.errors import UsageError

__all__ = [
    "TRACKERS",
    "Tracker",
    "check_installed",
    "check_settings",
    "numeric_metrics",
    "open_trackers",
    "resolve_report_to",
    "run_config",
]

log = logging.getLogger("agl.trackers")

#: tracker name -> (the module it needs, the extra that installs it)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "train"),
    "trackio": ("trackio", "trackio"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


def _installed(name: str) -> bool:
    module = TRACKERS[name][0]
    if importlib.util.find_spec(module) is None:
        return False
    return name != "tensorboard" or importlib.util.find_spec("torch") is not None  # torch's writer


def resolve_report_to(value: Any) -> tuple[str, ...] | None:
    """``report_to`` as a tuple of tracker names (None: TensorBoard when installed). Accepts a name, a
    comma-separated string, a list, ``"none"`` and ``"all"``; an unknown name is refused with the
    closest one."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    names: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise UsageError(f"report_to takes tracker names, got {item!r}")
        name = item.strip().lower()
        if name in ("", "none"):
            continue
        if name == "all":
            names += [n for n in TRACKERS if _installed(n)]
            continue
        if name not in TRACKERS:
            close = difflib.get_close_matches(name, list(TRACKERS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UsageError(
                f"report_to: unknown tracker {item!r}{hint} (agl reports to {', '.join(TRACKERS)})"
            )
        names.append(name)
    return tuple(dict.fromkeys(names))


def check_installed(names: Sequence[str] | None) -> None:
    """Refuse a named tracker whose package is not installed, naming the extra (before a run starts)."""
    for name in names or ():
        if not _installed(name):
            module, extra = TRACKERS[name]
            missing = "torch" if name == "tensorboard" and importlib.util.find_spec(module) else module
            raise UsageError(
                f"report_to {name!r} needs {missing}, which is not installed: pip install 'agl[{extra}]'"
            )


def _file_store(uri: str) -> bool:
    """Whether MLflow reads ``uri`` as its file store: ``file:`` URIs and plain paths (no scheme, or a
    Windows drive letter), the two schemes MLflow's own registry maps to ``FileStore``."""
    scheme = urlsplit(uri).scheme
    return scheme in ("", "file") or len(scheme) == 1


def check_settings(names: Sequence[str] | None) -> None:
    """Refuse, before a run starts, a named tracker whose settings it would refuse only once the run is
    under way: ``MLFLOW_TRACKING_URI`` naming a file store, which MLflow 3 no longer opens (unless
    ``MLFLOW_ALLOW_FILE_STORE`` says to), so the run would fail at its first step with MLflow's own
    exception instead of this one line."""
    if "mlflow" not in (names or ()):
        return
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("1", "true")
    if uri and _file_store(uri) and not allowed:
        raise UsageError(
            f"MLFLOW_TRACKING_URI={uri} is a file store, which MLflow 3 refuses: use sqlite:///PATH/mlflow.db "
            "(or a tracking server's http:// URL), or unset it to get the run's own run_dir/mlflow.db"
        )


def numeric_metrics(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics record, nested dicts flattened with ``/`` (``step`` and booleans left
    out: a tracker plots numbers against the step)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(numeric_metrics(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and name != "step":
            out[name] = float(value)
    return out


def held_out_note(summary: Mapping[str, Any]) -> str:
    """``greedy`` or ``sampled, K per task``: a run summary's held-out decoding, for a tracker's tag."""
    if summary.get("val_decoding") == "sampled":
        return f"sampled, {summary.get('val_samples', 1)} per task"
    return str(summary.get("val_decoding"))


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested configuration as ``section.key`` -> a scalar (what MLflow's params and W&B's config show)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_config(value, name + "."))
        elif value is None or isinstance(value, (str, int, float, bool)):
            out[name] = value
        else:
            out[name] = json.dumps(value, default=str) if isinstance(value, (list, tuple)) else str(value)
    return out


#: settings a tracker must never receive (they are sent to a server and shown to everyone who can see it)
_SECRETS = frozenset({"api_key", "gateway_api_key"})


def _shown(name: str, value: Any) -> Any:
    if name in _SECRETS:
        return None if value is None else "***"
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [_shown(name, v) for v in value]
    return f"<{type(value).__name__}>"  # a loaded model, a script function, a Store object


def run_config(algorithm: Any, **sections: Any) -> dict[str, dict[str, Any]]:
    """A run's resolved configuration for the trackers: ``{"algorithm": {...}, section: {...}}`` from
    the algorithm and the config dataclasses (``serving=``, ``loop=``, ...); objects that are not
    settings (a loaded model, a script) by their type, secrets (API keys) as ``***``."""
    from dataclasses import fields, is_dataclass

    def as_dict(value: Any) -> dict[str, Any]:
        if not is_dataclass(value):
            return {}
        return {f.name: _shown(f.name, getattr(value, f.name)) for f in fields(value)}

    out = {"algorithm": {"name": type(algorithm).__name__, **as_dict(algorithm)}}
    out.update({name: as_dict(value) for name, value in sections.items()})
    return out


class Tracker:
    """One experiment tracker; the base class is the interface (every method may be left as is)."""

    name = "tracker"

    def start(self, config: Mapping[str, Any]) -> None:
        """The run starts: record its resolved configuration."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """One step's numbers."""

    def log_plot(self, path: Path) -> None:
        """The reward-curve PNG, once the run ends."""

    def finish(self, summary: Mapping[str, Any]) -> None:
        """The run ends (``summary``: the held-out reward before and after, when measured)."""


class _Ids:
    """``run_dir/trackers.json``: the W&B and MLflow run ids, so a resumed run continues the same run."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "trackers.json"

    def get(self, name: str) -> str | None:
        try:
            return json.loads(self.path.read_text()).get(name)
        except (OSError, ValueError):
            return None

    def put(self, name: str, run_id: str) -> None:
        data: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(self.path.read_text())
        data[name] = run_id
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)


class TensorBoard(Tracker):
    name = "tensorboard"

    def __init__(self, run_dir: Path, **_: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"))

    def start(self, config: Mapping[str, Any]) -> None:
        text = "\n".join(f"    {k}: {v}" for k, v in flat_config(config).items())  # markdown code block
        self.writer.add_text("config", text or "    (none)", 0)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_plot(self, path: Path) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as img:
            self.writer.add_image("reward_curve", np.asarray(img.convert("RGB")), dataformats="HWC")
        self.writer.flush()

    def finish(self, summary: Mapping[str, Any]) -> None:
        if summary.get("val_decoding"):  # how the held-out figures were decoded (agl.trainer.heldout)
            self.writer.add_text("val_decoding", held_out_note(summary))
        self.writer.close()


class Trackio(Tracker):
    name = "trackio"

    def __init__(self, run_dir: Path, project: str | None, run_name: str, resume: bool, **_: Any) -> None:
        import trackio

        self.trackio = trackio
        self.project = project or "agl"
        self.run_name, self.resume = run_name, resume
        self.run: Any = None
        self.last_step = 0

    def start(self, config: Mapping[str, Any]) -> None:
        self.run = self.trackio.init(
            project=self.project,
            name=self.run_name,
            config=flat_config(config),
            resume="allow" if self.resume else "never",
            embed=False,
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.last_step = step
        self.run.log(dict(metrics), step=step)

    def log_plot(self, path: Path) -> None:
        self.run.log({"reward_curve": self.trackio.Image(str(path))}, step=self.last_step)

    def finish(self, summary: Mapping[str, Any]) -> None:
        self.run.finish()


class Wandb(Tracker):
    name = "wandb"

    def __init__(self, run_dir: Path, project: str | None, run_name: str, resume: bool, **_: Any) -> None:
        import wandb

        self.wandb = wandb
        self.run_dir, self.run_name, self.resume = run_dir, run_name, resume
        self.project = project or os.environ.get("WANDB_PROJECT") or "agl"
        self.ids = _Ids(run_dir)
        self.run: Any = None

    def start(self, config: Mapping[str, Any]) -> None:
        run_id = self.ids.get("wandb") if self.resume else None
        self.run = self.wandb.init(
            project=self.project,
            name=self.run_name,
            dir=str(self.run_dir),
            config=flat_config(config),
            id=run_id,
            resume="allow" if run_id else None,
            reinit="create_new",
        )
        self.ids.put("wandb", self.run.id)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_plot(self, path: Path) -> None:
        self.run.log({"reward_curve": self.wandb.Image(str(path))})

    def finish(self, summary: Mapping[str, Any]) -> None:
        for key, value in summary.items():
            if value is not None:
                self.run.summary[key] = value
        self.run.finish()


class Mlflow(Tracker):
    name = "mlflow"

    def __init__(self, run_dir: Path, project: str | None, run_name: str, resume: bool, **_: Any) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        #: with no tracking server named, the run's own SQLite database and artifacts in run_dir (MLflow
        #: 3 refuses its old ./mlruns file store, and would put artifacts in the working directory)
        self.artifacts = None if uri else (run_dir / "mlflow-artifacts").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
        self.experiment = project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "agl"
        self.run_name, self.resume, self.ids = run_name, resume, _Ids(run_dir)
        self.run_id: str | None = None

    def start(self, config: Mapping[str, Any]) -> None:
        self.run_id = self.ids.get("mlflow") if self.resume else None
        if self.run_id is None:
            found = self.client.get_experiment_by_name(self.experiment)
            if found is None:
                exp_id = self.client.create_experiment(self.experiment, artifact_location=self.artifacts)
            else:
                exp_id = found.experiment_id
            self.run_id = self.client.create_run(exp_id, run_name=self.run_name).info.run_id
            self.ids.put("mlflow", self.run_id)
            from mlflow.entities import Param

            params = [Param(k, str(v)[:6000]) for k, v in flat_config(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_dict(self.run_id, dict(config), "config.json")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_plot(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, summary: Mapping[str, Any]) -> None:
        if summary.get("val_decoding"):  # how the held-out figures were decoded (agl.trainer.heldout)
            self.client.set_tag(self.run_id, "val_decoding", held_out_note(summary))
        self.client.set_terminated(self.run_id)


_CLASSES: dict[str, type[Tracker]] = {
    "tensorboard": TensorBoard,
    "trackio": Trackio,
    "wandb": Wandb,
    "mlflow": Mlflow,
}


def open_trackers(
    names: Sequence[str] | None,
    run_dir: Path,
    *,
    project: str | None = None,
    run_name: str | None = None,
    resume: bool = False,
) -> list[Tracker]:
    """The trackers ``names`` (:func:`resolve_report_to`'s result; None: TensorBoard when installed),
    their clients imported now."""
    if names is None:
        names = ("tensorboard",) if _installed("tensorboard") else ()
    check_installed(names)
    check_settings(names)
    run_name = run_name or Path(run_dir).resolve().name
    return [
        _CLASSES[name](run_dir=Path(run_dir), project=project, run_name=run_name, resume=resume)
        for name in names
    ]
