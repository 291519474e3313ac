"""``python -m examples.crew_agent dev|train|data`` (see cli.py and README.md)."""

from __future__ import annotations

from examples.crew_agent.cli import main

raise SystemExit(main())
