"""BFCL's cases as agl tasks, with a fixed seeded split by case.

The trained categories are BFCL's single-turn Python ones, :data:`SPLIT_CATEGORIES`
(``simple_python``, ``multiple``, ``parallel``, ``parallel_multiple``, ``irrelevance``). Each is split
by case: its case ids are shuffled with ``random.Random(f"{SEED}:{category}")`` and the first
:data:`HELD_OUT_FRACTION` of them are held out (``test``), the rest are ``train``. The split is a
function of the ids alone, so it is the same on every machine and every run; the held-out cases never
reach the demonstrations, prompts or selection (only ``train`` cases do). Other categories
(``multi_turn_base``, ``live_simple``, ...) are never trained on: the eval command scores all of them.

A task is a JSON object: ``id``, ``category``, the case's ``question`` (BFCL's turns of messages),
``function`` (its function docs) and, for multi-turn cases, ``initial_config`` and
``involved_classes``. The possible answers stay out of the task (the agent never sees them); the
reward looks them up by id (:func:`answer`).
"""

from __future__ import annotations

import random
from typing import Any

from examples.bfcl_agent import bfcl

__all__ = [
    "CATEGORIES",
    "HELD_OUT_FRACTION",
    "MULTI_TURN",
    "SEED",
    "SPLIT_CATEGORIES",
    "answer",
    "check_category",
    "load_tasks",
    "split_ids",
]

SEED = 67
HELD_OUT_FRACTION = 0.3
#: the categories split into train and held-out cases (the trained ones)
SPLIT_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
#: the multi-turn category graded through BFCL's own loop and checker (eval only, here)
MULTI_TURN = "multi_turn_base"
#: every category the eval command scores: BFCL's single-turn AST categories and multi_turn_base
CATEGORIES = (
    *SPLIT_CATEGORIES,
    "simple_java",
    "simple_javascript",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
    "live_irrelevance",
    MULTI_TURN,
)


def check_category(name: str) -> str:
    """``name`` when it is one of :data:`CATEGORIES`; else a ValueError naming them."""
    if name not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {name!r}: choose one of {', '.join(CATEGORIES)}")
    return name


def split_ids(category: str, ids: list[str]) -> tuple[list[str], list[str]]:
    """``(train, test)`` ids of ``category``: the seeded shuffle's first 30% are held out. Both lists
    keep BFCL's order (sorted by case number)."""
    order = sorted(ids, key=lambda i: int(i.rsplit("_", 1)[1]))
    shuffled = list(order)
    random.Random(f"{SEED}:{category}").shuffle(shuffled)
    held = set(shuffled[: round(len(shuffled) * HELD_OUT_FRACTION)])
    return [i for i in order if i not in held], [i for i in order if i in held]


def _task(case: dict[str, Any], category: str) -> dict[str, Any]:
    keep = ("id", "question", "function", "initial_config", "involved_classes")
    return {"category": category, **{k: case[k] for k in keep if k in case}}


def load_tasks(
    split: str = "train", categories: tuple[str, ...] | list[str] | None = None, *, limit: int | None = None
) -> list[dict[str, Any]]:
    """The tasks of ``split`` (``train``, ``test`` or ``all``) over ``categories`` (default: the split
    ones), round-robin across categories so a prefix (``limit``) covers every category."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be train, test or all, got {split!r}")
    per: list[list[dict[str, Any]]] = []
    for category in categories or SPLIT_CATEGORIES:
        check_category(category)
        cases = {c["id"]: c for c in bfcl.load_cases(category)}
        if split == "all" or category not in SPLIT_CATEGORIES:
            ids = list(cases)
            if split == "train" and category not in SPLIT_CATEGORIES:
                raise ValueError(f"{category} is not trained on: its cases are in split 'all' only")
        else:
            ids = split_ids(category, list(cases))[0 if split == "train" else 1]
        per.append([_task(cases[i], category) for i in ids])
    tasks = [t for group in _round_robin(per) for t in group]
    return tasks[:limit] if limit is not None else tasks


def _round_robin(per: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    out, longest = [], max((len(p) for p in per), default=0)
    for i in range(longest):
        out.append([p[i] for p in per if i < len(p)])
    return out


def answer(task: dict[str, Any]) -> Any:
    """BFCL's possible answer of ``task`` (None for irrelevance cases: no call is the answer)."""
    return bfcl.load_answers(task["category"]).get(task["id"])


#: ``module:attribute`` task lists for ``agl train --train/--val`` (examples/bfcl_agent/run.yaml)
def __getattr__(name: str) -> Any:
    if name == "TRAIN":
        return load_tasks("train")
    if name == "HELD_OUT":
        return [{**t, "temperature": 0.0} for t in load_tasks("test")]
    raise AttributeError(name)
