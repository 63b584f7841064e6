"""Process-level runtime settings that the compiled DP-SGD step measurably depends on.

glibc serves allocations above a *dynamic* mmap threshold (128 KiB at start, at most 32 MiB) with
fresh mmap'd pages and returns them to the OS on free. XLA:CPU allocates one temporary buffer per
execution for all of a step's intermediates (im2col patches, per-example gradients: tens of MB at
batch 256), so each step page-faulted that buffer in again. On this project's CPU machines that made
the book-keeping DP-SGD step 1.5-1.7x slower (33-45 ms instead of 24-29 ms per step at batch 256),
depending on which allocations happened earlier in the process. Disabling mmap for malloc
(M_MMAP_MAX = 0: large blocks come from the heap) and not trimming the heap keeps the pages mapped
between steps; memory use is unchanged in steady state (the same blocks are reused).

Opt out with the environment variable ``DPTUNE_NO_MALLOC_TUNING=1``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1  # glibc <malloc.h> parameter numbers
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 1024 * 1024 * 1024

_done: bool | None = None


def tune_malloc() -> bool:
    """Applies the glibc settings above once per process; returns whether they are in effect."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("DPTUNE_NO_MALLOC_TUNING"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_MAX, 0) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok
    _done = ok
    return ok
