"""The ``/ui`` mount of ``agl store serve``: the dashboard app, built on the first request.

The store server's start-up time matters (runners wait for it), and most servers are never looked
at in a browser; so the dashboard (and the adapter it imports) loads only when ``/ui`` is opened.
The server's bearer-token guard covers ``/ui/api/``; the page and its static files load without a
token (they hold no data) and ask for one when the API answers 401.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["TOKENIZER_ENV", "UI_PREFIX", "LazyUI", "is_public_ui_path", "ui_mounts"]

UI_PREFIX = "/ui"
#: which tokenizer ``/ui`` decodes token ids with: "default" (the shipped SmolLM2), a local HF
#: directory, or "none" (show ids)
TOKENIZER_ENV = "AGL_DASHBOARD_TOKENIZER"


def is_public_ui_path(path: str) -> bool:
    """The page and static files under ``/ui`` (no data; no token needed). ``/ui/api/...`` is not."""
    return (path == UI_PREFIX or path.startswith(UI_PREFIX + "/")) and not path.startswith(
        UI_PREFIX + "/api/"
    )


def _tokenizer() -> Any:
    spec = os.environ.get(TOKENIZER_ENV, "default")
    if spec in ("", "none"):
        return None
    try:
        from agl.chat.tokenizer import load_tokenizer

        return load_tokenizer(spec, strict=True)
    except Exception as exc:  # noqa: BLE001 - the page still works, with ids instead of text
        log.warning("agl dashboard: cannot load tokenizer %r (%s); showing token ids", spec, exc)
        return None


class LazyUI:
    """ASGI app serving the dashboard over ``store`` (mounted at ``/ui``; the router sends ``/ui`` to ``/ui/``)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._app: Any = None
        self._lock = threading.Lock()

    def _build(self) -> Any:
        with self._lock:
            if self._app is None:
                from agl.dashboard.app import create_dashboard_app

                self._app = create_dashboard_app(
                    self.store, store_label="this store server", tokenizer=_tokenizer()
                )
        return self._app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        app = self._app or self._build()
        await app(scope, receive, send)

    @staticmethod
    def is_public(path: str) -> bool:
        """Whether ``path`` (within the mount) is the page or a static file: no data, no token needed."""
        return is_public_ui_path(UI_PREFIX + path)

    def close(self) -> None:
        if self._app is not None:
            self._app.state.dashboard.close()


def ui_mounts(store: Any) -> dict[str, Any]:
    """The store server's ``mounts=`` for the dashboard over ``store`` at ``/ui`` (``agl store serve``)."""
    return {UI_PREFIX: LazyUI(store)}
