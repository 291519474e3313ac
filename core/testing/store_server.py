"""Test-only store server: one server process, a fresh empty store per test.

Starting ``agl store serve`` per test costs about half a second, so the store conformance suite runs
over HTTP against one process that serves extra, separate stores under ``/_test/stores/{ns}/...``.
These routes are deliberately *not* part of the production app (``agl.store.server.create_app``):
this module wraps that app with them, and only ``python -m agl.cli._test_store_server`` (what
:func:`shared_test_server` starts) serves the wrapped app.

- ``POST /_test/stores`` → ``{"namespace": "ns1", "prefix": "/_test/stores/ns1"}``: a fresh store,
  served by its own ``create_app`` instance under that prefix (the same routes, errors and auth);
- ``DELETE /_test/stores/{ns}`` closes it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agl.store.base import STORE_TOKEN_ENV
from agl.store.server import ServerProcess, create_app

__all__ = ["NamespacedStores", "TestStoreServer", "serve_test_store", "shared_test_server"]

PREFIX = "/_test/stores"


async def _json(send: Any, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class NamespacedStores:
    """ASGI app: ``app`` as it is, plus fresh stores under ``/_test/stores/{ns}`` made by ``factory``."""

    def __init__(self, app: Any, factory: Callable[[str], Any], *, token: str | None = None) -> None:
        self.app = app
        self.factory = factory
        self.token = token
        self._apps: dict[str, Any] = {}
        self._counter = 0

    def _authorised(self, scope: dict[str, Any]) -> bool:
        if not self.token:
            return True
        import hmac

        got = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(got, f"Bearer {self.token}".encode())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "lifespan" or not (path == PREFIX or path.startswith(PREFIX + "/")):
            if scope["type"] == "lifespan":
                await self._lifespan(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        if not self._authorised(scope):
            await _json(send, 401, {"error": {"code": "unauthorized", "message": "invalid bearer token"}})
            return
        rest = path[len(PREFIX) :].lstrip("/")
        ns, _, sub = rest.partition("/")
        method = scope["method"]
        if not ns:
            if method != "POST":
                await _json(send, 405, {"error": {"code": "method_not_allowed", "message": method}})
                return
            self._counter += 1
            name = f"ns{self._counter}"
            self._apps[name] = create_app(self.factory(name), token=self.token, close_store=True)
            await _json(send, 200, {"namespace": name, "prefix": f"{PREFIX}/{name}"})
            return
        app = self._apps.get(ns)
        if app is None:
            await _json(send, 404, {"error": {"code": "not_found", "message": f"no test store {ns!r}"}})
            return
        if not sub and method == "DELETE":
            self._close(self._apps.pop(ns))
            await _json(send, 200, {"deleted": True})
            return
        inner = "/" + sub
        await app({**scope, "path": inner, "raw_path": inner.encode()}, receive, send)

    @staticmethod
    def _close(app: Any) -> None:
        app.server.close()
        app.server.store.close()

    async def _lifespan(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def on_receive() -> Any:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                for app in self._apps.values():
                    self._close(app)
                self._apps.clear()
            return message

        await self.app(scope, on_receive, send)


def _pg_factory(url: str) -> Callable[[str], Any]:
    """A fresh schema per namespace in the database of ``url`` (cheaper than a database: no checkpoint)."""
    from agl.store import open as open_store

    def factory(ns: str) -> Any:
        import psycopg

        name = f"agl_{ns}_{os.getpid()}"
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
            conn.execute(f'CREATE SCHEMA "{name}"')
        return open_store(f"{url.split('?', 1)[0]}?options=-csearch_path%3D{name}")

    return factory


def _factory(db: Path) -> Callable[[str], Any]:
    from agl.store import open as open_store

    suffix = db.suffix or ".db"
    return lambda ns: open_store(f"sqlite:///{db.with_name(db.stem + '.' + ns + suffix)}")


def serve_test_store(db: str, *, host: str = "127.0.0.1", port: int = 0) -> None:
    """``agl store serve`` plus the test routes, over ``db`` (a SQLite path or a postgresql:// URL);
    prints the same ready line. ``python -m agl.cli._test_store_server`` runs it (the bearer token
    from ``$AGL_STORE_TOKEN``)."""
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    from agl.store import open as open_store
    from agl.store.server import serve

    token = os.environ.get(STORE_TOKEN_ENV) or None
    if db.startswith(("postgresql://", "postgres://")):  # --db may name a PostgreSQL database
        store, factory = open_store(db), _pg_factory(db)
    else:
        path = Path(db)
        store, factory = open_store(f"sqlite:///{path}"), _factory(path)
    from agl.dashboard.mount import ui_mounts

    serve(
        store,
        mounts=ui_mounts(store),  # as `agl store serve`
        host=host,
        port=port,
        token=token,
        wrap=lambda app: NamespacedStores(app, factory, token=token),
    )


class TestStoreServer(ServerProcess):
    """A :class:`ServerProcess` running this module: the production server plus the test routes."""

    __test__ = False  # not a pytest test class

    def command(self) -> list[str]:
        assert self.db is not None, "the test server serves a SQLite file or a postgresql:// URL (db=...)"
        port = self.port
        if self.url is not None and port == 0:
            port = int(self.url.rsplit(":", 1)[1])
        cmd = [sys.executable, "-m", "agl.cli._test_store_server", "--db", os.fspath(self.db)]
        return [*cmd, "--host", self.host, "--port", str(port), *self.args]

    def new_namespace(self) -> str:
        """URL of a fresh, empty store on this server."""
        status, body = self.request("POST", PREFIX, b"")
        if status != 200:
            raise RuntimeError(f"server refused a test namespace ({status}): {body[:300]!r}")
        return f"{self.url}{json.loads(body)['prefix']}"

    def drop_namespace(self, url: str) -> None:
        assert self.url is not None
        self.request("DELETE", url[len(self.url) :])


_shared: dict[str, TestStoreServer] = {}  # the one server of this test process (tests only)


def shared_test_server() -> TestStoreServer:
    """One test server process per test process, over SQLite; stopped at exit."""
    server = _shared.get("server")
    if server is None or server.proc is None or server.proc.poll() is not None:
        import atexit
        import shutil
        import tempfile

        tmp = tempfile.mkdtemp(prefix="agl-store-test-")
        server = TestStoreServer(os.path.join(tmp, "store.db"), log_path=os.path.join(tmp, "server.log"))
        server.start()

        def cleanup(server: TestStoreServer = server) -> None:
            server.stop()
            shutil.rmtree(tmp, ignore_errors=True)

        atexit.register(cleanup)
        _shared["server"] = server
    return server
