"""Stores hold tasks, rollouts, attempts, spans and resources (DESIGN §5).

``agl.store.open(url)`` picks the implementation from the URL:
``memory://``, ``sqlite:///path/to.db`` (the embedded default), ``postgresql://user@host/db`` (many
store servers and hosts on one database) or ``http://host:port``.
"""

from __future__ import annotations

from typing import Any

from agl.store.base import (
    FINISH_STATUSES,
    ConflictError,
    InvalidInputError,
    NotFoundError,
    Store,
    StoreError,
)

__all__ = [
    "FINISH_STATUSES",
    "ConflictError",
    "InvalidInputError",
    "NotFoundError",
    "Store",
    "StoreError",
    "open",
]


def open(url: str, **kwargs: Any) -> Store:  # noqa: A001 - mirrors the builtin on purpose
    """Open a store from a URL: ``memory://``, ``sqlite:///path.db``, ``postgresql://user@host/db`` or
    ``http(s)://host:port``."""
    if not isinstance(url, str) or "://" not in url:
        raise InvalidInputError(
            f"store URL {url!r} has no scheme; use memory://, sqlite:///path.db, postgresql://user@host/db "
            "or http://host:port"
        )
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme == "memory":
        from agl.store.memory import MemoryStore

        return MemoryStore(**kwargs)
    if scheme == "sqlite":
        from agl.store.sqlite import SQLiteStore

        path = rest[1:] if rest.startswith("/") else rest
        if not path:
            raise InvalidInputError(
                "sqlite URL needs a path: sqlite:///relative.db or sqlite:////abs/path.db"
            )
        return SQLiteStore(path, **kwargs)
    if scheme in ("postgresql", "postgres"):
        from agl.store.postgres import PostgresStore

        return PostgresStore(url, **kwargs)
    if scheme in ("http", "https"):
        from agl.store.http import HttpStore

        return HttpStore(url, **kwargs)
    raise InvalidInputError(
        f"unknown store URL scheme {scheme!r}; use memory://, sqlite:///path.db, postgresql:// or http://"
    )
