"""``Serving``: how a run serves its policy to the agent and where its rollouts go.

One value holds the serving and deployment settings that ``agl.Trainer``, APO and the examples' CLI
share (the loop's numbers live in :class:`agl.config.LoopConfig`, the update's in
:class:`agl.config.RunConfig`). It validates itself on construction, so a bad value fails before
anything starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl.engine.settings import EngineSettings
from agl.errors import UsageError
from agl.gateway.serve import API_KEY_ENV, check_public_bind

__all__ = ["BACKENDS", "Serving"]

#: the backend names a run can serve with (besides a ``Backend`` instance)
BACKENDS = ("transformers", "vllm", "scripted", "openai", "tinker")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class Serving:
    """Serving and deployment settings of a run (see the field help texts)."""

    backend: Any = field(
        default="transformers",
        metadata=_help(
            "what serves the policy: transformers (embedded, in-process weight swaps), vllm (vllm_url; "
            "LoRA adapters loaded at run time), tinker (a Tinker-API training service: tinker_url or "
            "tinker_python; the update runs there too), scripted (script; tests), openai (base_url; dev "
            "only), or an agl.gateway Backend instance"
        ),
    )
    model: Any = field(
        default=None, metadata=_help("a local path or a loaded PreTrainedModel (None: SmolLM2-135M-Instruct)")
    )
    model_name: str | None = field(default=None, metadata=_help("the name agents call the model by"))
    tokenizer: Any = field(default=None, metadata=_help("a tokenizer (None: the model's, or SmolLM2's)"))
    base_url: str | None = field(default=None, metadata=_help("openai backend: the endpoint's URL"))
    api_key: str | None = field(default=None, metadata=_help("openai backend: the endpoint's API key"))
    vllm_url: str | None = field(
        default=None,
        metadata=_help("vllm backend: a running vLLM OpenAI server's URL (else give vllm_python)"),
    )
    vllm_python: str | None = field(
        default=None,
        metadata=_help(
            "vllm backend: an interpreter with vLLM installed; agl starts the server on the run's model "
            "(LoRA rank, adapters, flags), logs to run_dir/vllm.log, restarts it if it dies, stops it at the end"
        ),
    )
    vllm_args: str | None = field(
        default=None,
        metadata=_help("vllm backend, managed server: more vLLM flags (e.g. '--gpu-memory-utilization 0.5')"),
    )
    vllm_port: int = field(
        default=0, metadata=_help("vllm backend, managed server: its port (0: a free one)")
    )
    tinker_url: str | None = field(
        default=None,
        metadata=_help(
            "tinker backend: a Tinker-API service's URL (Tinker, Fireworks, a running skyrl-tx; else give "
            "tinker_python); its key is read from $TINKER_API_KEY (tinker_api_key_env), never stored"
        ),
    )
    tinker_python: str | None = field(
        default=None,
        metadata=_help(
            "tinker backend: an interpreter with skyrl-tx installed (scripts/tinker-env.sh); agl starts "
            "SkyRL's Tinker server on the run's model, logs to run_dir/tinker/tinker.log, restarts it "
            "if it dies, stops it at the end"
        ),
    )
    base_model: str | None = field(
        default=None,
        metadata=_help(
            "tinker backend: the service's name of the base model (e.g. Qwen/Qwen3-8B; default with "
            "tinker_python: the run's model); the tokenizer comes from model (a local folder)"
        ),
    )
    tinker_api_key_env: str = field(
        default="TINKER_API_KEY",
        metadata=_help("tinker backend: the environment variable holding the service's API key"),
    )
    tinker_timeout_s: float = field(
        default=600.0,
        metadata=_help(
            "tinker backend: the longest one call to the service may take (a lost service fails the "
            "run within a few of these, naming its URL and the last good step)"
        ),
    )
    script: Any = field(default=None, metadata=_help("scripted backend: the replies"))
    store: Any = field(default=None, metadata=_help("a Store or URL (None: SQLite in run_dir)"))
    run_dir: Path = field(default=Path("runs/agl"), metadata=_help("where metrics, checkpoints, store go"))
    runners: int = field(
        default=4, metadata=_help("in-process rollout concurrency (0: external `agl runner` processes)")
    )
    gateway_url: str | None = field(
        default=None, metadata=_help("a gateway started elsewhere (`agl gateway serve`) to use instead")
    )
    gateway_bind: str = field(
        default="127.0.0.1:0", metadata=_help("HOST:PORT the in-process gateway binds (port 0: a free one)")
    )
    gateway_advertise: str | None = field(
        default=None, metadata=_help("the gateway URL published to runners (default: the bound address)")
    )
    gateway_api_key: str | None = field(
        default=None, metadata=_help(f"the gateway's bearer token (default: ${API_KEY_ENV})")
    )
    progress: bool = field(default=True, metadata=_help("show progress bars"))
    engine: EngineSettings = field(
        default_factory=EngineSettings,
        metadata=_help(
            "backend='transformers': the embedded engine's settings (agl.engine.EngineSettings: dtype, "
            "prefix cache, batched LoRA, deterministic, batch size, threads), carried whole to the engine"
        ),
    )
    report_to: Any = field(
        default=None,
        metadata=_help(
            "experiment trackers each step's metrics, the config and the reward plot go to: tensorboard, "
            "trackio, wandb, mlflow, all or none (default: tensorboard when installed)"
        ),
    )
    project: str | None = field(
        default=None, metadata=_help("the trackers' project (W&B project, MLflow experiment; default: agl)")
    )
    run_name: str | None = field(
        default=None, metadata=_help("the run's name in the trackers (default: run_dir's folder name)")
    )

    def __post_init__(self) -> None:
        from agl.run.trackers import resolve_report_to

        self.report_to = resolve_report_to(self.report_to)  # names checked here, packages by MetricsLog
        if isinstance(self.backend, str) and self.backend not in BACKENDS:
            raise UsageError(
                f"backend must be one of {', '.join(BACKENDS)} or a Backend instance, got {self.backend!r}"
            )
        if isinstance(self.runners, bool) or not isinstance(self.runners, int) or self.runners < 0:
            raise UsageError(f"runners must be an integer >= 0, got {self.runners!r}")
        if self.backend == "vllm" and not self.vllm_url and not self.vllm_python:
            raise UsageError(
                "backend='vllm' needs vllm_url (a running vLLM OpenAI server, e.g. http://host:8000/v1) or "
                "vllm_python (an interpreter with vLLM installed: agl starts the server)"
            )
        self._check_tinker()
        if self.vllm_url and self.vllm_python:
            raise UsageError("give vllm_url (a running server) or vllm_python (agl starts one), not both")
        if not isinstance(self.engine, EngineSettings):
            raise UsageError(f"engine must be an agl.engine.EngineSettings, got {type(self.engine).__name__}")
        self.engine.check_backend(self.backend)  # a setting the backend cannot honour is refused by name
        if self.backend == "scripted" and self.script is None:
            raise UsageError("backend='scripted' needs script= (replies, see agl.gateway.ScriptedBackend)")
        self.run_dir = Path(self.run_dir)
        self.gateway_api_key = self.gateway_api_key or os.environ.get(API_KEY_ENV) or None
        host, _ = self.bind
        if self.gateway_url is None:
            check_public_bind(host, self.gateway_api_key)

    def _check_tinker(self) -> None:
        """The tinker backend's settings: a service (URL or an interpreter to start one), a base model
        name for a URL, a sane timeout; and none of them asked of another backend."""
        given = [k for k in ("tinker_url", "tinker_python", "base_model") if getattr(self, k)]
        if self.backend != "tinker":
            if given:
                raise UsageError(f"{', '.join(given)}: settings of backend='tinker', not {self.backend!r}")
            return
        if not self.tinker_url and not self.tinker_python:
            raise UsageError(
                "backend='tinker' needs tinker_url (a Tinker-API service, e.g. https://...) or "
                "tinker_python (an interpreter with skyrl-tx installed: agl starts SkyRL's server)"
            )
        if self.tinker_url and self.tinker_python:
            raise UsageError(
                "give tinker_url (a running service) or tinker_python (agl starts one), not both"
            )
        if self.tinker_url and not self.base_model:
            raise UsageError(
                "backend='tinker' with tinker_url needs base_model: the service's name of the base model "
                "(e.g. 'Qwen/Qwen3-4B-Instruct-2507'); model= names the local folder of its tokenizer"
            )
        if self.tinker_url and not str(self.tinker_url).startswith(("http://", "https://")):
            raise UsageError(f"tinker_url must be an http(s) URL, got {self.tinker_url!r}")
        timeout = self.tinker_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise UsageError(f"tinker_timeout_s must be a number of seconds > 0, got {timeout!r}")
        if self.vllm_url or self.vllm_python or self.base_url:
            raise UsageError(
                "backend='tinker' samples from the service: vllm_url, vllm_python and base_url do not apply"
            )

    @property
    def bind(self) -> tuple[str, int]:
        """``gateway_bind`` as ``(host, port)``."""
        host, _, port = str(self.gateway_bind).rpartition(":")
        if not host or not port.isdigit():
            raise UsageError(
                f"gateway_bind must be HOST:PORT (port 0 for a free one), got {self.gateway_bind!r}"
            )
        return host, int(port)

    def store_url(self) -> str | None:
        """The run's store as a URL the ``agl`` commands open: SQLite in ``run_dir`` when none was given,
        the URL given, or None for an in-memory store or a store object (nothing to point a command at)."""
        if self.store is None:
            return f"sqlite:///{(Path(self.run_dir) / 'store.db').resolve()}"
        if isinstance(self.store, str) and not self.store.startswith("memory"):
            return self.store
        return None
