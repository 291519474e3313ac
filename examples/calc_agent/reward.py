"""The reward: exact numeric correctness of the agent's final answer (1.0 or 0.0).

The answer is the number after the last ``ANSWER:`` in the agent's final message, else the last
number in it. It is compared with the gold answer exactly, as fractions: ``14.4``, ``14.40`` and
``$14.40`` are one answer; ``14.39`` and ``14`` are wrong. Thousands separators are allowed
(``1,200``). The malformed-tool-call penalty is not part of this reward: AIR reads it off the trace.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

__all__ = ["exact_match", "final_text", "parse_answer"]

_NUMBER = r"-?\$?\s?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+"
_ANSWER = re.compile(r"ANSWER\s*[:=]\s*(" + _NUMBER + ")", re.I)
_ANY = re.compile(_NUMBER)


def parse_answer(text: str) -> Fraction | None:
    """The numeric answer in ``text``, or None when there is none."""
    text = text or ""
    found = _ANSWER.findall(text) or _ANY.findall(text)
    if not found:
        return None
    raw = found[-1].replace("$", "").replace(",", "").replace(" ", "")
    if raw.startswith("-."):
        raw = "-0" + raw[1:]
    elif raw.startswith("."):
        raw = "0" + raw
    try:
        return Fraction(raw)
    except (ValueError, ZeroDivisionError):
        return None


def exact_match(text: str, gold: str) -> float:
    """1.0 when the answer in ``text`` equals ``gold`` exactly, else 0.0."""
    got = parse_answer(text)
    return 1.0 if got is not None and got == Fraction(gold) else 0.0


def final_text(messages: Sequence[Any]) -> str:
    """The text of the last message of an AutoGen ``TaskResult`` that has text (the agent's answer)."""
    for message in reversed(messages):
        content = getattr(message, "content", None)
        if isinstance(content, str) and getattr(message, "source", "user") != "user":
            return content
    return ""
