"""``python -m examples.calc_agent dev|train|data`` (see cli.py and README.md)."""

from __future__ import annotations

from examples.calc_agent.cli import main

raise SystemExit(main())
