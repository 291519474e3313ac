"""``trainer_state.json``: where a run resumes from, read and written here only.

The file names the last checkpoint (``checkpoint``: the policy's folder), the update step it holds, the
task order's state, the next step to run and whatever the schedule adds (the asynchronous schedule's
consumed groups and weight versions). It is written atomically (a temporary file, then ``os.replace``)
after the checkpoint's folder is complete, so a run killed at any instant leaves either the previous
state or the new one, never a torn file naming a half-written checkpoint. Resume (``resume=True``), the
gate's rollback and the tests read it through :func:`read_state`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["STATE_FILE", "read_state", "write_state"]

#: the file's name in the run directory
STATE_FILE = "trainer_state.json"


def read_state(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run's last saved state, or None when no checkpoint was written yet."""
    path = Path(run_dir) / STATE_FILE
    if not path.exists():
        return None
    return json.loads(path.read_text())


def write_state(run_dir: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Replace the run's state with ``state`` atomically."""
    path = Path(run_dir) / STATE_FILE
    tmp = path.with_name(STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)
