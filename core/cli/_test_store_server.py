"""``python -m agl.cli._test_store_server --db PATH [--host H] [--port N]``: the test store server
(:func:`agl.testing.store_server.serve_test_store`) as a process, for :class:`TestStoreServer`."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    from agl.testing.store_server import serve_test_store

    parser = argparse.ArgumentParser(prog="python -m agl.cli._test_store_server")
    parser.add_argument("--db", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    serve_test_store(args.db, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
