"""Runs the Store conformance suite (``conformance.py``) against every factory in ``conftest.py``."""

from __future__ import annotations

from conformance import *  # noqa: F401,F403
