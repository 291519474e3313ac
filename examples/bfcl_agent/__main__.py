"""``python -m examples.bfcl_agent dev|train|data|eval`` (see cli.py and README.md)."""

from __future__ import annotations

from examples.bfcl_agent.cli import main

raise SystemExit(main())
