"""benchmarks/process_memory.py: the peak RSS bench_serving.py reports for a launched server, on
real processes that touch a known amount of memory."""
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import process_memory  # noqa: E402

MIB = 200
# Touches MIB MiB (bytearray zero-fills them), frees them (an mmap that large goes back to the
# system), says so, and waits for stdin to close.
TOUCH_AND_FREE = (f"import sys; b = bytearray({MIB} << 20); del b; print('freed', flush=True); "
                  "sys.stdin.read()")
HOLD = f"import sys; b = bytearray({MIB} << 20); print('held', flush=True); sys.stdin.read()"


def _start(code: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    process.stdout.readline()  # its allocation is done
    return process


def _stop(process: subprocess.Popen) -> None:
    process.stdin.close()
    process.wait(timeout=30)


def test_peak_rss_keeps_freed_memory_until_reset():
    process = _start(TOUCH_AND_FREE)
    try:
        assert process_memory.peak_rss_mib(process.pid) >= MIB
        process_memory.reset_peak_rss(process.pid)
        assert process_memory.peak_rss_mib(process.pid) < MIB / 2
    finally:
        _stop(process)


def test_peak_rss_sums_the_children_of_the_process():
    # a parent that starts HOLD as its child and waits on it
    parent = _start("import subprocess, sys; "
                    f"child = subprocess.Popen([sys.executable, '-c', {HOLD!r}], "
                    "stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True); "
                    "print(child.stdout.readline(), flush=True); sys.stdin.read(); "
                    "child.stdin.close(); child.wait()")
    try:
        tree = process_memory.process_tree(parent.pid)
        assert len(tree) == 2 and tree[0] == parent.pid
        assert process_memory.peak_rss_mib(parent.pid) >= MIB  # the parent alone holds ~10 MiB
    finally:
        _stop(parent)
