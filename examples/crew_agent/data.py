"""The fact base and the writing tasks: generated, so every gold fact is certainly correct.

A seeded generator builds a directory of fictional companies, each with six facts (founding year,
headquarters, chief executive, staff, main product, stock ticker). The researcher's ``lookup`` tool
reads this directory by key (the company's name); a key that is not in it is an error. A task asks
for a short profile of one company that mentions two or three named facts; its gold facts are read
off the directory, so coverage can be checked exactly. Names are unique and no value of one fact
appears inside another fact's value of the same company, so a fact found in the text was written as
that fact.

The held-out split is by company (crc32 of its name), so no test task is about a company that a
training task is about. Everything is a pure function of ``seed`` and ``size``.
"""

from __future__ import annotations

import random
import zlib
from functools import lru_cache
from typing import Any

__all__ = [
    "FACTS",
    "build_directory",
    "fact_lines",
    "load_tasks",
    "lookup_key",
    "summary",
]

SEED = 7
DEFAULT_SIZE = 400
TEST_FRACTION = 0.2

#: fact name -> how a task names it
FACTS: dict[str, str] = {
    "founded": "founding year",
    "headquarters": "headquarters city",
    "ceo": "chief executive",
    "employees": "number of employees",
    "product": "main product",
    "ticker": "stock ticker",
}

_SYLLABLES = (
    "ka lo ven dra mir tal bor sen ri an tes vor hal quin zar mo pra dun fel gar ol ur bel cor".split()
)
_SUFFIXES = ("Corp", "Works", "Industries", "Group", "Partners", "Holdings", "Dynamics", "Collective")
_CITIES = (
    "Arden Belmora Calder Dunmore Elsworth Fennick Galway Harrow Ilford Jarrow Kelso Lanark Morvane "
    "Norwick Oban Penrith Quarry Rothwell Selby Tavish Ulverston Varne Wexford Yarrow"
).split()
_FIRST = (
    "Alma Boris Clara Dmitri Elena Farid Greta Hugo Ines Jonas Kira Luca Mara Nils Olga Pavel Rosa".split()
)
_LAST = "Abbot Brandt Castell Devlin Engel Falk Gorski Holm Ivers Janssen Kovac Lund Moreau Novak Oyelaran".split()
_PRODUCTS = (
    "solar panels|water filters|bicycle frames|drone motors|glass bottles|wool blankets|microscopes|"
    "garden tools|hearing aids|wind turbines|ceramic tiles|kayaks|printing inks|pressure valves|"
    "seed drills|lab centrifuges|ski bindings|fire alarms|ship propellers|pipe organs"
).split("|")


def lookup_key(name: str) -> str:
    """The directory key for a company name: lower case, single spaces."""
    return " ".join(name.lower().split())


@lru_cache(maxsize=4)
def build_directory(seed: int = SEED, size: int = DEFAULT_SIZE) -> dict[str, dict[str, str]]:
    """``{key: {"name": ..., fact: value, ...}}`` for ``size`` companies; values are strings."""
    if size < 5:
        raise ValueError(f"size must be >= 5 companies, got {size}")
    rng = random.Random(seed)
    out: dict[str, dict[str, str]] = {}
    tickers: set[str] = set()
    while len(out) < size:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        name = f"{word} {rng.choice(_SUFFIXES)}"
        key = lookup_key(name)
        if key in out:
            continue
        ticker = "".join(c for c in word.upper() if c.isalpha())[:3] + rng.choice("QXZJK")
        if ticker in tickers:
            continue
        founded, employees = str(rng.randrange(1890, 2021)), str(rng.randrange(12, 9000))
        if founded == employees:
            continue
        tickers.add(ticker)
        out[key] = {
            "name": name,
            "founded": founded,
            "headquarters": rng.choice(_CITIES),
            "ceo": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
            "employees": employees,
            "product": rng.choice(_PRODUCTS),
            "ticker": ticker,
        }
    return out


def fact_lines(entry: dict[str, str]) -> str:
    """What the lookup tool returns for one company."""
    return "\n".join([f"name: {entry['name']}", *(f"{fact}: {entry[fact]}" for fact in FACTS)])


def is_test(name: str) -> bool:
    return zlib.crc32(name.encode()) % 100 < TEST_FRACTION * 100


def _tasks(seed: int, size: int) -> list[dict[str, Any]]:
    rng = random.Random(seed + 1)
    tasks = []
    for entry in build_directory(seed, size).values():
        asked = sorted(rng.sample(list(FACTS), rng.choice((2, 3))), key=list(FACTS).index)
        tasks.append(
            {
                "company": entry["name"],
                "facts": asked,
                "gold": {fact: entry[fact] for fact in asked},
                "split": "test" if is_test(entry["name"]) else "train",
                "size": size,
                "seed": seed,
            }
        )
    for i, task in enumerate(tasks):
        task["id"] = f"c{i:04d}"
    return tasks


def load_tasks(
    split: str = "train", *, size: int = DEFAULT_SIZE, seed: int = SEED, limit: int | None = None
) -> list[dict[str, Any]]:
    """The tasks of ``split`` (``train`` or ``test``) in a fixed shuffled order. A task is
    ``{id, company, facts, gold, split, size, seed}``; ``facts`` are keys of :data:`FACTS`."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    tasks = [t for t in _tasks(seed, size) if t["split"] == split]
    random.Random(seed + 2).shuffle(tasks)
    return tasks[:limit] if limit is not None else tasks


def summary(size: int = DEFAULT_SIZE, seed: int = SEED) -> str:
    tasks = _tasks(seed, size)
    n_test = sum(1 for t in tasks if t["split"] == "test")
    return f"{size} companies, {len(tasks)} tasks ({len(tasks) - n_test} train, {n_test} test)"
