"""malloc tuning: with it, a big block freed and allocated again stays mapped (no page faults);
without it (XLASERVE_MALLOC_TUNING=0), glibc unmaps it and every reuse faults it in again."""
import os
import subprocess
import sys

import pytest

from xlaserve.runtime.host import malloc_tuning


# 64 MiB malloc'ed, written, freed, five times over; prints the page faults of the last four.
SCRIPT = """
import ctypes, resource
from xlaserve.runtime.host import malloc_tuning
print(malloc_tuning.limit_arenas(), malloc_tuning.keep_freed_memory())
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 20
def cycle():
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
cycle()
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    cycle()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
"""


def run(tuning: str) -> tuple[str, int]:
    env = {**os.environ, "XLASERVE_MALLOC_TUNING": tuning}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    applied, faults = result.stdout.split("\n")[:2]
    return applied, int(faults)


@pytest.mark.skipif(malloc_tuning._libc() is None, reason="needs Linux with glibc")
def test_freed_blocks_stay_mapped_with_tuning_and_fault_again_without():
    applied, faults = run("1")
    assert applied == "True True"
    assert faults < 50  # the heap's block is reused: no page is faulted in again
    applied, faults = run("0")
    assert applied == "False False"
    assert faults >= 4 * 32  # unmapped on free: at least one fault per 2 MiB, per cycle
