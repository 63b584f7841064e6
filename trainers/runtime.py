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

:func:`enable_compilation_cache` points JAX's persistent compilation cache at a folder, so that a
second process skips compiling what an earlier one compiled (warm starts).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

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


def enable_compilation_cache(
    path: str | os.PathLike | None, *, min_compile_time_s: float = 0.0
) -> str | None:
    """Points JAX's persistent compilation cache at the folder ``path``, or turns it off (None).

    A second process that compiles the same step (same model, shapes, jax/jaxlib and flags) loads
    the executable from the folder instead of compiling it again. JAX keeps an entry only when
    compiling it took at least ``jax_persistent_cache_min_compile_time_secs`` (default 1 s):
    on CPU most of a run's compilations take 10-300 ms each (the step, the evaluation, flax's
    eager initialisation ops), so ``min_compile_time_s`` defaults to 0 (keep every entry; the
    folder stays around a megabyte per model).

    The folder is created readable and writable by its owner only: JAX trusts what it loads
    from it (an executable written there runs in this process).

    Takes effect for compilations after the call (JAX opens the cache on the first one); calling
    it again with another folder or None switches or closes it (``reset_cache``). Returns the
    folder in use, or None.
    """
    current = jax.config.jax_compilation_cache_dir
    if path is None:
        if current is not None:
            jax.config.update("jax_compilation_cache_dir", None)
            compilation_cache.reset_cache()
        return None
    folder = Path(path).expanduser().absolute()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    if current != str(folder):
        jax.config.update("jax_compilation_cache_dir", str(folder))
        compilation_cache.reset_cache()
    return str(folder)
