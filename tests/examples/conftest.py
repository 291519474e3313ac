"""The examples are run as ``python -m examples.<name>`` from the repository root: make that root
importable here too, whatever directory pytest was started from."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
