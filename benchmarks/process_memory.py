"""Peak resident memory of a server and its child processes, read from Linux's /proc.

VmHWM is a process's own peak RSS (anonymous memory and mapped file pages alike, so an mmapped
GGUF counts as far as it was read). Each process's peak is summed: the processes need not peak
at the same moment, so the sum bounds the tree's peak from above (the servers measured here run
as one process, where it is exact). Writing 5 to /proc/PID/clear_refs (Linux 4.0+) resets VmHWM
to the current RSS, so a pass's peak can be read apart from start-up's.
"""
from __future__ import annotations

import os


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants now alive."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone since listdir
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
        children.setdefault(parent, []).append(int(entry))
    tree, pending = [], [pid]
    while pending:
        tree.append(pending.pop())
        pending += children.get(tree[-1], [])
    return tree


def peak_rss_mib(pid: int) -> float:
    """The sum of VmHWM over `pid`'s process tree, in MiB."""
    total_kib = 0
    for member in process_tree(pid):
        try:
            with open(f"/proc/{member}/status") as f:
                total_kib += next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        except (OSError, StopIteration):  # exited, or a kernel thread without VmHWM
            continue
    return round(total_kib / 1024, 1)


def reset_peak_rss(pid: int) -> None:
    """Sets VmHWM of `pid`'s process tree back to its current RSS."""
    for member in process_tree(pid):
        try:
            with open(f"/proc/{member}/clear_refs", "w") as f:
                f.write("5")
        except FileNotFoundError:  # exited
            continue
