"""Arithmetic word problems in the spirit of Calc-X, generated deterministically from templates.

Calc-X cannot be downloaded here, so this builds problems of the same kind: a short story with
numbers, one to three operations, one numeric answer. Each template draws its numbers from a seeded
RNG and also writes the arithmetic expression that solves the problem; the gold answer is that
expression evaluated exactly (``fractions.Fraction``), never typed by hand. Numbers are drawn so the
answer is a whole number or a short decimal (prices, percentages), which "exact numeric correctness"
can compare without tolerance.

``train`` and ``test`` are disjoint: different random draws, no question text in both.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from fractions import Fraction
from typing import Any

__all__ = ["TEMPLATES", "answer_text", "evaluate", "load_tasks"]

SEED = 7_001
TRAIN_SIZE = 320
TEST_SIZE = 100

_NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jon", "Kemi", "Luca")
_ITEMS = ("apples", "stickers", "marbles", "pencils", "cookies", "stamps", "shells", "cards")


def evaluate(expression: str) -> Fraction:
    """The exact value of a template's expression (digits, + - * / and parentheses only)."""
    import ast

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return Fraction(str(node.value))
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            ops: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
                ast.Add: lambda x, y: x + y,
                ast.Sub: lambda x, y: x - y,
                ast.Mult: lambda x, y: x * y,
                ast.Div: lambda x, y: x / y,
            }
            return ops[type(node.op)](a, b)
        raise ValueError(f"unexpected expression node {ast.dump(node)}")

    return ev(ast.parse(expression, mode="eval").body)


def answer_text(value: Fraction) -> str:
    """A gold answer as people write it: ``12``, ``7.5``, ``0.25``."""
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.10f}".rstrip("0").rstrip(".")
    if Fraction(text) != value:
        raise ValueError(f"{value} has no short decimal form")
    return text


# Each template: rng -> (question, expression). Numbers are chosen so every division is exact
# and every money answer has at most two decimals.


def _add(r: random.Random) -> tuple[str, str]:
    n, it, a, b = r.choice(_NAMES), r.choice(_ITEMS), r.randint(3, 60), r.randint(2, 45)
    return f"{n} has {a} {it} and gets {b} more. How many {it} does {n} have now?", f"{a} + {b}"


def _sub(r: random.Random) -> tuple[str, str]:
    n, m, it = *r.sample(_NAMES, 2), r.choice(_ITEMS)
    a = r.randint(20, 90)
    b = r.randint(2, a - 1)
    return f"{n} had {a} {it} and gave {b} of them to {m}. How many {it} does {n} have left?", f"{a} - {b}"


def _mul(r: random.Random) -> tuple[str, str]:
    it, a, b = r.choice(_ITEMS), r.randint(3, 25), r.randint(2, 12)
    return f"A box holds {a} {it}. How many {it} are there in {b} boxes?", f"{a} * {b}"


def _div(r: random.Random) -> tuple[str, str]:
    n, it, each, k = r.choice(_NAMES), r.choice(_ITEMS), r.randint(2, 20), r.randint(2, 9)
    total = each * k
    return (
        f"{n} shares {total} {it} equally among {k} friends. How many {it} does each friend get?",
        f"{total} / {k}",
    )


def _packs(r: random.Random) -> tuple[str, str]:
    n, it = r.choice(_NAMES), r.choice(_ITEMS)
    packs, per = r.randint(2, 9), r.randint(3, 15)
    used = r.randint(1, packs * per - 1)
    return (
        f"{n} buys {packs} packs of {per} {it} and uses {used} of them. How many {it} are left?",
        f"{packs} * {per} - {used}",
    )


def _price(r: random.Random) -> tuple[str, str]:
    it, cents, k = r.choice(("notebook", "sandwich", "ticket", "mug")), r.randint(105, 1995), r.randint(2, 9)
    price = f"{cents // 100}.{cents % 100:02d}"
    return f"One {it} costs ${price}. How many dollars do {k} of them cost?", f"{price} * {k}"


def _change(r: random.Random) -> tuple[str, str]:
    n = r.choice(_NAMES)
    cents, k = r.randint(150, 900), r.randint(2, 4)
    paid = ((cents * k) // 1000 + 1) * 10
    price = f"{cents // 100}.{cents % 100:02d}"
    return (
        f"{n} buys {k} books at ${price} each and pays with ${paid}. How many dollars of change does {n} get?",
        f"{paid} - {k} * {price}",
    )


def _discount(r: random.Random) -> tuple[str, str]:
    it, price, pct = (
        r.choice(("jacket", "lamp", "bicycle", "game")),
        r.randint(12, 240),
        r.choice((10, 20, 25, 30, 50)),
    )
    return (
        f"A {it} costs ${price}. It is on sale for {pct}% off. What is the sale price in dollars?",
        f"{price} * (100 - {pct}) / 100",
    )


def _average(r: random.Random) -> tuple[str, str]:
    n = r.choice(_NAMES)
    a, b = r.randint(50, 100), r.randint(50, 100)
    c = r.randint(50, 100)
    while (a + b + c) % 3:
        c = c + 1 if c < 100 else 50
    return f"{n} scored {a}, {b} and {c} on three tests. What is the average score?", f"({a} + {b} + {c}) / 3"


def _distance(r: random.Random) -> tuple[str, str]:
    v, t = r.randint(30, 110), r.randint(2, 8)
    return (
        f"A train travels at {v} km per hour for {t} hours. How many kilometres does it travel?",
        f"{v} * {t}",
    )


def _chairs(r: random.Random) -> tuple[str, str]:
    rows, per = r.randint(4, 15), r.randint(5, 20)
    broken, added = r.randint(1, rows * per // 2), r.randint(1, 30)
    return (
        f"A hall has {rows} rows of {per} chairs. {broken} chairs are broken and removed, then {added} new "
        f"chairs are added. How many chairs are in the hall now?",
        f"{rows} * {per} - {broken} + {added}",
    )


def _fraction(r: random.Random) -> tuple[str, str]:
    n, it, k = r.choice(_NAMES), r.choice(_ITEMS), r.choice((2, 3, 4, 5))
    total = k * r.randint(3, 20)
    word = {2: "half", 3: "a third", 4: "a quarter", 5: "a fifth"}[k]
    return (
        f"{n} has {total} {it} and gives away {word} of them. How many {it} does {n} keep?",
        f"{total} - {total} / {k}",
    )


def _savings(r: random.Random) -> tuple[str, str]:
    n, weekly, weeks, spent = r.choice(_NAMES), r.randint(5, 40), r.randint(3, 12), r.randint(5, 60)
    return (
        f"{n} saves ${weekly} every week for {weeks} weeks, then spends ${spent} on a gift. How many "
        f"dollars does {n} have left?",
        f"{weekly} * {weeks} - {spent}",
    )


TEMPLATES: tuple[Callable[[random.Random], tuple[str, str]], ...] = (
    _add, _sub, _mul, _div, _packs, _price, _change, _discount, _average, _distance, _chairs, _fraction, _savings,
)  # fmt: skip


def _generate(n: int, rng: random.Random, seen: set[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    while len(out) < n:
        template = TEMPLATES[len(out) % len(TEMPLATES)]
        question, expression = template(rng)
        if question in seen:
            continue
        value = evaluate(expression)
        if value < 0:
            continue  # every story asks for an amount that exists
        seen.add(question)
        out.append(
            {
                "question": question,
                "expression": expression,
                "answer": answer_text(value),
                "kind": template.__name__[1:],
            }
        )
    return out


def load_tasks(split: str = "train", *, limit: int | None = None) -> list[dict[str, Any]]:
    """Problems of ``split`` (``train``: 320, ``test``: 100), each ``{"id", "question", "expression",
    "answer", "kind"}``; ``limit`` takes the first ones (every template appears in turn)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(SEED)
    seen: set[str] = set()
    test = _generate(TEST_SIZE, rng, seen)  # drawn first, so train never repeats a test question
    tasks = test if split == "test" else _generate(TRAIN_SIZE, rng, seen)
    tasks = [{"id": f"{split}-{i:03d}", **t} for i, t in enumerate(tasks)]
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        tasks = tasks[:limit]
    return tasks
