"""Keep freed host memory in the process for reuse (glibc malloc settings, CPU engines only).

glibc serves every allocation above its mmap threshold (128 KiB, raised as chunks are freed, to
at most 32 MiB) with fresh pages from mmap and unmaps them on free, and it returns free memory at
the heap's top to the kernel above 128 KiB. A model step allocates the same large activations
again and again, so each step page-faults them back in, and in a VM a fault is expensive: on the
2-core Zen 5 (forced AVX2), 8 Qwen2-VL `bench` requests in one batch ran at 1.34 req/s, of which
the vision tower's element-wise ops (mul, sigmoid, add over 3,168 patch rows x 5,120) took 760 ms
of 6.0 s; with mmap off and trimming above 2 GiB only, 1.88 req/s and those ops 40 ms.

The cost: the process keeps the heap of its largest step (RSS does not fall after a big prefill),
as a server that preallocates its KV cache expects. VLM_ENGINE_KEEP_FREED_MEMORY=0 leaves glibc's
defaults. Threads other than the engine's (it steps on the process's main thread) allocate from
per-thread arenas, whose heaps glibc maps and shrinks on its own terms.

`release_freed_memory` is the other direction, for a side process between bursts of work: a
preprocess worker's image buffers stay in its heap after each request (~0.1 GiB after four 640x480
photos for SmolVLM2) until glibc's malloc_trim hands the free pages back.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

ENV = "VLM_ENGINE_KEEP_FREED_MEMORY"
_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_MAX = -4
_TRIM_ABOVE = 2**31 - 1  # mallopt takes a C int: trim only when more than 2 GiB are free at the top

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True where they are in effect (glibc, not opted out)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(ENV, "1") == "0":
        logger.info("host memory: glibc malloc defaults kept (%s=0)", ENV)
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_ABOVE) == 1
    logger.info("host memory: freed memory kept for reuse (glibc mmap off, trim above 2 GiB): %s", _applied)
    return _applied


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the kernel now (glibc's malloc_trim(0): ~8 ms after a
    SmolVLM2 image, so call it when idle, not per request). False where there is no glibc."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


@functools.cache
def _glibc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):  # not glibc
        return None
    return libc
