"""``python -m agl.cli ...``: the ``agl`` command."""

from agl.cli import main

raise SystemExit(main())
