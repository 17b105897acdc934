"""Backs the weights with 2 MiB pages on a Linux CPU.

A decode step of a few rows reads every weight once from memory. Over 4 KiB pages, each page
costs a TLB miss, and the hardware prefetcher stops at each page boundary. Measured on a 2-core
AMD EPYC, with both in the same runs:
- the default model's 1-row layer matmuls (packed GEMM, 30 layers) ran at 20.0-21.2 GB/s on
  4 KiB pages and 21.2-24.2 GB/s on huge pages;
- the whole 1-token step was 0-8% faster (median 3%, four runs).

Advice never changes the data, so this is best effort:
- THP set to `never` turns it off.
- MADV_COLLAPSE (Linux 6.1+) moves the range onto huge pages, on a background thread at the
  lowest priority: it took 1.2 s for the default model's 0.49 GB, which start-up waited for. In
  the background it slows the precompile that follows by ~0.9 s (2 cores), so start-up gained
  0.4 s (median of 5 warm starts, 10.9 -> 10.5 s); at normal priority it gained nothing. On older
  kernels, MADV_HUGEPAGE leaves the move to khugepaged, over time.
Only the 2 MiB-aligned inside of each buffer is advised, so no other allocation is touched.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_allowed() -> bool:
    try:
        return "[never]" not in _THP_SETTING.read_text()
    except OSError:
        return False


def aligned_inside(address: int, nbytes: int) -> tuple[int, int]:
    """The largest [start, end) of whole huge pages inside [address, address + nbytes)."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return start, max(start, end)


def advise_huge_pages(arrays) -> int:
    """Asks the kernel to back the single-device CPU arrays among `arrays` with huge pages;
    returns how many bytes it was asked for."""
    if sys.platform != "linux" or not _thp_allowed():
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ranges = []
    for array in arrays:
        if not isinstance(array, jax.Array) or len(array.devices()) != 1 or (
                next(iter(array.devices())).platform != "cpu"):
            continue
        start, end = aligned_inside(array.unsafe_buffer_pointer(), array.nbytes)
        if end - start < HUGE_PAGE or libc.madvise(start, end - start, MADV_HUGEPAGE) != 0:
            continue
        ranges.append((start, end - start))
    if ranges:
        # Advice never changes the data: collapsing while steps read the weights is safe, and so
        # is advising a range freed (or reused) meanwhile.
        threading.Thread(target=_collapse, args=(libc, ranges), name="xlaserve-huge-pages",
                         daemon=True).start()
    return sum(size for _, size in ranges)


def _collapse(libc, ranges) -> None:
    with contextlib.suppress(OSError):  # nice 19: the CPU time the start-up leaves over
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    for start, size in ranges:
        libc.madvise(start, size, MADV_COLLAPSE)  # fails before 6.1: khugepaged does it
