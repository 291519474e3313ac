"""What a running vLLM server offers agl, asked over HTTP: :func:`probe` → :class:`VLLMSupport`.

agl needs three things of a vLLM server to train through it, each switched on by a flag or an
environment variable that vLLM itself never mentions when it is missing:

- **token ids** (``return_token_ids``, vLLM >= 0.10.2): the exact ids the engine saw and produced;
  checked by one real one-token completion sent as prompt ids (``generate=True``), else by the request
  field's presence in the OpenAPI schema;
- **runtime LoRA updates**: ``POST /v1/load_lora_adapter`` exists only when the server runs with
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, and loading works only with ``--enable-lora`` (an adapter
  loaded into a server without it is refused; agl names the flag);
- **the pause API** (``POST /pause?mode=keep``, ``/resume``): only with ``VLLM_SERVER_DEV_MODE=1``;
  without it weight pushes load adapters without pausing (optional).

The routes come from FastAPI's ``GET /openapi.json`` (served unless ``--disable-fastapi-docs``).
``agl doctor --upstream URL`` prints :meth:`VLLMSupport.report`; a managed server
(:class:`agl.engine.vllm_server.VLLMServer`) refuses to start without what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["VLLMSupport", "probe"]

_LORA_FLAGS = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in the server's environment"
_DEV_FLAGS = "VLLM_SERVER_DEV_MODE=1 in the server's environment"


@dataclass
class VLLMSupport:
    """What one vLLM server offers; ``None`` where it could not be told."""

    url: str
    reachable: bool = False
    error: str | None = None
    version: str | None = None
    #: ``/v1/models`` entries: ``{"id", "root", "parent", "max_model_len"}``
    models: list[dict[str, Any]] = field(default_factory=list)
    routes: set[str] = field(default_factory=set)
    schema: bool = False  # whether /openapi.json was served
    token_ids: bool | None = None
    lora_enabled: bool | None = None  # --enable-lora
    pause_keep: bool | None = None

    @property
    def runtime_lora(self) -> bool | None:
        return "/v1/load_lora_adapter" in self.routes if self.schema else None

    @property
    def token_in(self) -> bool | None:
        """vLLM's token-in/token-out route (``/inference/v1/generate``)."""
        return "/inference/v1/generate" in self.routes if self.schema else None

    @property
    def sleep(self) -> bool | None:
        """``POST /sleep`` / ``/wake_up`` (frees the GPU for a colocated trainer; dev mode)."""
        return "/sleep" in self.routes if self.schema else None

    def base_model(self) -> dict[str, Any] | None:
        """The first model that is not a LoRA adapter (no ``parent``)."""
        return next((m for m in self.models if not m.get("parent")), self.models[0] if self.models else None)

    def missing(self, *, lora: bool = True, pause: bool = False) -> list[str]:
        """What agl needs and the server lacks, each naming the flag that turns it on."""
        if not self.reachable:
            return [f"no vLLM server answers at {self.url} ({self.error})"]
        out = []
        if self.token_ids is False:
            out.append("token ids (return_token_ids): a vLLM >= 0.10.2")
        if lora and self.runtime_lora is False:
            out.append(f"runtime LoRA loading (POST /v1/load_lora_adapter): {_LORA_FLAGS}")
        if lora and self.lora_enabled is False:
            out.append(
                "LoRA adapters: the --enable-lora flag (and --max-lora-rank at least the trained rank)"
            )
        if pause and self.pause_keep is False:
            out.append(f"pausing generation around a push (POST /pause?mode=keep): {_DEV_FLAGS}")
        return out

    def report(self) -> str:
        """The ``agl doctor --upstream`` text."""
        if not self.reachable:
            return f"vLLM at {self.url}: unreachable ({self.error})"
        lines = [f"vLLM at {self.url} (version {self.version or 'unknown'})"]
        for m in self.models:
            kind = f"LoRA adapter of {m['parent']}" if m.get("parent") else "model"
            limit = f", max_model_len {m['max_model_len']}" if m.get("max_model_len") else ""
            lines.append(f"  {kind} {m['id']} ({m.get('root')}{limit})")

        unknown = (
            "not checked (agl doctor --upstream URL --generate)"
            if self.schema
            else "unknown (no /openapi.json)"
        )

        def mark(value: bool | None, yes: str, no: str) -> str:
            return unknown if value is None else (f"yes{yes}" if value else f"NO — {no}")

        lines += [
            "  token ids (exact prompt/response ids): "
            + mark(self.token_ids, "", "needs vLLM >= 0.10.2 (return_token_ids)"),
            "  runtime LoRA loading: " + mark(self.runtime_lora, "", _LORA_FLAGS),
            "  LoRA adapters enabled: " + mark(self.lora_enabled, "", "start vLLM with --enable-lora"),
            "  pause/resume around a push (mode=keep): "
            + mark(self.pause_keep, "", _DEV_FLAGS + " (pushes then load without pausing)"),
            "  token-in route /inference/v1/generate: " + mark(self.token_in, "", "not served"),
            "  sleep/wake_up (colocated trainer): " + mark(self.sleep, "", _DEV_FLAGS),
        ]
        missing = self.missing(lora=True)
        lines.append("  agl can train through it: " + ("yes" if not missing else "NO: " + "; ".join(missing)))
        return "\n".join(lines)


def probe(
    url: str, *, generate: bool = False, api_key: str | None = None, timeout_s: float = 30.0
) -> VLLMSupport:
    """Ask the vLLM server at ``url`` (its root or ``/v1`` URL) what it offers. ``generate``: also
    make one real one-token completion to see the token ids come back (the first request to a fresh
    server warms it up: slow), and load a missing adapter to tell whether ``--enable-lora`` is on."""
    import httpx

    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    root = base[: -len("/v1")]
    support = VLLMSupport(url=base)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(headers=headers, timeout=timeout_s) as client:
        try:
            data = client.get(base + "/models").json().get("data") or []
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            support.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return support
        support.reachable = True
        support.models = [
            {k: m.get(k) for k in ("id", "root", "parent", "max_model_len")}
            for m in data
            if isinstance(m, dict)
        ]
        support.version = _get_json(client, root + "/version").get("version")
        _read_schema(client, root, support)
        if generate and support.base_model() is not None:
            support.token_ids = _answers_with_ids(client, base, support.base_model()["id"], timeout_s)
        if generate and support.runtime_lora:
            support.lora_enabled = _lora_enabled(client, base)
    return support


def _get_json(client: Any, url: str) -> dict[str, Any]:
    try:
        data = client.get(url).json()
    except Exception:  # noqa: BLE001 - an older server without the route
        return {}
    return data if isinstance(data, dict) else {}


def _read_schema(client: Any, root: str, support: VLLMSupport) -> None:
    schema = _get_json(client, root + "/openapi.json")
    paths = schema.get("paths")
    if not isinstance(paths, dict):
        return
    support.schema = True
    support.routes = set(paths)
    pause = (paths.get("/pause") or {}).get("post") or {}
    names = {p.get("name") for p in pause.get("parameters") or () if isinstance(p, dict)}
    support.pause_keep = "mode" in names
    if support.token_ids is None:
        text = str(schema.get("components", {}).get("schemas", {}).get("CompletionRequest", ""))
        support.token_ids = "return_token_ids" in text if text else None


def _answers_with_ids(client: Any, base: str, model: str, timeout_s: float) -> bool:
    body = {"model": model, "prompt": [1, 2], "max_tokens": 1, "return_token_ids": True, "temperature": 0}
    resp = client.post(base + "/completions", json=body, timeout=max(timeout_s, 300.0))
    if resp.status_code >= 400:
        return False
    choice = (resp.json().get("choices") or [{}])[0]
    return isinstance(choice.get("token_ids"), list) and isinstance(choice.get("prompt_token_ids"), list)


def _lora_enabled(client: Any, base: str) -> bool | None:
    """Load an adapter from a folder that does not exist: a server with LoRA enabled says it cannot
    find it; one without ``--enable-lora`` refuses LoRA itself."""
    body = {"lora_name": "agl-probe-missing", "lora_path": "/nonexistent/agl-probe"}
    resp = client.post(base + "/load_lora_adapter", json=body)
    if resp.status_code < 400:  # it loaded something after all: take it away again
        client.post(base + "/unload_lora_adapter", json={"lora_name": body["lora_name"]})
        return True
    text = resp.text.lower()
    if "not enabled" in text or "enable_lora" in text or "enable-lora" in text:
        return False
    return True if "not found" in text or "no adapter" in text or "does not exist" in text else None
