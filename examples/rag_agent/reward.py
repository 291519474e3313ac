"""The reward: answer F1, plus a format bonus that only a right (or partly right) answer earns.

``reward = FORMAT_WEIGHT · format · [F1 > 0] + (1 − FORMAT_WEIGHT) · F1``, in [0, 1]:

- ``F1`` is SQuAD's token-level F1 (lower-cased, punctuation and articles dropped) between the
  answer and the gold answer. The answer is the text inside the last ``<answer>`` block, or, with
  no block, the whole output — so a right answer in the wrong format still earns partial credit,
  diluted by whatever else the output says;
- ``format`` is 1.0 when the final output holds exactly one non-empty ``<answer>…</answer>`` block,
  else 0.0 — the agent is told to answer that way. It counts **only when the answer overlaps the
  gold one** (F1 > 0). The original scenario paid it unconditionally, and LightningRL found the
  shortcut on this CPU: after the warm start, two seeds learned to skip ``search`` and reply
  ``<answer>any name</answer>`` at once, a sure 0.2 (held-out 0.267 → 0.200 / 0.133, see README).
  A format score that pays without solving the task is a shaping reward to game, not a goal.
"""

from __future__ import annotations

import re
import string
from collections import Counter

__all__ = ["FORMAT_WEIGHT", "answer_f1", "extract_answer", "format_score", "normalize", "reward"]

FORMAT_WEIGHT = 0.2

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = _ARTICLES.sub(" ", (text or "").lower().translate(_PUNCT))
    return " ".join(text.split())


def format_score(output: str) -> float:
    blocks = _ANSWER.findall(output or "")
    return 1.0 if len(blocks) == 1 and blocks[0].strip() else 0.0


def extract_answer(output: str) -> str:
    blocks = _ANSWER.findall(output or "")
    return blocks[-1].strip() if blocks else (output or "").strip()


def answer_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize(prediction).split(), normalize(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def reward(output: str | None, gold: str) -> float:
    """The rollout's reward for the agent's final ``output`` (None: the run produced none)."""
    if output is None:
        return 0.0
    f1 = answer_f1(extract_answer(output), gold)
    return (FORMAT_WEIGHT * format_score(output) if f1 > 0 else 0.0) + (1 - FORMAT_WEIGHT) * f1
