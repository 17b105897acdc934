"""Keeps the CPU step's buffers mapped between steps (Linux, glibc), so steps stop faulting them in.

XLA's CPU runtime allocates an execution's buffers when it starts and frees them when it ends:
for the default model's 128-row decode step, ~120 MB of temporaries, ~29 MB of them touched
(mostly the logits, 128 x 49152 floats). glibc serves blocks that big with mmap and unmaps them
on free, so every step faulted its buffers in again and the kernel zeroed every page: ~7200 page
faults per step, ~6% of a 128-row bfloat16 decode step on a 2-core Zen 4.

So, on Linux with glibc:
- `limit_arenas()`, before XLA starts its threads: one malloc arena. A thread's own arena would
  mmap big blocks whatever the settings, since its heaps cannot grow past 64 MB.
- `keep_freed_memory()`, once the engine has loaded and compiled (loading's own big temporaries
  are gone by then, unmapped as usual): no more mmap for big blocks, and no trimming of the
  heap's top, so a step's buffers come from the heap and stay mapped for the next step.
The process keeps its peak heap (a step's buffers), as servers on jemalloc or tcmalloc do.
`XLASERVE_MALLOC_TUNING=0` leaves malloc alone.

Measured on a 2-core Zen 4 (AVX512_BF16), the default model in bfloat16:
- a synthetic 128-row decode step: faults 7200 -> 200 per step, 123-134 ms -> 111-115 ms;
- the offline benchmark (256 prompts): see docs/performance.md.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8


def _libc():
    """glibc, when this process runs on it (musl and others have no mallopt), else None."""
    if not sys.platform.startswith("linux") or os.environ.get("XLASERVE_MALLOC_TUNING") == "0":
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only
        return libc
    except (OSError, AttributeError):
        return None


def limit_arenas() -> bool:
    """One malloc arena for every thread that has not allocated yet; True if set."""
    libc = _libc()
    return bool(libc and libc.mallopt(M_ARENA_MAX, 1))


def keep_freed_memory() -> bool:
    """Big blocks from the heap instead of mmap, and no trimming; True if set."""
    libc = _libc()
    if libc is None:
        return False
    done = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    if done:
        logger.debug("malloc: freed memory stays mapped (XLASERVE_MALLOC_TUNING=0 turns this off)")
    return done
