"""``agl export model``: a run's trained policy as a folder users load directly, with a true card.

A run leaves ``run_dir/checkpoints/checkpoint-N/``: the policy's weights mixed with what resuming
needs (optimizer, scheduler, RNG, TRL's trainer state). :func:`export_model` picks one checkpoint
(:func:`find_checkpoint`: the last, ``step=N`` for ``checkpoint-N``, or ``best=True`` for the best
held-out reward in ``metrics.jsonl``) and writes only what serving needs:

- a LoRA run: a peft adapter folder (``adapter_model.safetensors``, ``adapter_config.json`` naming the
  base model's real path, the tokenizer and chat template); ``merge=True``: the base model with the
  adapter merged (safetensors in ``dtype``, config, tokenizer, generation config), which
  ``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM load as any model;
- an adapter per agent: one adapter folder per agent's LoRA under ``out/<adapter>/``; merging is
  refused (the agents share one base model, and each needs its own weights on it);
- a full-parameter run: the model folder (weights re-saved in ``dtype`` when one is given).

Every export holds :data:`MANIFEST` (what it is, from which checkpoint, on which base, and for an
adapter per agent ``{agent: folder}``: what ``agl gateway serve --model DIR`` reads) and a model card,
``README.md`` (:mod:`agl.reports.model_card`). Bad input — no checkpoint, a step that does not exist,
a non-empty ``out`` — is refused before anything is written; the folder is written beside ``out``
under a temporary name and renamed into place, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl.errors import UsageError
from agl.reports.model_card import held_out_at, model_card
from agl.run.record import CHECKPOINT_FILE, read_run_record

__all__ = [
    "MANIFEST",
    "Checkpoint",
    "ExportResult",
    "export_model",
    "ServingPlan",
    "find_checkpoint",
    "load_merged",
    "read_manifest",
    "serving_plan",
]

#: the export's own record: kind, source checkpoint, base model, adapters
MANIFEST = "agl_export.json"
#: what a tokenizer folder may hold (copied when present)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Checkpoint:
    """One saved policy: its folder, the run it belongs to (None for a folder given alone), the policy
    updates it holds (the folder's number), the loop step it was saved after (None where unknown), its
    kind (``adapter``, ``adapters`` or ``full``) and, for ``adapters``, ``{adapter name: folder}``."""

    path: Path
    run_dir: Path | None
    update_step: int
    step: int | None
    kind: str
    adapters: dict[str, Path] = field(default_factory=dict)


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_model` wrote: the folder, its kind, the checkpoint and the manifest."""

    out: Path
    kind: str
    checkpoint: Checkpoint
    manifest: dict[str, Any]


# ------------------------------------------------------------------------------- the checkpoint


def _numbered(folder: Path) -> list[tuple[int, Path]]:
    found = []
    for p in folder.iterdir() if folder.is_dir() else ():
        m = _CHECKPOINT.fullmatch(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _kind(path: Path) -> tuple[str, dict[str, Path]]:
    """What a checkpoint folder holds (module docstring); a folder with no weights is refused."""
    if (path / "adapter_model.safetensors").is_file() and (path / "adapter_config.json").is_file():
        return "adapter", {}
    subs = {
        d.name: d
        for d in sorted(path.iterdir())
        if d.is_dir()
        and (d / "adapter_config.json").is_file()
        and (d / "adapter_model.safetensors").is_file()
    }
    if subs:
        return "adapters", subs
    if (path / "config.json").is_file() and any(path.glob("model*.safetensors")):
        return "full", {}
    raise UsageError(
        f"{path} holds no weights to export (no adapter_model.safetensors, no per-agent adapter folders, "
        "no model*.safetensors with config.json)"
    )


def _metrics(run_dir: Path | None) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl" if run_dir is not None else None
    if path is None or not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                raise UsageError(f"{path}:{n} is not JSON") from None
    return out


def _loop_step(
    path: Path, update_step: int, run_dir: Path | None, history: list[dict[str, Any]]
) -> int | None:
    """The loop step a checkpoint was saved after: its marker (``Steps.checkpoint``), else the run's
    ``trainer_state.json`` when it names this folder, else its update count when no step of the run
    went without an update (then the two agree); None when none of these tells."""
    marker = path / CHECKPOINT_FILE
    if marker.is_file():
        step = json.loads(marker.read_text()).get("step")
        if isinstance(step, int):
            return step
    state_file = run_dir / "trainer_state.json" if run_dir is not None else None
    if state_file is not None and state_file.is_file():
        state = json.loads(state_file.read_text())
        named = state.get("checkpoint")
        if named and Path(named).resolve() == path.resolve() and isinstance(state.get("next_step"), int):
            return int(state["next_step"])
    if not any(h.get("no_update") for h in history):
        return update_step
    return None


def _run_and_candidates(source: Path, step: int | None) -> tuple[Path | None, list[tuple[int, Path]]]:
    """The run directory and its checkpoints (for a checkpoint folder given alone: that one)."""
    m = _CHECKPOINT.fullmatch(source.name)
    if m and not (source / "checkpoints").is_dir():
        if step is not None:
            raise UsageError(
                f"--step picks a checkpoint of a run directory; {source} is one checkpoint already"
            )
        parent = source.parent
        run_dir = parent.parent if parent.name == "checkpoints" else None
        return run_dir, [(int(m.group(1)), source)]
    found = _numbered(source / "checkpoints")
    if not found:
        raise UsageError(
            f"{source} holds no checkpoint (no checkpoints/checkpoint-N folder): give a run directory of "
            "`agl train` / Trainer.fit after at least one step, or a checkpoint folder"
        )
    return source, found


def find_checkpoint(
    source: str | os.PathLike[str], *, step: int | None = None, best: bool = False
) -> Checkpoint:
    """The checkpoint to export from ``source`` (a run directory or a checkpoint folder): the last one,
    ``checkpoint-<step>``, or with ``best`` the one whose loop step has the highest held-out reward."""
    src = Path(source)
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such run directory or checkpoint folder")
    if step is not None and best:
        raise UsageError("--step and --best each pick a checkpoint: give one of them")
    run_dir, found = _run_and_candidates(src, step)
    history = _metrics(run_dir)
    if step is not None:
        chosen = [(n, p) for n, p in found if n == step]
        if not chosen:
            have = ", ".join(str(n) for n, _ in found)
            raise UsageError(f"{src} has no checkpoint-{step}; its checkpoints: {have}")
        found = chosen
    steps = [(n, p, _loop_step(p, n, run_dir, history)) for n, p in found]
    if best:
        scored = [
            (h["val_reward"], n, p, s) for n, p, s in steps if (h := held_out_at(history, s)) is not None
        ]
        if not scored:
            checks = sorted({h["step"] for h in history if h.get("val_reward") is not None})
            raise UsageError(
                f"--best needs a held-out check at a checkpoint's step: {src} has checks at steps "
                f"{checks or 'none'} and checkpoints after steps {[s for _, _, s in steps]}"
            )
        _, n, p, s = max(scored, key=lambda x: (x[0], x[1]))  # ties: the later checkpoint
    else:
        n, p, s = steps[-1]
    _check_on_service(p)
    kind, adapters = _kind(p)
    return Checkpoint(
        path=p.resolve(),
        run_dir=run_dir.resolve() if run_dir else None,
        update_step=n,
        step=s,
        kind=kind,
        adapters=adapters,
    )


# ----------------------------------------------------------------------------------- writing


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} is not empty: give a new folder (nothing is overwritten)")


def _check_options(ckpt: Checkpoint, merge: bool, dtype: str | None) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if merge and ckpt.kind == "adapters":
        raise UsageError(
            f"--merge is refused for an adapter per agent: {ckpt.path} holds {len(ckpt.adapters)} adapters "
            f"({', '.join(ckpt.adapters)}) on one base model, and one merged model can hold only one; export "
            "the adapters and serve them on the base (agl gateway serve --model DIR, vLLM --lora-modules)"
        )
    if merge and ckpt.kind == "full":
        raise UsageError(f"--merge is for LoRA runs: {ckpt.path} holds full weights already (drop --merge)")
    if dtype is not None and ckpt.kind != "full" and not merge:
        raise UsageError("--dtype sets the merged weights' dtype: add --merge (an adapter keeps its own)")


def _base_path(ckpt: Checkpoint, record: dict[str, Any] | None, base: str | None) -> str | None:
    """The base model's local folder: ``base`` when given, else the run's record, else the adapter's
    ``base_model_name_or_path``."""
    if base is not None:
        if not Path(base).is_dir():
            raise FileNotFoundError(f"--base {base}: no such model folder")
        return str(Path(base).resolve())
    recorded = ((record or {}).get("base_model") or {}).get("path")
    if recorded:
        return str(recorded)
    folder = ckpt.path if ckpt.kind == "adapter" else next(iter(ckpt.adapters.values()), None)
    if folder is not None:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        return cfg.get("base_model_name_or_path") or None
    return None


def _copy_tokenizer(src: Path, dst: Path, fallback: str | None) -> None:
    """The tokenizer and chat template from ``src`` (else the base model's folder ``fallback``)."""
    for folder in (src, Path(fallback) if fallback else None):
        if folder is not None and (folder / "tokenizer.json").is_file():
            for name in TOKENIZER_FILES:
                if (folder / name).is_file():
                    shutil.copy2(folder / name, dst / name)
            return
    raise UsageError(
        f"{src} holds no tokenizer (tokenizer.json), nor does the base model's folder {fallback}"
    )


def _copy_adapter(src: Path, dst: Path, base: str | None, tokenizer_from: Path) -> None:
    """A clean peft adapter folder: weights, config naming the base, tokenizer (no optimizer state)."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "adapter_model.safetensors", dst / "adapter_model.safetensors")
    cfg = json.loads((src / "adapter_config.json").read_text())
    if base:
        cfg["base_model_name_or_path"] = base
    cfg["inference_mode"] = True
    (dst / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    _copy_tokenizer(src if (src / "tokenizer.json").is_file() else tokenizer_from, dst, base)


def _torch_dtype(name: str | None, default: Any) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        name or "", default
    )


def _save_model(model: Any, dst: Path, dtype: str | None) -> None:
    """``model`` as safetensors in ``dtype`` with its config and a generation config."""
    from transformers import GenerationConfig

    model = model.to(_torch_dtype(dtype, next(model.parameters()).dtype))
    model.save_pretrained(str(dst), safe_serialization=True)
    if not (dst / "generation_config.json").is_file():
        GenerationConfig.from_model_config(model.config).save_pretrained(str(dst))


def _merge(ckpt: Checkpoint, dst: Path, base: str | None, dtype: str | None) -> None:
    """The base model with the checkpoint's adapter merged into its weights (merged in float32)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not base or not (Path(base) / "config.json").is_file():
        raise UsageError(
            f"--merge needs the base model's folder: {base or 'the run names none'} is not one (no config.json); "
            "give --base DIR"
        )
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(ckpt.path)).merge_and_unload()
    merged.config.dtype = None  # the saved dtype is what the weights are
    _save_model(merged, dst, dtype)
    _copy_tokenizer(ckpt.path, dst, base)


def _full(ckpt: Checkpoint, dst: Path, dtype: str | None) -> None:
    """A full-parameter checkpoint's model folder (re-saved in ``dtype`` when one is given)."""
    if dtype is None:
        for p in ckpt.path.iterdir():
            if (
                p.name.startswith("model")
                and p.suffix in (".safetensors", ".json")
                or p.name
                in (
                    "config.json",
                    "generation_config.json",
                )
            ):
                shutil.copy2(p, dst / p.name)
        if not (dst / "generation_config.json").is_file():
            from transformers import AutoConfig, GenerationConfig

            GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(ckpt.path))).save_pretrained(
                str(dst)
            )
    else:
        from transformers import AutoModelForCausalLM

        _save_model(AutoModelForCausalLM.from_pretrained(str(ckpt.path)), dst, dtype)
    _copy_tokenizer(ckpt.path, dst, None)


def _agents_of(record: dict[str, Any] | None, adapters: dict[str, Path]) -> dict[str, str]:
    """``{agent: adapter folder}``: the run's own mapping where it recorded one, else each adapter's name."""
    recorded = (record or {}).get("adapters") or {}
    mapping = {agent: name for agent, name in recorded.items() if name in adapters}
    for name in adapters:
        if name not in mapping.values():
            mapping[name] = name
    return mapping


def _write(
    ckpt: Checkpoint, dst: Path, merge: bool, dtype: str | None, base: str | None, record: Any
) -> dict[str, Any]:
    """Write the export's weights into ``dst``; returns the manifest's own part."""
    if ckpt.kind == "adapters":
        agents = _agents_of(record, ckpt.adapters)
        for name, folder in ckpt.adapters.items():
            _copy_adapter(folder, dst / name, base, ckpt.path)
        return {"kind": "adapters", "agents": agents}
    if ckpt.kind == "full":
        _full(ckpt, dst, dtype)
        return {"kind": "full", "dtype": dtype}
    if merge:
        _merge(ckpt, dst, base, dtype)
        return {"kind": "merged", "dtype": dtype or "float32"}
    _copy_adapter(ckpt.path, dst, base, ckpt.path)
    return {"kind": "adapter"}


def _rank(ckpt: Checkpoint) -> int | None:
    """The trained LoRA's rank (None for full weights)."""
    folder = ckpt.path if ckpt.kind == "adapter" else next(iter(ckpt.adapters.values()), None)
    if folder is None:
        return None
    r = json.loads((folder / "adapter_config.json").read_text()).get("r")
    return int(r) if isinstance(r, int) else None


def export_model(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    best: bool = False,
    merge: bool = False,
    dtype: str | None = None,
    base: str | None = None,
) -> ExportResult:
    """Export one checkpoint of ``source`` into the new folder ``out`` (module docstring); ``base``: the
    base model's folder when the run's is not at its recorded path."""
    out_path = Path(out).expanduser().resolve()
    _check_out(out_path)
    ckpt = find_checkpoint(source, step=step, best=best)
    _check_options(ckpt, merge, dtype)
    record = read_run_record(ckpt.run_dir) if ckpt.run_dir is not None else None
    base_path = _base_path(ckpt, record, base)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", suffix=".partial", dir=out_path.parent))
    try:
        import agl

        manifest = {
            **_write(ckpt, tmp, merge, dtype, base_path, record),
            "checkpoint": str(ckpt.path),
            "update_step": ckpt.update_step,
            "step": ckpt.step,
            "base_model": base_path,
            "lora_rank": _rank(ckpt),
            "agl_version": agl.__version__,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        (tmp / "README.md").write_text(model_card(ckpt, manifest, record, _metrics(ckpt.run_dir), out_path))
        if out_path.exists():
            out_path.rmdir()  # empty (checked above)
        os.replace(tmp, out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out=out_path, kind=manifest["kind"], checkpoint=ckpt, manifest=manifest)


def _check_on_service(path: Path) -> None:
    """A checkpoint of a ``tinker`` run holds no weights, only the service's paths of its saved state:
    refused, naming them (skyrl-tx 0.3.0 serves no adapter download; Tinker's is the SDK's
    ``RestClient.get_checkpoint_archive_url``)."""
    from agl.algorithms.tinker_update import STATE_FILE

    state = Path(path) / STATE_FILE
    if state.is_file():
        paths = json.loads(state.read_text()).get("adapters", {})
        raise UsageError(
            f"{path} is a checkpoint of a run trained on a Tinker service: its adapter lives there "
            f"({', '.join(f'{k}: {v}' for k, v in paths.items())}); agl cannot fetch it from skyrl-tx "
            "0.3.0, and on Tinker the SDK's RestClient.get_checkpoint_archive_url names its archive"
        )


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """An export's manifest (:data:`MANIFEST`), or None when ``folder`` is not an ``agl export model`` output."""
    path = Path(folder) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


# ----------------------------------------------------------------------------------- serving


@dataclass(frozen=True)
class ServingPlan:
    """How agl's transformers backend serves a folder given as ``--model``: ``model`` (a model folder),
    ``adapters`` (``{adapter: folder}`` served beside it), ``serve`` (``{model name: adapter}``: each
    agent's adapter under its agent's name) and ``merge`` (an adapter folder to merge into ``model``
    before serving: a shared LoRA export is then the policy under every model name)."""

    model: str
    adapters: dict[str, str] = field(default_factory=dict)
    serve: dict[str, str] = field(default_factory=dict)
    merge: str | None = None


def serving_plan(folder: str | os.PathLike[str], base: str | None = None) -> ServingPlan | None:
    """The :class:`ServingPlan` of an export (or of a bare peft adapter folder); None for a folder that
    is a model already (a merged or full export, any Hugging Face model folder)."""
    path = Path(folder)
    manifest = read_manifest(path) or {}
    if manifest.get("kind") == "adapters":
        model = base or manifest.get("base_model")
        agents: dict[str, str] = manifest.get("agents") or {}
        adapters = {name: str(path / name) for name in agents.values()}
        serve = {agent: name for agent, name in agents.items()}
        return ServingPlan(model=_served_base(model, path), adapters=adapters, serve=serve)
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        cfg = json.loads((path / "adapter_config.json").read_text())
        model = base or manifest.get("base_model") or cfg.get("base_model_name_or_path")
        return ServingPlan(model=_served_base(model, path), merge=str(path))
    return None


def _served_base(model: str | None, export: Path) -> str:
    if not model or not Path(model).is_dir():
        raise UsageError(
            f"{export} is an adapter export on the base model {model or '(none named)'}, which is not a "
            "folder here: copy it there, or re-export with --base DIR"
        )
    return str(model)


def load_merged(plan: ServingPlan) -> tuple[Any, Any]:
    """``(model, tokenizer)``: the plan's base with its ``merge`` adapter merged (in float32; the engine
    casts it to its ``dtype``), and the adapter folder's tokenizer."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert plan.merge is not None
    model = AutoModelForCausalLM.from_pretrained(plan.model, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, plan.merge).merge_and_unload().eval()
    return model, AutoTokenizer.from_pretrained(plan.merge)
