"""glibc malloc settings for a training process on a CPU (what ``Trainer.fit`` applies).

A CPU update allocates and frees many tensors of 1-30 MB (a micro-batch's hidden states, MLP
activations, their gradients, the recomputed layers under checkpointing). glibc serves those below
its *dynamic* mmap threshold (which climbs to 32 MB after the first large free) from its heaps, which
fragment and are never given back, so the process holds about twice its live tensors at peak. Each
thread that allocates (the gateway's generation thread, the runners, the update) may also get an arena
of its own, each fragmenting separately.

:func:`tune` fixes the mmap threshold at 1 MB (a larger block is mapped on allocation and unmapped on
free, so freed activations leave the process) and caps the arenas at 2. Cost: page faults on every
large allocation, several times the update's system time, which the 2x smaller peak pays for on a
small machine; opt out as below. Figures: bench/README.md, "CPU demo peak memory".
:func:`trim` returns the heaps' free pages after a step.

Both are no-ops off glibc, and :func:`tune` leaves alone what the user set: ``MALLOC_ARENA_MAX`` /
``MALLOC_MMAP_THRESHOLD_`` in the environment (glibc reads them at start), or ``AGL_MALLOC_TUNE=0``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from functools import cache

__all__ = ["ARENA_MAX", "MMAP_THRESHOLD", "trim", "tune"]

log = logging.getLogger(__name__)

#: blocks at least this large are mmapped (and so returned to the OS when freed)
MMAP_THRESHOLD = 1 << 20
#: malloc arenas at most (glibc's default is 8 per core)
ARENA_MAX = 2

# mallopt parameters (glibc's malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


@cache
def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:  # pragma: no cover - a glibc system always has it
        return None


def tune() -> bool:
    """Apply :data:`MMAP_THRESHOLD` and :data:`ARENA_MAX` to this process (see the module docstring);
    returns whether anything was set. Safe to call more than once."""
    libc = _libc()
    if libc is None or os.environ.get("AGL_MALLOC_TUNE", "1").strip().lower() in ("0", "false", "no"):
        return False
    done = False
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        done |= bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if "MALLOC_ARENA_MAX" not in os.environ:
        done |= bool(libc.mallopt(_M_ARENA_MAX, ARENA_MAX))
    if done:
        log.debug("agl: glibc malloc tuned (mmap threshold %d, arenas <= %d)", MMAP_THRESHOLD, ARENA_MAX)
    return done


def trim() -> None:
    """Give the heaps' free pages back to the OS (``malloc_trim``); a no-op off glibc."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
