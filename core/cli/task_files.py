"""Tasks from the files people keep them in: :func:`load_tasks`.

A task source is one of

- a **JSONL** file (``.jsonl``/``.ndjson``: one JSON value per line, blank lines skipped),
- a **JSON** file (``.json``: an array of tasks),
- a **CSV** file (``.csv``, or ``.tsv`` tab-separated: a header row, then one task per row; a column
  whose every non-empty cell is a number becomes numbers, as pandas and ``datasets`` read it),
- a **Parquet** file (``.parquet``; needs pyarrow, which ``agl[train]`` brings),
- a folder a ``datasets`` dataset was saved to (``Dataset.save_to_disk``),
- a Hugging Face Hub dataset id already in the local cache (nothing is downloaded),
- or ``module:attribute``, a Python list of tasks (the current directory is importable).

Each task reaches the agent as written: a row of a table is a dict of its columns. Every row is
checked before any is returned — JSON, finite numbers, the header's number of fields — and the
first bad one fails with the file and line (or row) named, so a training run that starts has every
task it will enqueue, and none is half-enqueued.
"""

from __future__ import annotations

import csv
import importlib
import json
import math
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agl.errors import UsageError

__all__ = ["TASK_FILE_SUFFIXES", "import_object", "load_tasks"]

#: file suffix -> its reader's format name
TASK_FILE_SUFFIXES = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".csv": "csv",
    ".tsv": "csv",
    ".parquet": "parquet",
}
_PY_OBJECT = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def load_tasks(
    source: str | os.PathLike[str], *, split: str | None = None, name: str | None = None
) -> list[Any]:
    """The tasks of ``source`` (see the module docstring), every row checked; ``split`` picks a split of
    a saved ``DatasetDict`` or a Hub dataset (default: its only split, else ``train``), ``name`` a Hub
    dataset's configuration. Raises :class:`~agl.errors.UsageError` naming the file and the line or
    row of the first bad task, or ``FileNotFoundError`` for a source that is not there."""
    spec = os.fspath(source)
    path = Path(spec)
    if path.is_dir():
        return _checked(_saved_dataset(path, split), f"{path} row", 0)
    if path.is_file():
        kind = TASK_FILE_SUFFIXES.get(path.suffix.lower())
        if kind is None:
            suffixes = ", ".join(TASK_FILE_SUFFIXES)
            raise UsageError(f"{path}: unknown task file type {path.suffix!r}; agl reads {suffixes}")
        return _READERS[kind](path)
    if _PY_OBJECT.fullmatch(spec):
        return _python_object(spec)
    if _HUB_ID.fullmatch(spec) and path.suffix.lower() not in TASK_FILE_SUFFIXES:
        return _hub_dataset(spec, split, name)
    raise FileNotFoundError(f"no such task file: {spec}")


def _check(where: str, value: Any) -> Any:
    """A task checked as the store will check it: JSON values, finite numbers."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise UsageError(f"{where}: {v!r} is not a finite number (tasks are JSON)")
        if isinstance(v, dict):
            for key in v:
                if not isinstance(key, str):
                    raise UsageError(f"{where}: key {key!r} is not text (tasks are JSON)")
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif v is not None and not isinstance(v, (str, int, float, bool)):
            raise UsageError(f"{where}: a {type(v).__name__} is not a JSON value")
    return value


def _checked(rows: Iterable[Any], label: str, start: int = 1) -> list[Any]:
    out = [_check(f"{label} {i}", row) for i, row in enumerate(rows, start)]
    if not out:
        raise UsageError(f"{label.rsplit(' ', 1)[0]} holds no tasks")
    return out


def _read_jsonl(path: Path) -> list[Any]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as exc:
                raise UsageError(f"{path}:{n} is not JSON: {exc}") from None
            out.append(_check(f"{path}:{n}", value))
    if not out:
        raise UsageError(f"{path} holds no tasks")
    return out


def _read_json(path: Path) -> list[Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise UsageError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, list):
        raise UsageError(
            f"{path} holds a JSON {type(data).__name__}; a JSON task file is an array of tasks "
            "(or write one task per line as .jsonl)"
        )
    return _checked(data, f"{path} item", 0)


def _read_csv(path: Path) -> list[Any]:
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    rows: list[tuple[int, dict[str, str]]] = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        header = reader.fieldnames or []
        if len(set(header)) != len(header) or any(not h for h in header):
            raise UsageError(f"{path}:1: the header needs distinct, non-empty column names, got {header}")
        for row in reader:
            extra = row.pop(None, None) or []  # type: ignore[call-overload]
            missing = sum(v is None for v in row.values())
            if extra or missing:
                got = len(header) - missing + len(extra)
                raise UsageError(
                    f"{path}:{reader.line_num}: {got} fields, the header has {len(header)} ({', '.join(header)})"
                )
            rows.append((reader.line_num, row))
    if not rows:
        raise UsageError(f"{path} holds no tasks")
    kinds = {column: _column_type([r[column] for _, r in rows]) for column in header}
    return [{c: _cell(r[c], kinds[c]) for c in header} for _, r in rows]


def _column_type(cells: list[str]) -> type:
    """int when every non-empty cell is an integer, float when a number, else str."""
    filled = [c.strip() for c in cells if c.strip()]
    for kind in (int, float):
        try:
            numbers = [kind(c) for c in filled]
        except ValueError:
            continue
        if filled and all(math.isfinite(x) for x in numbers):
            return kind
    return str


def _cell(text: str, kind: type) -> Any:
    if kind is str:
        return text
    return kind(text) if text.strip() else None


def _read_parquet(path: Path) -> list[Any]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors: a file that is not Parquet
        raise UsageError(f"{path} is not a Parquet file: {exc}") from None
    return _checked(table.to_pylist(), f"{path} row", 0)


def _pick_split(splits: list[str], split: str | None, where: str) -> str:
    if split is not None:
        if split not in splits:
            raise UsageError(f"{where} has no split {split!r}; it has {', '.join(splits)}")
        return split
    if len(splits) == 1:
        return splits[0]
    if "train" in splits:
        return "train"
    raise UsageError(f"{where} has the splits {', '.join(splits)}: name one (--train-split / --val-split)")


def _saved_dataset(path: Path, split: str | None) -> list[Any]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise UsageError(
            f"{path} is a folder but not a saved dataset (datasets.Dataset.save_to_disk)"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[_pick_split(list(ds), split, str(path))]
    return list(ds)


def _hub_dataset(spec: str, split: str | None, name: str | None) -> list[Any]:
    """A Hub dataset from the local cache only (HF_DATASETS_OFFLINE): agl never downloads data."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    try:
        ds = datasets.load_dataset(spec, name)
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds for "not here"
        raise UsageError(
            f"{spec}: not a task file, a folder, or a Hub dataset in the local cache "
            f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[_pick_split(list(ds), split, spec)]
    return _checked(list(ds), f"{spec} row", 0)


def import_object(spec: str, what: str = "tasks") -> Any:
    """The object ``module:attribute`` names (a dotted attribute path; the current directory is
    importable, as for ``agl runner --agent``)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"{what}: expected module:attribute, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"{what}: cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{what}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _python_object(spec: str) -> list[Any]:
    obj = import_object(spec)
    if callable(obj):
        obj = obj()
    if isinstance(obj, (str, bytes, dict)) or not isinstance(obj, Iterable):
        raise UsageError(f"{spec} is a {type(obj).__name__}, not a list of tasks")
    return _checked(list(obj), f"{spec} item", 0)


_READERS = {"jsonl": _read_jsonl, "json": _read_json, "csv": _read_csv, "parquet": _read_parquet}
