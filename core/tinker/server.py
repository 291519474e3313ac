"""SkyRL's Tinker-API server (``skyrl-tx``) that agl starts, restarts and stops: :class:`SkyRLServer`.

A run that trains on a self-hosted Tinker service (``Serving(backend="tinker", tinker_python=...)``) or
a test against the real server needs it started with what nothing in its own messages points to:

- its own venv (``scripts/tinker-env.sh DIR``: skyrl-tx pins transformers<5, which must not meet
  agl's), whose ``bin/`` goes first on ``PATH``: the server starts its engine with a hard-coded
  ``uv run ... -m tx.tinker.engine``, and the venv's ``uv`` shim runs the venv's python;
- the command: ``<python> -m tx.tinker.api --base-model DIR --backend jax --backend-config
  {"max_lora_adapters": N, "max_lora_rank": R, "sample_max_num_sequences": 4,
  "train_micro_batch_size": 4} --database-url sqlite:///STATE/tinker.db
  --checkpoints-base STATE/checkpoints --host H --port P``; the database and the checkpoints live in
  ``state_dir`` (the run directory's ``tinker/``), so a restarted server still knows the saved states
  a run goes on from;
- the model folder (:func:`server_model_folder`): agl's is written by transformers 5, the server reads
  it with transformers 4, which needs ``rope_theta`` at the top of ``config.json`` and a tokenizer class
  it knows: a derived folder links the weights and rewrites the two JSON files;
- readiness: ``GET /api/v1/healthz`` answers 200 (the engine then loads the model on its own: the
  first request waits for it); a server that exits first fails at once with the end of its log;
- its output goes to ``log_path`` (the run directory's ``tinker.log``); it stops with :meth:`stop`,
  at interpreter exit, and when agl's process dies (:class:`agl.engine.process.ManagedProcess`, as
  the managed vLLM server).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from agl.engine.process import ManagedProcess
from agl.errors import InfraError, UsageError

__all__ = ["PYTHON_ENV", "SkyRLServer", "server_model_folder", "tinker_python_from_env"]

#: sequences per sampling batch on the server (padded to it: one compiled shape per length bucket)
SAMPLE_BUCKET = 4
#: data per training micro-batch on the server (agl pads each forward_backward to a multiple of it)
DATA_BUCKET = 4

#: the fewest LoRA slots a managed server has (the slot count is part of every compiled shape)
MIN_SLOTS = 4

#: where tests and the ``tinker`` tox env name the interpreter that has skyrl-tx installed
PYTHON_ENV = "AGL_TINKER_PYTHON"
_MODULE = "tx.tinker.api"


def tinker_python_from_env() -> str | None:
    """``$AGL_TINKER_PYTHON``: an interpreter with skyrl-tx installed, or None."""
    return os.environ.get(PYTHON_ENV) or None


def server_model_folder(model: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """A folder the server's transformers<5 reads ``model`` from: the weights and every other file
    linked, ``config.json`` with ``rope_theta`` lifted out of transformers 5's ``rope_parameters``,
    ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast`` (transformers 5 writes
    ``TokenizersBackend``). Made once (idempotent); returns ``target``."""
    src, out = Path(model).resolve(), Path(target)
    if not (src / "config.json").is_file():
        raise UsageError(f"{src} is not a model folder (no config.json)")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        dest = out / f.name
        if f.name in ("config.json", "tokenizer_config.json") or dest.exists() or dest.is_symlink():
            continue
        dest.symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    _write_json(out / "config.json", config)
    tok_file = src / "tokenizer_config.json"
    if tok_file.is_file():
        tok = json.loads(tok_file.read_text())
        if tok.get("tokenizer_class") in (None, "TokenizersBackend"):
            tok["tokenizer_class"] = "PreTrainedTokenizerFast"
        _write_json(out / "tokenizer_config.json", tok)
    return out


def _write_json(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2)
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)


class SkyRLServer(ManagedProcess):
    """``SkyRLServer(model_dir, python="/work/tinker-venv/bin/python", state_dir=...).start()`` →
    ``.url`` (the service URL the Tinker SDK takes as ``base_url``) and ``.base_model`` (the name its
    clients ask for: the derived folder's path).

    ``adapters``: LoRA training clients served at once (one per agent; the engine's
    ``max_lora_adapters``, plus one spare for a restore); ``lora_rank``: the largest rank asked for.
    ``port=0``: a free port, kept across restarts.
    """

    what = "Tinker server"
    error = InfraError
    poll_s = 0.5
    stop_timeout_s = 20.0

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        python: str | None = None,
        state_dir: str | os.PathLike[str],
        host: str = "127.0.0.1",
        port: int = 0,
        lora_rank: int = 16,
        adapters: int = 1,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
    ) -> None:
        state = Path(state_dir).resolve()
        super().__init__(
            host=host,
            port=port,
            log_path=log_path if log_path is not None else state / "tinker.log",
            startup_timeout_s=startup_timeout_s,
            python=python or tinker_python_from_env(),
        )
        if not self.python:
            raise UsageError(
                "a managed Tinker server needs an interpreter with skyrl-tx installed (tinker_python=, "
                f"--tinker-python or ${PYTHON_ENV}; make one with scripts/tinker-env.sh DIR)"
            )
        if not os.path.exists(self.python):
            raise UsageError(f"tinker_python {self.python!r}: no such interpreter")
        if int(lora_rank) < 1 or int(adapters) < 1:
            raise UsageError(f"lora_rank and adapters must be >= 1, got {lora_rank} and {adapters}")
        self.state_dir = state
        self.model_dir = server_model_folder(model, self.state_dir / "model")
        self.lora_rank, self.adapters = int(lora_rank), int(adapters)
        self.env = env
        #: JAX's persistent compilation cache (``$AGL_JAX_CACHE``, else ``~/.cache/agl/jax``)
        self.jax_cache = Path(os.environ.get("AGL_JAX_CACHE") or Path.home() / ".cache" / "agl" / "jax")

    @property
    def base_model(self) -> str:
        """The base model's name on this server (its ``--base-model``: the derived folder)."""
        return str(self.model_dir)

    @property
    def url(self) -> str:
        return f"http://{self.hostport}"

    def command(self) -> list[str]:
        backend_config = {
            # index 0 is the base model, one spare slot for a restore; at least MIN_SLOTS, so servers
            # of one or two adapters have the same parameter shapes (and share compiled programs)
            "max_lora_adapters": max(self.adapters + 2, MIN_SLOTS),
            "max_lora_rank": self.lora_rank,
            # fixed batch shapes: a JAX engine compiles once per shape (about a minute each on a CPU)
            "sample_max_num_sequences": SAMPLE_BUCKET,
            "train_micro_batch_size": DATA_BUCKET,
        }
        return [
            str(self.python),
            "-m",
            _MODULE,
            "--base-model",
            self.base_model,
            "--backend",
            "jax",
            "--backend-config",
            json.dumps(backend_config),
            "--database-url",
            f"sqlite:///{self.state_dir / 'tinker.db'}",
            "--checkpoints-base",
            str(self.state_dir / "checkpoints"),
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]

    def environment(self) -> dict[str, str]:
        """The server's environment: its venv's ``bin`` first on ``PATH`` (the ``uv`` shim), offline."""
        env = dict(os.environ if self.env is None else self.env)
        bin_dir = str(Path(self.python).parent)
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("JAX_PLATFORMS", "cpu")
        # compiled shapes kept on disk: a restarted server (or the next run) compiles none again
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(self.jax_cache))
        for key in ("VIRTUAL_ENV", "PYTHONPATH", "AGL_SRC"):  # nothing of agl's venv leaks in
            env.pop(key, None)
        return env

    def prepare(self) -> None:
        (self.state_dir / "checkpoints").mkdir(parents=True, exist_ok=True)

    def is_ready(self) -> bool:
        """``GET /api/v1/healthz`` answers 200 (the engine then loads the model on its own)."""
        import httpx

        return httpx.get(self.url + "/api/v1/healthz", timeout=5).status_code == 200
