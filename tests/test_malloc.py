"""agl.trainer.malloc: Trainer.fit's glibc settings (a 2 MB block is mmapped, so freeing it returns it to the
OS) and the ways a user keeps glibc's defaults. Each case runs in a fresh interpreter: malloc settings
are process-wide and cannot be undone."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# After a 16 MB block is freed glibc's dynamic threshold is 16 MB, so a 2 MB block comes from the heap;
# once tuned, it is mmapped (mallinfo2().hblks counts mmapped blocks).
_PROBE = """
import ctypes, sys
from agl.trainer import malloc
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split())]
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = Info
libc.free(libc.malloc(16 << 20))
tuned = malloc.tune()
before = libc.mallinfo2().hblks
block = libc.malloc(2 << 20)
mapped = libc.mallinfo2().hblks - before
libc.free(block)
malloc.trim()
print(tuned, mapped)
"""


def _probe(**env: str) -> tuple[str, str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_")}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    tuned, mapped = out.stdout.split()
    return tuned, mapped


def test_tune_maps_large_blocks_so_freed_activations_leave_the_process() -> None:
    assert _probe() == ("True", "1")


@pytest.mark.parametrize(
    "env",
    [{"AGL_MALLOC_TUNE": "0"}, {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_ARENA_MAX": "4"}],
    ids=["opt-out", "user-settings"],
)
def test_tune_leaves_glibc_alone_when_told_or_already_set(env: dict[str, str]) -> None:
    assert _probe(**env) == ("False", "0")
