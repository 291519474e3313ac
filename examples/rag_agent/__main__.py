"""``python -m examples.rag_agent dev|train|data`` (see cli.py and README.md)."""

from __future__ import annotations

from examples.rag_agent.cli import main

raise SystemExit(main())
