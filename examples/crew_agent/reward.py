"""The reward: coverage — the fraction of the facts the task asks for that the writer's text states.

A fact counts as stated when its gold value appears in the text as whole words, after both are
normalised the same way (lower case, punctuation as spaces, thousands separators dropped, so
``2,340`` states ``2340`` and ``Alma Novak's`` states ``Alma Novak``). Facts the task did not ask for
earn nothing, and a value that only appears inside a longer word or number (``198`` in ``1987``) does
not count. The reward is in [0, 1]: 1.0 when every asked-for fact is there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["coverage", "normalize", "stated"]

_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_NON_WORD = re.compile(r"[^\w]+")


def normalize(text: str) -> str:
    text = _THOUSANDS.sub("", (text or "").lower())
    return " ".join(_NON_WORD.sub(" ", text).replace("_", " ").split())


def stated(value: str, text: str) -> bool:
    """Whether ``value`` appears in ``text`` as whole words (both normalised)."""
    needle = normalize(value)
    if not needle:
        return False
    return re.search(rf"(?<!\w){re.escape(needle)}(?!\w)", normalize(text)) is not None


def coverage(text: str | None, gold: Mapping[str, str]) -> float:
    """The share of ``gold`` facts (fact name → value) stated in ``text``."""
    if not gold:
        raise ValueError("a task must ask for at least one fact")
    if not text:
        return 0.0
    return sum(1 for value in gold.values() if stated(value, text)) / len(gold)
