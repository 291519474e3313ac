"""The agl dashboard: runs, rollouts, span trees and what each token was trained on, in a browser.

``agl dashboard --store URL [--run-dir DIR]`` serves it on its own; ``agl store serve`` serves the same
UI under ``/ui``. See docs/architecture.md ("Dashboard"). Names are imported on first use, so the
store server pays nothing for the ``/ui`` mount until someone opens it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Dashboard", "LazyUI", "create_dashboard_app", "static_dir"]


def __getattr__(name: str) -> Any:
    if name in ("Dashboard", "create_dashboard_app", "static_dir"):
        from agl.dashboard import app

        return getattr(app, name)
    if name == "LazyUI":
        from agl.dashboard.mount import LazyUI

        return LazyUI
    raise AttributeError(f"module 'agl.dashboard' has no attribute {name!r}")
