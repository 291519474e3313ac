"""Tasks from the usual files (agl.cli.task_files.load_tasks): each format read as the agent will see it, and a
bad row refused with the file and line (or row) before any task is used."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from agl.cli.task_files import load_tasks
from agl.errors import UsageError

ROWS = [{"a": 1, "b": 2, "q": "one plus two"}, {"a": 3, "b": 4, "q": "three, plus four"}]


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"needs {module} (agl[train])")


def test_jsonl_json_csv_and_tsv_give_the_same_tasks(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    (tmp_path / "t.json").write_text(json.dumps(ROWS))
    for name, delimiter in (("t.csv", ","), ("t.tsv", "\t")):
        with open(tmp_path / name, "w", newline="") as f:
            w = csv.DictWriter(f, ["a", "b", "q"], delimiter=delimiter)
            w.writeheader()
            w.writerows(ROWS)
    for name in ("t.jsonl", "t.json", "t.csv", "t.tsv"):
        assert load_tasks(tmp_path / name) == ROWS, name


def test_csv_columns_are_numbers_only_when_every_cell_is(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("id,score,answer,note\n1,0.5,42,\n2,,007,x\n3,1.5,abc,y\n")
    assert load_tasks(path) == [
        {"id": 1, "score": 0.5, "answer": "42", "note": ""},
        {"id": 2, "score": None, "answer": "007", "note": "x"},
        {"id": 3, "score": 1.5, "answer": "abc", "note": "y"},
    ]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("t.jsonl", '{"a": 1}\n\n{"a": 2,\n', "t.jsonl:3 is not JSON"),
        ("t.jsonl", '{"a": 1}\n{"a": NaN}\n', "t.jsonl:2: nan is not a finite number"),
        ("t.json", '{"a": 1}', "holds a JSON dict; a JSON task file is an array of tasks"),
        ("t.json", '[{"a": 1}, {"a": Infinity}]', "t.json item 1: inf is not a finite number"),
        ("t.csv", "a,b\n1,2\n3,4,5\n", "t.csv:3: 3 fields, the header has 2 (a, b)"),
        ("t.csv", "a,b\n1,2\n3\n", "t.csv:3: 1 fields, the header has 2"),
        ("t.csv", "a,a\n1,2\n", "distinct, non-empty column names"),
        ("t.jsonl", "\n\n", "holds no tasks"),
        ("t.csv", "a,b\n", "holds no tasks"),
        ("t.txt", "a\n", "unknown task file type '.txt'"),
    ],
)
def test_a_bad_row_names_its_file_and_line(name: str, text: str, message: str, tmp_path: Path) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_tasks(tmp_path / name)
    assert "\n" not in str(err.value)


def test_a_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such task file"):
        load_tasks(tmp_path / "nope.jsonl")


def test_module_attribute_gives_a_python_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_tasks.py").write_text(
        "TASKS = [{'a': 1}, {'a': 2}]\ndef make():\n    return ({'a': i} for i in range(3))\nBAD = [{'a': float('nan')}]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_tasks", raising=False)
    assert load_tasks("my_tasks:TASKS") == [{"a": 1}, {"a": 2}]
    assert load_tasks("my_tasks:make") == [{"a": 0}, {"a": 1}, {"a": 2}]
    with pytest.raises(UsageError, match="my_tasks:BAD item 0: nan"):
        load_tasks("my_tasks:BAD")
    with pytest.raises(UsageError, match="has no attribute 'NOPE'"):
        load_tasks("my_tasks:NOPE")


def test_parquet_rows_are_dicts(tmp_path: Path) -> None:
    _needs("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "t.parquet")
    assert load_tasks(tmp_path / "t.parquet") == ROWS
    pq.write_table(pa.Table.from_pylist([{"a": 1.0}, {"a": float("nan")}]), tmp_path / "bad.parquet")
    with pytest.raises(UsageError, match=r"bad.parquet row 1: nan is not a finite number"):
        load_tasks(tmp_path / "bad.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(UsageError, match="is not a Parquet file"):
        load_tasks(tmp_path / "junk.parquet")


def test_a_saved_dataset_and_its_splits(tmp_path: Path) -> None:
    _needs("datasets")
    import datasets

    ds = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    )
    ds.save_to_disk(str(tmp_path / "dd"))
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert load_tasks(tmp_path / "dd") == ROWS  # the train split by default
    assert load_tasks(tmp_path / "dd", split="test") == ROWS[:1]
    assert load_tasks(tmp_path / "one") == ROWS
    with pytest.raises(UsageError, match="has no split 'validation'; it has train, test"):
        load_tasks(tmp_path / "dd", split="validation")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="not a saved dataset"):
        load_tasks(tmp_path / "empty")


def test_a_hub_dataset_not_in_the_cache_is_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _needs("datasets")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    with pytest.raises(
        UsageError,
        match="agl-test/no-such-set: not a task file, a folder, or a Hub dataset in the local cache",
    ):
        load_tasks("agl-test/no-such-set")
