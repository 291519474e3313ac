"""Judge verdicts cached in SQLite, keyed by everything a verdict depends on: the mode, the judge
model, the rubric, the task and the trajectories' rendered content (in order: a relative verdict
depends on the whole group). A re-run or a resumed run asks the judge nothing it has answered."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["JudgeCache", "cache_key"]


def cache_key(
    mode: str, model: str, rubric: str, task: str, texts: Sequence[str], reference: str | None
) -> str:
    blob = json.dumps([mode, model, rubric, task, list(texts), reference], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


class JudgeCache:
    """``key -> {"scores": [[score, reason], ...], "judge_rollout_id": ...}`` in one SQLite file."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False)
        self._db.execute("CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        self._db.commit()
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM verdicts WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        self.hits += 1
        return json.loads(row[0])

    def put(self, key: str, value: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO verdicts VALUES (?, ?)", (key, json.dumps(value)))
            self._db.commit()

    def close(self) -> None:
        with self._lock:
            self._db.close()
