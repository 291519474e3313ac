"""The text-to-SQL data: eight small SQLite databases in different domains and a few hundred
questions with gold SQL, all generated deterministically from fixed seeds.

Spider cannot be downloaded here, so this builds data of the same kind. Every question comes from a
template over a table's columns; its gold SQL is written by the same template, and the gold *answer*
is whatever SQLite returns for the gold SQL — never typed by hand. A question is kept only when its
gold answer is unambiguous: a non-empty result without NULLs, a unique arg-max/arg-min, no tie at a
``LIMIT`` boundary. As in Spider, the held-out split is by database: the test databases (``music``,
``restaurant``) are never seen in training.

``python -m examples.sql_agent data`` writes the databases and prints a summary.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DOMAINS",
    "TEST_DBS",
    "TRAIN_DBS",
    "build_databases",
    "db_path",
    "default_data_dir",
    "load_tasks",
    "schema_of",
]

SEED = 20_240_612
QUESTIONS_PER_DB = 45
TRAIN_DBS = ("shop", "school", "library", "flights", "hospital", "sports")
TEST_DBS = ("music", "restaurant")


# ---------------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Num:
    lo: int
    hi: int
    decimals: int = 0  # 2 for money


@dataclass(frozen=True)
class FK:
    column: str
    parent: str
    verb: str  # "were placed by": "How many orders were placed by the customer with name 'X'?"


@dataclass(frozen=True)
class Table:
    name: str
    singular: str
    label: str  # the column that names a row ("name", "title", "code")
    rows: int
    labels: tuple[str, ...]  # word pools combined into unique labels
    cats: dict[str, tuple[str, ...]] = field(default_factory=dict)
    nums: dict[str, Num] = field(default_factory=dict)
    fk: FK | None = None


_FIRST = ("Ada", "Ben", "Chen", "Dana", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Mia", "Nils", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara")  # fmt: skip
_LAST = ("Smith", "Garcia", "Kim", "Novak", "Okafor", "Rossi", "Silva", "Tanaka", "Weber", "Young")
_CITIES = ("Paris", "Lima", "Oslo", "Cairo", "Seoul", "Austin", "Lagos", "Porto")
_COUNTRIES = ("France", "Peru", "Norway", "Egypt", "Japan", "Brazil", "Canada", "Kenya")

DOMAINS: dict[str, tuple[Table, ...]] = {
    "shop": (
        Table("customers", "customer", "name", 12, (_FIRST, _LAST),
              cats={"city": _CITIES[:5], "membership": ("gold", "silver", "basic")},
              nums={"age": Num(18, 80)}),
        Table("orders", "order", "order_number", 36, (("ORD",), tuple(str(n) for n in range(1001, 1100))),
              cats={"status": ("shipped", "pending", "cancelled")},
              nums={"amount": Num(5, 500, 2), "items": Num(1, 9)},
              fk=FK("customer_id", "customers", "were placed by")),
    ),
    "school": (
        Table("teachers", "teacher", "name", 9, (_FIRST, _LAST),
              cats={"subject": ("math", "history", "biology", "art")},
              nums={"years_experience": Num(1, 35)}),
        Table("students", "student", "name", 40, (_FIRST, _LAST),
              cats={"city": _CITIES[2:7]},
              nums={"grade_level": Num(6, 12), "age": Num(11, 18), "score": Num(40, 100)},
              fk=FK("teacher_id", "teachers", "are taught by")),
    ),
    "library": (
        Table("authors", "author", "name", 10, (_FIRST, _LAST),
              cats={"country": _COUNTRIES[:5]},
              nums={"birth_year": Num(1900, 1995)}),
        Table("books", "book", "title", 34,
              (("The", "A", "Last", "Silent", "Hidden", "Lost"), ("River", "Garden", "Mirror", "Winter", "Harbor", "Letter", "Forest")),
              cats={"genre": ("mystery", "fantasy", "poetry", "history")},
              nums={"pages": Num(90, 900), "year": Num(1950, 2023)},
              fk=FK("author_id", "authors", "were written by")),
    ),
    "flights": (
        Table("airports", "airport", "code", 8, (("A", "B", "C", "D", "K", "L", "M", "S"), ("AX", "EN", "IR", "OL", "UP")),
              cats={"country": _COUNTRIES[2:7]},
              nums={"runways": Num(1, 6)}),
        Table("flights", "flight", "flight_number", 38, (("AF", "LH", "KL", "QR"), tuple(str(n) for n in range(100, 190))),
              cats={"airline": ("Aero", "Skyline", "Nimbus", "Polar")},
              nums={"distance": Num(200, 9000), "price": Num(40, 1500, 2), "duration_minutes": Num(45, 720)},
              fk=FK("origin_airport_id", "airports", "depart from")),
    ),
    "hospital": (
        Table("doctors", "doctor", "name", 9, (_FIRST, _LAST),
              cats={"specialty": ("cardiology", "neurology", "pediatrics", "oncology")},
              nums={"years_experience": Num(2, 40)}),
        Table("patients", "patient", "name", 38, (_FIRST, _LAST),
              cats={"city": _CITIES[:6], "blood_type": ("A", "B", "AB", "O")},
              nums={"age": Num(1, 95), "days_admitted": Num(1, 30)},
              fk=FK("doctor_id", "doctors", "are treated by")),
    ),
    "sports": (
        Table("teams", "team", "name", 8, (_CITIES, ("Lions", "Comets", "Rovers", "Tigers")),
              cats={"league": ("north", "south")},
              nums={"founded": Num(1880, 2010)}),
        Table("players", "player", "name", 40, (_FIRST, _LAST),
              cats={"position": ("goalkeeper", "defender", "midfielder", "forward")},
              nums={"age": Num(17, 38), "goals": Num(0, 40), "salary": Num(20, 900)},
              fk=FK("team_id", "teams", "play for")),
    ),
    "music": (
        Table("artists", "artist", "name", 10, (("DJ", "MC", "The", "Lady", "Big"), ("Echo", "Nova", "Drift", "Pulse", "Flare")),
              cats={"genre": ("jazz", "rock", "pop", "folk"), "country": _COUNTRIES[3:8]},
              nums={"debut_year": Num(1960, 2020)}),
        Table("albums", "album", "title", 36,
              (("Blue", "Neon", "Golden", "Paper", "Velvet", "Broken"), ("Skies", "Roads", "Hearts", "Dreams", "Lights", "Waves")),
              cats={"label": ("Orbit", "Maple", "Harbor")},
              nums={"year": Num(1965, 2023), "tracks": Num(6, 20), "sales": Num(1000, 90000)},
              fk=FK("artist_id", "artists", "were released by")),
    ),
    "restaurant": (
        Table("restaurants", "restaurant", "name", 9, (("Casa", "Chez", "Little", "Golden", "Blue"), ("Fig", "Olive", "Lotus", "Pepper", "Basil")),
              cats={"cuisine": ("italian", "thai", "mexican", "french"), "city": _CITIES[1:6]},
              nums={"rating": Num(1, 5), "seats": Num(20, 200)}),
        Table("dishes", "dish", "name", 38,
              (("spicy", "grilled", "sweet", "smoked", "fresh", "crispy"), ("noodles", "tacos", "salad", "soup", "curry", "pasta", "tart")),
              cats={"course": ("starter", "main", "dessert")},
              nums={"price": Num(4, 60, 2), "calories": Num(80, 1400)},
              fk=FK("restaurant_id", "restaurants", "are served at")),
    ),
}  # fmt: skip


# ------------------------------------------------------------------------------------- databases


def default_data_dir() -> Path:
    """``$AGL_EXAMPLES_DATA/sql_agent``, else the agl cache dir (``~/.cache/agl/examples/sql_agent``)."""
    env = os.environ.get("AGL_EXAMPLES_DATA")
    if env:
        return Path(env).expanduser() / "sql_agent"
    from agl.chat.models import cache_dir

    return cache_dir() / "examples" / "sql_agent"


def _plural(table: Table) -> str:
    return table.name


def _labels(table: Table, rng: random.Random) -> list[str]:
    first, second = table.labels
    pool = [f"{a} {b}" if a not in ("ORD",) else f"{a}-{b}" for a in first for b in second]
    if table.label in ("code", "flight_number"):
        pool = [f"{a}{b}" for a in first for b in second]
    if len(pool) < table.rows:
        raise ValueError(f"{table.name}: only {len(pool)} distinct labels for {table.rows} rows")
    return rng.sample(pool, table.rows)


def _value(num: Num, rng: random.Random) -> float | int:
    if num.decimals:
        return round(rng.uniform(num.lo, num.hi), num.decimals)
    return rng.randint(num.lo, num.hi)


def _create_sql(table: Table) -> str:
    cols = ["id INTEGER PRIMARY KEY", f"{table.label} TEXT NOT NULL UNIQUE"]
    cols += [f"{c} TEXT NOT NULL" for c in table.cats]
    cols += [f"{c} {'REAL' if n.decimals else 'INTEGER'} NOT NULL" for c, n in table.nums.items()]
    if table.fk is not None:
        cols.append(f"{table.fk.column} INTEGER NOT NULL REFERENCES {table.fk.parent}(id)")
    return f"CREATE TABLE {table.name} ({', '.join(cols)})"


def _write_db(path: Path, db_id: str) -> None:
    rng = random.Random(f"{SEED}-{db_id}")
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    conn = sqlite3.connect(tmp)
    try:
        ids: dict[str, int] = {}
        for table in DOMAINS[db_id]:
            conn.execute(_create_sql(table))
            for i, label in enumerate(_labels(table, rng), start=1):
                row: list[Any] = [i, label]
                row += [rng.choice(values) for values in table.cats.values()]
                row += [_value(num, rng) for num in table.nums.values()]
                if table.fk is not None:
                    row.append(rng.randint(1, ids[table.fk.parent]))
                conn.execute(f"INSERT INTO {table.name} VALUES ({', '.join('?' * len(row))})", row)
            ids[table.name] = table.rows
        conn.commit()
    finally:
        conn.close()
    os.replace(tmp, path)  # concurrent builders never see half a database


def db_path(db_id: str, data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The database file of ``db_id``, built on first use."""
    if db_id not in DOMAINS:
        raise ValueError(f"unknown database {db_id!r}; known: {', '.join(DOMAINS)}")
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    path = root / f"{db_id}.sqlite"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        _write_db(path, db_id)
    return path


def build_databases(data_dir: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    return {db_id: db_path(db_id, data_dir) for db_id in DOMAINS}


def schema_of(db: str | os.PathLike[str]) -> str:
    """The CREATE TABLE statements the agent sees, one per line."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' ORDER BY rowid").fetchall()
    return "\n".join(f"{sql};" for (sql,) in rows)


# ------------------------------------------------------------------------------------- questions


def _phrase(column: str) -> str:
    return column.replace("_", " ")


def _a(phrase: str) -> str:
    return f"{'an' if phrase[0] in 'aeiou' else 'a'} {phrase}"


def _fmt(x: float | int) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _candidates(db_id: str, conn: sqlite3.Connection, rng: random.Random) -> list[tuple[Any, ...]]:
    """(question, gold SQL[, (table, column, direction, k) of a LIMIT]) from every template over
    every table; which of them have one right answer is checked afterwards."""
    out: list[tuple[Any, ...]] = []
    tables = {t.name: t for t in DOMAINS[db_id]}
    for t in DOMAINS[db_id]:
        plural, one, label = _plural(t), t.singular, t.label
        out.append((f"How many {plural} are there?", f"SELECT COUNT(*) FROM {plural}"))
        for c, values in t.cats.items():
            pc = _phrase(c)
            out.append(
                (
                    f"For each {pc}, how many {plural} are there?",
                    f"SELECT {c}, COUNT(*) FROM {plural} GROUP BY {c}",
                )
            )
            out.append(
                (f"List the distinct {pc} values of the {plural}.", f"SELECT DISTINCT {c} FROM {plural}")
            )
            for v in rng.sample(values, min(3, len(values))):
                out.append(
                    (
                        f"How many {plural} have {pc} '{v}'?",
                        f"SELECT COUNT(*) FROM {plural} WHERE {c} = '{v}'",
                    )
                )
                out.append(
                    (f"List the {_phrase(label)} of every {one} with {pc} '{v}'.",
                     f"SELECT {label} FROM {plural} WHERE {c} = '{v}'")
                )  # fmt: skip
                for n in rng.sample(list(t.nums), min(1, len(t.nums))):
                    out.append(
                        (f"What is the average {_phrase(n)} of the {plural} with {pc} '{v}'?",
                         f"SELECT AVG({n}) FROM {plural} WHERE {c} = '{v}'")
                    )  # fmt: skip
        for n, num in t.nums.items():
            pn = _phrase(n)
            values = [r[0] for r in conn.execute(f"SELECT {n} FROM {plural} ORDER BY {n}")]
            for word, fn in (("average", "AVG"), ("highest", "MAX"), ("lowest", "MIN"), ("total", "SUM")):
                out.append((f"What is the {word} {pn} of all {plural}?", f"SELECT {fn}({n}) FROM {plural}"))
            out.append(
                (f"Which {one} has the highest {pn}? Give its {_phrase(label)}.",
                 f"SELECT {label} FROM {plural} ORDER BY {n} DESC LIMIT 1", (plural, n, "DESC", 1))
            )  # fmt: skip
            out.append(
                (f"Which {one} has the lowest {pn}? Give its {_phrase(label)}.",
                 f"SELECT {label} FROM {plural} ORDER BY {n} ASC LIMIT 1", (plural, n, "ASC", 1))
            )  # fmt: skip
            out.append(
                (f"List the {_phrase(label)} of the 3 {plural} with the highest {pn}, highest first.",
                 f"SELECT {label} FROM {plural} ORDER BY {n} DESC LIMIT 3", (plural, n, "DESC", 3))
            )  # fmt: skip
            for q in (0.25, 0.75):
                x = values[int(q * (len(values) - 1))]
                x = round(x) if num.decimals else x
                out.append(
                    (f"How many {plural} have {_a(pn)} greater than {_fmt(x)}?",
                     f"SELECT COUNT(*) FROM {plural} WHERE {n} > {_fmt(x)}")
                )  # fmt: skip
                out.append(
                    (f"List the {_phrase(label)} of the {plural} with {_a(pn)} less than {_fmt(x)}.",
                     f"SELECT {label} FROM {plural} WHERE {n} < {_fmt(x)}")
                )  # fmt: skip
        if t.fk is not None:
            p = tables[t.fk.parent]
            pl, fk, verb = p.label, t.fk.column, t.fk.verb
            join = f"FROM {plural} JOIN {p.name} ON {plural}.{fk} = {p.name}.id"
            names = [r[0] for r in conn.execute(f"SELECT {pl} FROM {p.name} ORDER BY id")]
            for name in rng.sample(names, min(4, len(names))):
                out.append(
                    (f"How many {plural} {verb} the {p.singular} with {_phrase(pl)} '{name}'?",
                     f"SELECT COUNT(*) {join} WHERE {p.name}.{pl} = '{name}'")
                )  # fmt: skip
                out.append(
                    (f"List the {_phrase(label)} of the {plural} that {verb} the {p.singular} with {_phrase(pl)} '{name}'.",
                     f"SELECT {plural}.{label} {join} WHERE {p.name}.{pl} = '{name}'")
                )  # fmt: skip
            for c, values in p.cats.items():
                for v in rng.sample(values, min(2, len(values))):
                    out.append(
                        (f"How many {plural} {verb} {p.name} with {_phrase(c)} '{v}'?",
                         f"SELECT COUNT(*) {join} WHERE {p.name}.{c} = '{v}'")
                    )  # fmt: skip
            out.append(
                (f"For each {p.singular} {_phrase(pl)}, how many {plural} {verb} it?",
                 f"SELECT {p.name}.{pl}, COUNT(*) {join} GROUP BY {p.name}.{pl}")
            )  # fmt: skip
    return out


def _unambiguous(conn: sqlite3.Connection, sql: str, limit: tuple[str, str, str, int] | None) -> bool:
    """Whether the question has exactly one right answer."""
    rows = conn.execute(sql).fetchall()
    if not rows or any(v is None for row in rows for v in row):
        return False
    if rows == [(0,)]:
        return False  # a count of zero would also be matched by many wrong queries
    if limit is not None:  # a tie among the top k, or across the LIMIT, makes the answer luck
        table, column, direction, k = limit
        values = [r[0] for r in conn.execute(f"SELECT {column} FROM {table} ORDER BY {column} {direction}")]
        if len(set(values[: k + 1])) < min(k + 1, len(values)):
            return False
    return True


def _questions(db_id: str, path: Path) -> list[dict[str, Any]]:
    rng = random.Random(f"{SEED}-questions-{db_id}")
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        seen: set[str] = set()
        kept: list[dict[str, Any]] = []
        for question, sql, *limit in _candidates(db_id, conn, rng):
            if question in seen:
                continue
            seen.add(question)
            if _unambiguous(conn, sql, limit[0] if limit else None):
                kept.append({"db_id": db_id, "question": question, "gold_sql": sql})
    rng.shuffle(kept)
    return kept[:QUESTIONS_PER_DB]


def load_tasks(
    split: str = "train", data_dir: str | os.PathLike[str] | None = None, *, limit: int | None = None
) -> list[dict[str, Any]]:
    """Tasks of ``split`` (``train``: the six training databases, ``test``: the two held-out ones),
    each ``{"id", "db_id", "question", "gold_sql"}``; ``limit`` takes an even slice
    across databases (the first ``limit`` of a fixed interleaving)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    dbs: Sequence[str] = TRAIN_DBS if split == "train" else TEST_DBS
    per_db = [_questions(db_id, db_path(db_id, data_dir)) for db_id in dbs]
    tasks: list[dict[str, Any]] = []
    for i in range(max(len(q) for q in per_db)):  # interleave, so a prefix covers every database
        for questions in per_db:
            if i < len(questions):
                tasks.append({"id": f"{questions[i]['db_id']}-{i:03d}", **questions[i]})
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        tasks = tasks[:limit]
    return tasks


def summary(data_dir: str | os.PathLike[str] | None = None) -> str:
    lines = []
    for split in ("train", "test"):
        tasks = load_tasks(split, data_dir)
        by_db: dict[str, int] = {}
        for t in tasks:
            by_db[t["db_id"]] = by_db.get(t["db_id"], 0) + 1
        lines.append(f"{split}: {len(tasks)} questions — {json.dumps(by_db)}")
    return "\n".join(lines)
