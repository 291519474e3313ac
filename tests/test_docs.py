"""Every Python block a user would copy from README.md and docs/guide/*.md runs, so the docs cannot
drift from the code.

A block runs as written, in a fresh namespace and a temporary working directory. Where it needs a
model it gets agl's real gateway with the scripted backend: the gateway blocks are pointed at one
(its URL substituted), and the README's training block runs the real ``Trainer`` on a tiny model with
the scripted engine (``_TinyTrainer``: only the model, engine and budget differ). A block that
cannot run here says why in ``<!-- docs-test: skip (reason) -->`` on the line before it; a block
whose optional dependency is not installed (the core env has neither torch nor openai nor anthropic)
skips naming it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- docs-test: (?P<marker>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)
OPTIONAL = ("openai", "anthropic", "torch", "transformers", "trl", "peft")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    code: str
    marker: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            line = text[: m.start("code")].count("\n")
            found.append(Block(path, line, m.group("code"), (m.group("marker") or "").strip()))
    return found


ALL = blocks()


def test_the_docs_have_python_blocks_and_every_marker_is_known() -> None:
    assert {b.path.name for b in ALL} >= {"README.md", "tracing.md", "store-and-deployment.md", "gateway.md"}
    for b in ALL:
        assert b.marker == "" or b.marker.startswith(("skip (", "trainer (")), f"{b.name}: {b.marker!r}"
    assert sum(not b.marker.startswith("skip") for b in ALL) >= 4, "most copied blocks must run"


def _needs(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (not installed in this env)")


@pytest.fixture
def docs_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh working directory, and agl's instrumentation and tracing undone afterwards."""
    import agl
    from agl.tracing import provider as tracing

    monkeypatch.chdir(tmp_path)
    yield tmp_path
    agl.uninstrument()
    tracing.reset_tracing()


def _run(code: str, name: str = "__docs__") -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": name}
    exec(compile(code, "<docs>", "exec"), namespace)  # noqa: S102 - the block under test
    return namespace


@pytest.mark.parametrize("block", [b for b in ALL if not b.marker], ids=lambda b: b.name)
def test_block_runs(block: Block, docs_env: Path) -> None:
    needed = [m for m in OPTIONAL if re.search(rf"^\s*(from|import) {m}\b", block.code, re.M)]
    _needs(*needed)
    if "127.0.0.1:8765" in block.code:  # the gateway guide's client: a real gateway, scripted replies
        _run_against_a_gateway(block.code)
        return
    ns = _run(block.code)
    if "store" in ns and hasattr(ns["store"], "query_rollouts"):
        assert ns["store"].query_rollouts(), f"{block.name} stored nothing"


def _run_against_a_gateway(code: str) -> None:
    import agl.store
    from agl.gateway.testing import ScriptedBackend, reply, serve_gateway

    store = agl.store.open("memory://")
    backend = ScriptedBackend([reply("Hello!")], models=["SmolLM2-135M-Instruct"])
    with serve_gateway(backend, store) as url:
        _run(code.replace("http://127.0.0.1:8765", url.root))
        assert url.gateway.stats["calls"] == 1 and backend.calls == 1


@pytest.mark.parametrize("block", [b for b in ALL if b.marker.startswith("skip")], ids=lambda b: b.name)
def test_block_marked_skip(block: Block) -> None:
    pytest.skip(f"{block.name}: {block.marker}")


@pytest.mark.parametrize("block", [b for b in ALL if b.marker.startswith("trainer")], ids=lambda b: b.name)
def test_trainer_block_trains(block: Block, docs_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's "make your agent trainable" block, end to end as `python my_agent.py` runs it: the
    real Trainer, gateway, runners and update, on a tiny model with the scripted engine that answers
    in the strict format for even sums only (so each group has reward variance), and one step of one
    task. The run's store holds the agent and tool spans the block's agl.agent / agl.tool made.
    (How the block learns with the embedded model on a CPU: bench/readme_agent.py.)"""
    _needs("openai", "torch", "transformers", "trl", "peft")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import agl
    import agl.store
    from agl.trainer.trainer import Trainer

    def script(request: Any) -> Any:  # the strict format for even sums (reward variance per group)
        a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)", request.messages[-1]["content"])[0])
        return f"Answer: {a + b}" if (a + b) % 2 == 0 else "I do not know"

    class _TinyTrainer(Trainer):
        def __init__(self, algorithm: Any = None, **kw: Any) -> None:
            torch.manual_seed(0)
            config = LlamaConfig(
                vocab_size=49152,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=1024,
                tie_word_embeddings=True,
            )
            serving = kw.pop("serving", None) or agl.Serving()
            loop = kw.pop("loop", None) or agl.LoopConfig()
            super().__init__(
                algorithm,
                model=LlamaForCausalLM(config),
                serving=dataclasses.replace(
                    serving, backend="scripted", script=script, runners=4, progress=False
                ),
                loop=dataclasses.replace(loop, tasks_per_step=1, steps=1, val_every=0),
                **kw,
            )

    monkeypatch.setattr(agl, "Trainer", _TinyTrainer)
    ns = _run(block.code, name="__main__")  # run as `python my_agent.py`
    summary, val = ns["summary"], ns["val"]
    expected = sum((t["a"] + t["b"]) % 2 == 0 for t in val) / len(val)
    assert summary["val_reward_before"] == pytest.approx(expected)
    assert summary["steps"] == 1 and (docs_env / "runs" / "my-agent" / "metrics.jsonl").exists()
    store = agl.store.open(f"sqlite:///{docs_env / 'runs' / 'my-agent' / 'store.db'}")
    try:
        spans = store.query_spans()
    finally:
        store.close()
    agents = {s.attributes.get("gen_ai.agent.name") for s in spans if s.name == "invoke_agent"}
    tools = [s for s in spans if s.name == "execute_tool"]
    assert agents == {"adder"} and tools, "the block's agl.agent / agl.tool made no spans"
    assert all(s.attributes.get("gen_ai.tool.call.result") for s in tools)


# ------------------------------------------------------------------ the dotted names the docs mention

#: ``agl.x.y`` as the docs write a module path or a name in one (not inside a longer word or path)
DOTTED = re.compile(r"(?<![\w./-])agl(?:\.[A-Za-z_]\w*)+")
NAMED = [ROOT / "docs" / "architecture.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]


def _packages() -> set[str]:
    """The top-level modules and packages of ``agl``: a dotted name whose second part is one of them is
    a Python path; any other (``agl.rollout.id``, ``agl.llm.adapter``) is a span attribute or baggage key."""
    core = ROOT / "core"
    found = {p.stem for p in core.glob("*.py") if p.stem != "__init__"}
    return found | {p.name for p in core.iterdir() if (p / "__init__.py").is_file()} | {"integrations"}


def documented_names() -> dict[str, str]:
    """Every Python path ``agl.…`` the architecture and the guide pages name -> where it first appears:
    ``agl.<module>...`` and ``agl.<public name>``."""
    import agl

    packages = _packages()
    out: dict[str, str] = {}
    for path in NAMED:
        text = path.read_text(encoding="utf-8")
        for m in DOTTED.finditer(text):
            parts = m.group(0).split(".")
            if parts[1] in packages or (len(parts) == 2 and parts[1] in agl.__all__):
                out.setdefault(m.group(0), f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}")
    return out


def _resolve(name: str) -> Any:
    """The object ``name`` names: the longest prefix that imports as a module, then attributes."""
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.split(".")[0] != "agl":
                raise  # an optional dependency the env lacks: the caller skips
            if exc.name != ".".join(parts[:i]):
                raise  # an agl module that imports a missing agl module: a real break
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"{name}: not even `agl` imports")


def test_every_agl_name_the_docs_mention_imports() -> None:
    """A path in docs/architecture.md or a guide page is one a reader will type: each imports, as a
    module or as a name in one. (A name whose module needs an optional dependency this env lacks is
    not checked here; the env that has it checks it.)"""
    names = documented_names()
    assert len(names) > 100 and "agl.chat.tokenizer.load_tokenizer" in names
    broken, unchecked = [], []
    for name, where in sorted(names.items()):
        try:
            _resolve(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] == "agl":
                broken.append(f"{where}: {name} ({exc})")
            else:
                unchecked.append(name)
        except (AttributeError, ImportError) as exc:
            broken.append(f"{where}: {name} ({type(exc).__name__}: {exc})")
    assert not broken, "documented names that do not import:\n" + "\n".join(broken)
    assert len(unchecked) < len(names) / 2, unchecked
