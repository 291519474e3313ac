"""The layout's promises (issue 49): old module paths still import, the import graph of ``agl`` has no
circle at run time and nothing imports up across packages, the Trainer's private names are its own and
the schedules read it only through ``Steps``, rollout cancels skip the store's conflict/not-found and say
anything else, one store flag."""

from __future__ import annotations

import argparse
import ast
import collections
import importlib
import logging
import warnings
from pathlib import Path

import pytest

import agl
from agl.cli._util import add_store_args, open_store_from_args, store_token, store_url
from agl.errors import UsageError
from agl.store.base import DEFAULT_STORE, STORE_ENV, STORE_TOKEN_ENV
from agl.store.memory import MemoryStore
from agl.trainer.loop import held_out_due
from agl.trainer.pipeline import cancel_rollouts
from agl.trainer.state import STATE_FILE, read_state, write_state
from agl.types import NewRollout

CORE = Path(agl.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in CORE.rglob("*.py"):
        rel = path.relative_to(CORE).with_suffix("")
        name = ".".join(("agl", *rel.parts)).removesuffix(".__init__")
        out[name] = path
    return out


def _imports(tree: ast.AST, *, type_only: bool) -> list[tuple[str, int]]:
    """(module imported, line) of every ``agl`` import: run-time ones, or with ``type_only`` also those
    under ``if TYPE_CHECKING:``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                for s in child.body:
                    visit(ast.Module([s], []), True)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)) and (type_only or not checking):
                if isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("agl"):
                    found.extend((f"{child.module}.{a.name}", child.lineno) for a in child.names)
                elif isinstance(child, ast.Import):
                    found.extend((a.name, child.lineno) for a in child.names if a.name.startswith("agl"))
            visit(child, checking)

    visit(tree, False)
    return found


def _graph(type_only: bool) -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in mods.items():
        for target, _ in _imports(ast.parse(path.read_text()), type_only=type_only):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def _package(module: str) -> str:
    """A module's room: its top-level package (``agl.gateway.backends.vllm`` is in ``agl.gateway``); a
    loose top-level module is a room of its own."""
    return ".".join(module.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def go(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                go(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            go(v)
    return out


def test_no_import_circle_at_run_time() -> None:
    assert _cycles(_graph(type_only=False)) == []


def test_no_circle_spans_two_packages_even_with_type_only_imports() -> None:
    for cycle in _cycles(_graph(type_only=True)):
        assert len({_package(m) for m in cycle}) == 1, cycle


def test_packages_import_down_only() -> None:
    """Between packages the graph has no circle, so every arrow goes down a floor."""
    rooms: dict[str, set[str]] = collections.defaultdict(set)
    for a, targets in _graph(type_only=True).items():
        rooms[_package(a)] |= {_package(b) for b in targets if _package(b) != _package(a)}
    assert _cycles(rooms) == []


def test_at_most_ten_loose_top_level_modules() -> None:
    loose = sorted(p.name for p in CORE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 10, loose


def _trainer_private_names() -> set[str]:
    """The Trainer's private methods and the private attributes it sets on itself (``self._x = ...``)."""
    tree = ast.parse((CORE / "trainer" / "trainer.py").read_text())
    names = {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name.startswith("_") and not n.name.startswith("__")
    }
    names |= {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
        and n.attr.startswith("_")
        and not n.attr.startswith("__")
    }
    return names


def _is_trainer(node: ast.AST) -> bool:
    """Whether ``node`` names a Trainer the way core's code does: ``trainer``, ``t``, ``tr`` or ``self.t``."""
    if isinstance(node, ast.Name):
        return node.id in ("trainer", "t", "tr")
    return isinstance(node, ast.Attribute) and node.attr == "t" and getattr(node.value, "id", None) == "self"


def test_no_module_but_the_trainers_own_reaches_its_private_names() -> None:
    """Inside ``core/trainer/`` too: only ``trainer.py`` calls the Trainer's private methods or touches
    its private attributes (``distributed.py`` builds a follower's policy with ``build_policy``)."""
    private = _trainer_private_names()
    assert {"_start", "_tokenizer"} <= private  # the Trainer has private names to protect
    for name, path in _modules().items():
        if name == "agl.trainer.trainer":
            continue
        reached = {
            n.attr
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute) and n.attr in private and _is_trainer(n.value)
        }
        assert not reached, f"{name} reaches the Trainer's {sorted(reached)}"


@pytest.mark.parametrize("module", ["sync", "async_loop"])
def test_a_schedule_reads_the_trainer_only_through_steps(module: str) -> None:
    """A schedule holds no Trainer: it takes a ``Steps`` and its tasks, names no ``trainer``/``self.t``
    and imports no ``Trainer`` — every read of the run goes through :class:`agl.trainer.steps.Steps`."""
    tree = ast.parse((CORE / "trainer" / f"{module}.py").read_text())
    reads = sorted(  # ``trainer.x``, ``t.x``, ``self.t.x``, and ``steps.t`` (the Trainer behind Steps)
        f"line {n.lineno}: {ast.unparse(n)}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and (_is_trainer(n.value) or n.attr == "t")
    )
    assert not reads, f"agl.trainer.{module} reads the Trainer around Steps: {reads}"
    params = {a.arg for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) for a in n.args.args}
    assert not params & {"trainer", "t", "tr"}, params
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "Trainer" not in imported
    # and the schedules are built that way (a schedule given a Trainer would fail here)
    schedule = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Schedule"))
    init = next(n for n in schedule.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert [a.arg for a in init.args.args] == ["self", "steps", "train_tasks"]


def test_the_trainer_package_docstring_lists_every_module() -> None:
    import agl.trainer

    doc = agl.trainer.__doc__ or ""
    for path in sorted((CORE / "trainer").glob("*.py")):
        if path.name != "__init__.py":
            assert f"agl.trainer.{path.stem}`" in doc, path.name
    assert "step interface" in doc and "agl.trainer.steps" in doc


def test_lora_naming_is_taken_from_agl_lora_by_the_gateway_and_the_adapter() -> None:
    for folder in ("gateway", "adapter"):
        for path in (CORE / folder).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if "adapter_name" in line:
                    assert line.lstrip().startswith("from agl.lora import"), f"{path}:{i}: {line}"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("agl.rewards", "agl.adapter.air_rules"),
        ("agl.monitors", "agl.trainer.monitors"),
        ("agl.gate", "agl.trainer.gate"),
        ("agl.exactness", "agl.reports.exactness"),
        ("agl.agent_spans", "agl.instrumentation.agent"),
        ("agl.algorithms.adapters", "agl.algorithms.per_agent_lora"),
    ],
)
def test_moved_module_paths_still_import(old: str, new: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)


def test_faces_keep_their_names() -> None:
    import agl.runner
    import agl.tracing
    import agl.trainer

    assert agl.trainer.Trainer is agl.Trainer
    assert agl.runner.Runner is agl.Runner
    assert agl.tracing.rollout_context is agl.rollout_context
    from agl.algorithms.adapters import adapter_name  # an old call site of the naming rule

    assert adapter_name("sql.rewriter") == "sql_rewriter"


def test_cancel_skips_finished_and_missing_rollouts(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    live, done = (r.id for r in store.enqueue([NewRollout(), NewRollout()]))
    store.cancel(done)  # a second cancel is the store's ConflictError
    with caplog.at_level(logging.WARNING, "agl.trainer"):
        assert cancel_rollouts(store, [live, done, "ro-missing"]) == 1
    assert store.get_rollout(live).status == "cancelled"
    assert not caplog.records  # conflict and not-found are expected: nothing to say


def test_cancel_logs_a_store_that_fails_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    class Dead(MemoryStore):
        def cancel(self, rollout_id: str):  # type: ignore[override]
            raise ConnectionError("store server unreachable")

    with caplog.at_level(logging.WARNING, "agl.trainer"):
        assert cancel_rollouts(Dead(), ["a", "b"]) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all("unreachable" in m for m in messages)


def test_trainer_state_is_written_atomically(tmp_path: Path) -> None:
    assert read_state(tmp_path) is None
    write_state(tmp_path, {"checkpoint": "c1", "next_step": 2})
    write_state(tmp_path, {"checkpoint": "c2", "next_step": 4})
    assert read_state(tmp_path) == {"checkpoint": "c2", "next_step": 4}
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]


@pytest.mark.parametrize(
    ("step", "final", "val_before", "val_every", "due"),
    [
        (0, False, True, 0, True),
        (0, False, False, 0, False),
        (3, False, True, 3, True),
        (4, False, True, 3, False),
        (5, True, False, 0, True),
    ],
)
def test_held_out_schedule(step: int, final: bool, val_before: bool, val_every: int, due: bool) -> None:
    assert held_out_due(step, 0, final, val_before, val_every) is due


def _store_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_store_args(p)
    return p.parse_args(argv)


def test_one_store_flag_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(STORE_ENV, raising=False)
    monkeypatch.delenv(STORE_TOKEN_ENV, raising=False)
    assert store_url(_store_args([])) == DEFAULT_STORE
    monkeypatch.setenv(STORE_ENV, "memory://")
    monkeypatch.setenv(STORE_TOKEN_ENV, "s3cret")
    args = _store_args([])
    assert store_url(args) == "memory://" and store_token(args) == "s3cret"
    assert store_url(_store_args(["--store", "sqlite:///x.db"])) == "sqlite:///x.db"
    missing = tmp_path / "nope.db"
    with pytest.raises((UsageError, FileNotFoundError), match="no store at"):
        open_store_from_args(_store_args(["--store", f"sqlite:///{missing}"]))
    assert not missing.exists()  # refused, not created empty
