"""Moved to :mod:`agl.algorithms.apo.text`; this name stays an alias of it so existing imports work."""

from __future__ import annotations

import sys

from agl.algorithms.apo import text

sys.modules[__name__] = text
