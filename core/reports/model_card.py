"""The model card of an ``agl export model`` folder: ``README.md`` with Hugging Face's metadata header.

Every statement comes from the run's own files, and what they do not record is said to be unrecorded
(never "None", never a template's placeholder):

- the base model (its Hub name where known, else its path) and agl's version: ``run.json``
  (:mod:`agl.run.record`), else the adapter's ``base_model_name_or_path``;
- the agents and calls trained (``trained_transitions`` summed over ``metrics.jsonl``, per adapter
  with an adapter per agent), the algorithm and its settings, the seed: ``run.json``;
- the steps: the checkpoint's loop step and update count, and the run's length;
- the held-out reward before training, at this checkpoint and at the run's end, with the number of
  held-out tasks: ``metrics.jsonl``; the run's ``summary.json`` where one was written (the examples
  write it: its before/after, seed and decoding take precedence for the run's figures);
- the reward's definition where the rollout's docstring states one;
- the commands that serve the folder: ``agl gateway serve``, vLLM (``--lora-modules`` or the merged
  folder as the model) and transformers.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

__all__ = ["held_out_at", "model_card", "serve_commands", "vllm_rank"]

UNRECORDED = "not recorded by this run"
#: the algorithm settings the card lists (where the run recorded them)
_SETTINGS = (
    "group_size",
    "credit",
    "advantage_level",
    "learning_rate",
    "lora",
    "lora_r",
    "lora_alpha",
    "clip_eps",
    "kl_coef",
    "epochs",
    "temperature",
    "max_tokens",
)


def _fmt(value: Any) -> str:
    if value is None:
        return UNRECORDED
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


def _summary(run_dir: Path | None) -> dict[str, Any]:
    path = run_dir / "summary.json" if run_dir is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def held_out_at(history: list[dict[str, Any]], step: int | None) -> dict[str, Any] | None:
    """The held-out check measured at loop step ``step`` (its record), or None."""
    if step is None:
        return None
    return next((h for h in history if h.get("step") == step and h.get("val_reward") is not None), None)


def _header(manifest: dict[str, Any], record: dict[str, Any] | None, base: dict[str, Any]) -> str:
    kind = manifest["kind"]
    peft = kind in ("adapter", "adapters")
    tags = ["agl", "reinforcement-learning", "lightning-rl", "text-generation"]
    tags += ["lora", "peft"] if peft else []
    lines = ["---"]
    base_model = base.get("name") or base.get("path") or manifest.get("base_model")
    if base_model:
        lines.append(f"base_model: {json.dumps(str(base_model))}")
    lines.append(f"library_name: {'peft' if peft else 'transformers'}")
    lines.append("pipeline_tag: text-generation")
    lines.append("tags:")
    lines += [f"- {t}" for t in tags]
    lines.append("---")
    return "\n".join(lines)


def _what(manifest: dict[str, Any]) -> str:
    kind = manifest["kind"]
    if kind == "adapter":
        return "a LoRA adapter (peft) for the base model below"
    if kind == "adapters":
        return f"one LoRA adapter (peft) per agent ({', '.join(manifest['agents'])}) on one base model"
    if kind == "merged":
        return f"the base model below with its trained LoRA adapter merged into the weights ({manifest['dtype']})"
    return "a full-parameter fine-tune of the base model below"


def _base_lines(base: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    name, path, note = base.get("name"), base.get("path") or manifest.get("base_model"), base.get("note")
    lines = [f"- name: {name}" if name else "- name: none known (a local folder)"]
    lines.append(f"- local path at training time: `{path}`" if path else f"- local path: {UNRECORDED}")
    if note:
        lines.append(f"- {note}")
    return lines


def _training_lines(
    ckpt: Any, record: dict[str, Any] | None, history: list[dict[str, Any]], summary: dict[str, Any]
) -> list[str]:
    config = (record or {}).get("config") or {}
    algo = config.get("algorithm") or {}
    loop = config.get("loop") or {}
    agents = (record or {}).get("agents", "__unrecorded__")
    if agents == "__unrecorded__":
        agents_text = UNRECORDED
    elif agents is None:
        agents_text = "every agent of the program (no selection)"
    else:
        agents_text = ", ".join(agents) if isinstance(agents, list) else f"agents matching `{agents}`"
    trained = [h for h in history if "rollouts" in h and (h.get("step") or 0) < (ckpt.step or 10**9)]
    calls = sum(int(h.get("trained_transitions") or 0) for h in trained)
    lines = [f"- agents trained: {agents_text}"]
    lines.append(
        f"- LLM calls trained on up to this checkpoint: {calls}" if history else f"- calls: {UNRECORDED}"
    )
    per = _per_adapter_calls(trained)
    if per:
        lines.append("  - per adapter: " + ", ".join(f"{k} {v}" for k, v in per.items()))
    agent = (record or {}).get("agent") or {}
    if agent.get("name"):
        lines.append(f"- rollout function: `{agent['name']}`")
    settings = {k: algo[k] for k in _SETTINGS if k in algo}
    name = algo.get("name")
    lines.append(
        f"- algorithm: {name or UNRECORDED}"
        + (" (" + ", ".join(f"{k}={v}" for k, v in settings.items()) + ")" if settings else "")
    )
    seed = summary.get("seed", loop.get("seed"))
    lines.append(f"- seed: {_fmt(seed)}")
    total = loop.get("steps") or summary.get("steps")
    step = "unknown" if ckpt.step is None else str(ckpt.step)
    lines.append(
        f"- steps: this checkpoint was saved after loop step {step} of {_fmt(total)} "
        f"({ckpt.update_step} policy update(s)); `{ckpt.path.name}` of `{ckpt.path.parent.parent}`"
    )
    if record and record.get("agl_version"):
        lines.append(f"- trained with agl {record['agl_version']}")
    return lines


def _per_adapter_calls(records: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for h in records:
        for key, value in h.items():
            if key.startswith("trained_transitions/") and value:
                name = key.split("/", 1)[1]
                out[name] = out.get(name, 0) + int(value)
    return out


def _held_out_lines(
    ckpt: Any, history: list[dict[str, Any]], summary: dict[str, Any], loop: dict[str, Any]
) -> list[str]:
    checks = [h for h in history if h.get("val_reward") is not None]
    if not checks and "val_reward_before" not in summary:
        return ["No held-out reward was measured in this run (it had no held-out tasks)."]
    rows = []
    first = checks[0] if checks and checks[0].get("step") == 0 else None
    here = held_out_at(history, ckpt.step)
    last = checks[-1] if checks else None

    def row(label: str, h: dict[str, Any] | None, value: Any = None) -> None:
        reward = value if value is not None else (h or {}).get("val_reward")
        tasks = (h or {}).get("val_tasks", (h or {}).get("val_rollouts"))
        rows.append(f"| {label} | {_fmt(reward)} | {_fmt(tasks)} |")

    row("before training (step 0)", first, summary.get("val_reward_before"))
    row(f"this checkpoint (step {ckpt.step})" if here else "this checkpoint (no check at its step)", here)
    if last is not None:
        row(f"end of the run (step {last['step']})", last, summary.get("val_reward_after"))
    seed = summary.get("seed", loop.get("seed"))
    lines = ["| held-out check | mean reward | held-out tasks |", "|---|---:|---:|", *rows, ""]
    source = "`summary.json` and `metrics.jsonl`" if summary else "`metrics.jsonl`"
    lines.append(f"Seed {_fmt(seed)}; from the run's {source}.")
    decoding = summary.get("held_out_decoding") or summary.get("decoding")
    if decoding:
        lines.append(
            f"Held-out decoding: {json.dumps(decoding) if not isinstance(decoding, str) else decoding}."
        )
    return lines


#: the LoRA ranks vLLM's --max-lora-rank accepts
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_rank(rank: int | None) -> int | None:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds a LoRA of ``rank``."""
    if rank is None:
        return None
    return next((r for r in VLLM_RANKS if r >= rank), rank)


def serve_commands(out: Path, manifest: dict[str, Any]) -> list[str]:
    """The shell commands that serve the export (agl's gateway, vLLM, agl vllm serve)."""
    q = shlex.quote
    rank = vllm_rank(manifest.get("lora_rank"))
    base = manifest.get("base_model") or "BASE_MODEL_DIR"
    name = out.name
    kind = manifest["kind"]
    gateway = f"agl gateway serve --model {q(str(out))}"
    if kind in ("merged", "full"):
        return [
            gateway,
            f"vllm serve {q(str(out))} --served-model-name {q(name)}",
            f"agl vllm serve --model {q(str(out))} --served-model-name {q(name)}",
        ]
    if kind == "adapter":
        modules = [f"{name}={out}"]
    else:
        modules = [f"{agent}={out / folder}" for agent, folder in manifest["agents"].items()]
    lora = f" --max-lora-rank {rank}" if rank else ""
    lora_modules = " ".join(q(m) for m in modules)
    return [
        gateway,
        f"vllm serve {q(str(base))} --enable-lora{lora} --max-loras {len(modules)} --lora-modules {lora_modules}",
        f"agl vllm serve --model {q(str(base))}"
        + (f" --lora-rank {rank}" if rank else "")
        + f" --adapters {len(modules)} -- --lora-modules {lora_modules}",
    ]


def _serve_section(out: Path, manifest: dict[str, Any]) -> list[str]:
    gateway, vllm, agl_vllm = serve_commands(out, manifest)
    kind = manifest["kind"]
    if kind == "adapters":
        names = ", ".join(f"`{a}`" for a in manifest["agents"])
        who = (
            f"each agent's adapter under its agent's name as the model name ({names}); through agl's gateway "
            "an instrumented program's calls also reach their agent's adapter by its agl.agent baggage, "
            "whatever model name they ask for"
        )
    elif kind == "adapter":
        who = f"the adapter as model `{out.name}` on vLLM; agl's gateway serves it under any model name"
    else:
        who = f"the model as `{out.name}` on vLLM; agl's gateway serves it under any model name"
    lines = [
        f"Point the agent's `OPENAI_BASE_URL` at the server; it serves {who}.",
        "",
        "agl's gateway (http://127.0.0.1:8765/v1; spans are recorded only with `--store URL`):",
        "",
        "```bash",
        gateway,
        "```",
        "",
        "vLLM (http://127.0.0.1:8000/v1), or the same through agl:",
        "",
        "```bash",
        vllm,
        agl_vllm,
        "```",
    ]
    return lines + ["", *_transformers_lines(out, manifest)]


def _transformers_lines(out: Path, manifest: dict[str, Any]) -> list[str]:
    kind = manifest["kind"]
    folder = out / next(iter(manifest["agents"].values())) if kind == "adapters" else out
    load = (
        f"model = AutoPeftModelForCausalLM.from_pretrained({str(folder)!r})"
        if kind in ("adapter", "adapters")
        else f"model = AutoModelForCausalLM.from_pretrained({str(out)!r})"
    )
    imports = (
        "from peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer"
        if kind in ("adapter", "adapters")
        else "from transformers import AutoModelForCausalLM, AutoTokenizer"
    )
    return [
        "transformers:",
        "",
        "```python",
        imports,
        "",
        load,
        f"tokenizer = AutoTokenizer.from_pretrained({str(folder)!r})",
        'ids = tokenizer.apply_chat_template([{"role": "user", "content": "..."}], add_generation_prompt=True,',
        '                                    return_tensors="pt", return_dict=True)',
        "print(tokenizer.decode(model.generate(**ids, max_new_tokens=64)[0]))",
        "```",
    ]


def model_card(
    ckpt: Any,
    manifest: dict[str, Any],
    record: dict[str, Any] | None,
    history: list[dict[str, Any]],
    out: Path,
) -> str:
    """The card's text (module docstring) for the export of ``ckpt`` written to ``out``."""
    summary = _summary(ckpt.run_dir)
    base = dict((record or {}).get("base_model") or {})
    loop = ((record or {}).get("config") or {}).get("loop") or {}
    reward = ((record or {}).get("agent") or {}).get("reward")
    parts = [
        _header(manifest, record, base),
        "",
        f"# {out.name}",
        "",
        f"This folder is {_what(manifest)}, trained with reinforcement learning by agl and exported by "
        "`agl export model`.",
        "",
        "## Base model",
        "",
        *_base_lines(base, manifest),
        "",
        "## Training",
        "",
        *_training_lines(ckpt, record, history, summary),
        "",
        "## Held-out reward",
        "",
        *_held_out_lines(ckpt, history, summary, loop),
        "",
        "## Reward",
        "",
        reward
        if reward
        else "The rollout function states no definition of its reward: it is what the rollout returned "
        "or emitted (`agl.emit_reward`).",
        "",
        "## Serve it",
        "",
        *_serve_section(out, manifest),
        "",
    ]
    return "\n".join(parts)
