"""Nsight Compute's `--csv` output as a decode step's device time, kernel by kernel.

ncu prints one row per kernel launch per metric ("ID", ..., "Kernel Name", ..., "Metric Name",
"Metric Unit", "Metric Value"), after its own "==PROF==" lines and whatever the profiled
program printed. `read_launches` takes the launches back out of that; `summarize` sums them
per kernel name and per category, divided by the steps the window held; `format_summary`
prints the table. Plain Python (no JAX), so a CSV can be read anywhere.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import re

TIME_METRIC = "gpu__time_duration.sum"
DRAM_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
COLUMNS = ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")
# XLA's GEMM autotuning at compile time (buffer checks, timing delays, output comparisons):
# not the step's, though a window that overlaps a compile would catch them.
AUTOTUNING_MARKERS = ("Redzone", "DelayKernel", "xla_fp_comparison")
# The line profile_gpu_step.py prints before its window's kernels reach ncu's CSV.
WINDOW_MARKER = "profile_gpu_step window: "
UNIT_SCALE = {
    "ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3,
    "s": 1.0, "second": 1.0,
    "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
}
# First match wins: the attention kernel, then GEMMs (cuBLAS's sm90_xmma_gemm / nvjet /
# splitKreduce, CUTLASS, XLA's Triton GEMM fusions `gemm_fusion_dot_N` and other dot fusions),
# then scatters (the KV cache writes); the rest are XLA's elementwise and reduction fusions.
CATEGORIES = (
    ("attention", re.compile(r"attention", re.I)),
    ("gemm", re.compile(r"gemm|matmul|nvjet|cutlass|cublas|xmma|splitKreduce|(^|_)dot(_|\d|$)",
                        re.I)),
    ("scatter", re.compile(r"scatter|dynamic_update_slice", re.I)),
)
OTHER = "other fusions"


@dataclasses.dataclass(frozen=True)
class Launch:
    name: str
    seconds: float
    dram_bytes: float | None  # read + written; None where ncu did not collect both


@dataclasses.dataclass(frozen=True)
class KernelRow:
    name: str
    category: str
    launches: int
    seconds: float
    dram_bytes: float | None


def category(name: str) -> str:
    return next((label for label, pattern in CATEGORIES if pattern.search(name)), OTHER)


def is_autotuning(name: str) -> bool:
    return any(marker in name for marker in AUTOTUNING_MARKERS)


def short_name(name: str, width: int = 52) -> str:
    """A demangled C++ name without its return type, parameters and nested template arguments
    (`void cutlass::Kernel2<cutlass_80_..._gemm<(Style)2>>(Params)` ->
    `cutlass::Kernel2<cutlass_80_..._gemm>`: a GEMM's tile is in its outer template), cut to
    `width`."""
    kept, depth = [], 0
    for char in re.sub(r"^void\s+", "", name.replace("(anonymous namespace)", "anon")):
        if char == "(" and depth == 0:
            break
        depth += char == "<"
        if depth <= 1:
            kept.append(char)
        depth -= char == ">"
    name = "".join(kept).strip()
    return name if len(name) <= width else name[:width - 3] + "..."


def _value(text: str, unit: str, metric: str) -> float | None:
    """A metric value in base units (seconds, bytes); None for ncu's "n/a"."""
    if text.strip() in ("n/a", ""):
        return None
    if unit not in UNIT_SCALE:
        raise ValueError(f"unit {unit!r} of metric {metric} is not one this reads "
                         f"({', '.join(UNIT_SCALE)})")
    return float(text.replace(",", "")) * UNIT_SCALE[unit]


def _csv_rows(lines: list[str]) -> tuple[list[str], list[list[str]]]:
    """ncu's header and the rows after it that have its fields and a numeric ID (the profiled
    program's own printing, if it went to the same file, is skipped)."""
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID","Process ID"')), None)
    if start is None:
        raise ValueError('no ncu CSV header (a line starting "ID","Process ID"): ncu ran '
                         'without --csv, or profiled nothing (no window came)')
    header, *rows = csv.reader(lines[start:])
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise ValueError(f"ncu CSV without the column(s) {missing}")
    return header, [r for r in rows if len(r) == len(header) and r[0].strip().isdigit()]


def read_launches(text: str) -> list[Launch]:
    """Every kernel launch of ncu's CSV, in ID order, with its time and DRAM bytes."""
    header, rows = _csv_rows(text.splitlines())
    at = {column: header.index(column) for column in COLUMNS}
    names: dict[int, str] = {}
    metrics: dict[int, dict[str, float | None]] = {}
    for row in rows:
        launch = int(row[at["ID"]])
        names[launch] = row[at["Kernel Name"]]
        metric = row[at["Metric Name"]]
        if metric == TIME_METRIC or metric in DRAM_METRICS:
            metrics.setdefault(launch, {})[metric] = _value(
                row[at["Metric Value"]], row[at["Metric Unit"]], metric)
    launches = []
    for launch in sorted(names):
        values = metrics.get(launch, {})
        if values.get(TIME_METRIC) is None:
            raise ValueError(f"launch {launch} ({names[launch][:60]}) has no {TIME_METRIC}: "
                             f"run ncu with --metrics {TIME_METRIC},{','.join(DRAM_METRICS)}")
        dram = [values.get(m) for m in DRAM_METRICS]
        launches.append(Launch(names[launch], values[TIME_METRIC],
                               None if None in dram else sum(dram)))
    return launches


def window_info(text: str) -> dict | None:
    """What profile_gpu_step.py said of its window (steps, rows, floor), if its line is there."""
    for line in text.splitlines():
        if line.startswith(WINDOW_MARKER):
            return json.loads(line[len(WINDOW_MARKER):])
    return None


def summarize(launches: list[Launch]) -> tuple[list[KernelRow], int]:
    """Per kernel name, slowest first, over the launches but XLA's autotuning ones; and how
    many of those were skipped."""
    kept = [launch for launch in launches if not is_autotuning(launch.name)]
    by_name: dict[str, list[Launch]] = {}
    for launch in kept:
        by_name.setdefault(launch.name, []).append(launch)
    rows = []
    for name, group in by_name.items():
        dram = [launch.dram_bytes for launch in group]
        rows.append(KernelRow(name, category(name), len(group),
                              sum(launch.seconds for launch in group),
                              None if None in dram else sum(dram)))
    rows.sort(key=lambda row: -row.seconds)
    return rows, len(launches) - len(kept)


def category_totals(rows: list[KernelRow]) -> dict[str, tuple[int, float]]:
    """(launches, seconds) per category, in CATEGORIES order, then the other fusions."""
    totals = {label: (0, 0.0) for label, _ in CATEGORIES} | {OTHER: (0, 0.0)}
    for row in rows:
        launches, seconds = totals[row.category]
        totals[row.category] = (launches + row.launches, seconds + row.seconds)
    return totals


def _count(launches: int, steps: int) -> str:
    per_step = launches / steps
    return f"{per_step:.0f}" if per_step == int(per_step) else f"{per_step:.2f}"


def _kernel_lines(rows: list[KernelRow], steps: int, top: int, has_dram: bool) -> list[str]:
    """The `top` slowest kernels, a line each, then one for the rest."""
    total = sum(row.seconds for row in rows)
    lines = [f"{'kernel':<52} {'category':<13} {'n/step':>6} {'us/step':>9} {'share':>6}"
             + (f" {'MB/step':>9} {'GB/s':>6}" if has_dram else "")]
    for row in rows[:top]:
        line = (f"{short_name(row.name):<52} {row.category:<13} {_count(row.launches, steps):>6}"
                f" {row.seconds / steps * 1e6:>9.1f} {row.seconds / total:>6.1%}")
        if has_dram:
            gbps = row.dram_bytes / row.seconds / 1e9
            line += f" {row.dram_bytes / steps / 1e6:>9.2f} {gbps:>6.0f}"
        lines.append(line)
    if len(rows) > top:
        seconds = sum(row.seconds for row in rows[top:])
        lines.append(f"... {len(rows) - top} more kernels: {seconds / steps * 1e6:.1f} us/step "
                     f"({seconds / total:.1%})")
    return lines


def _total_lines(rows: list[KernelRow], steps: int, has_dram: bool, info: dict | None) -> list[str]:
    """Per category and in all, per step; the DRAM traffic; the roofline floor, if known."""
    total = sum(row.seconds for row in rows)
    lines = [f"{label:<16} {_count(launches, steps):>6} launches/step "
             f"{seconds / steps * 1e6:>10.1f} us/step {seconds / total:>6.1%}"
             for label, (launches, seconds) in category_totals(rows).items()]
    launches = sum(row.launches for row in rows)
    lines.append(f"{'sum':<16} {_count(launches, steps):>6} launches/step "
                 f"{total / steps * 1e6:>10.1f} us/step over {steps} step(s)")
    if has_dram:
        dram = sum(row.dram_bytes for row in rows)
        lines.append(f"DRAM {dram / steps / 1e9:.3f} GB/step, "
                     f"{dram / total / 1e9:.0f} GB/s over the kernels' time")
    if info and info.get("floor_ms"):
        lines.append(f"roofline floor {info['floor_ms']:.3f} ms/step ({info['rows']} rows, "
                     f"KV {info['kv_tokens_mean']:.0f} tokens a row): the kernels' sum is "
                     f"{total / steps * 1e3 / info['floor_ms']:.2f}x the floor")
    return lines


def format_summary(rows: list[KernelRow], steps: int, *, skipped: int = 0, top: int = 40,
                   info: dict | None = None) -> str:
    """The kernels' table (per step: launches, us, share of the kernels' sum, DRAM MB and GB/s),
    the categories and the sum per step, against the roofline floor where `info` has it."""
    if not rows:
        return f"no kernels in the window ({skipped} autotuning launches skipped)"
    has_dram = all(row.dram_bytes is not None for row in rows)
    lines = _kernel_lines(rows, steps, top, has_dram) + [""]
    lines += _total_lines(rows, steps, has_dram, info)
    partial = [row for row in rows if row.launches % steps]
    if partial:  # a window of whole steps runs each of the step's kernels `steps` times
        lines.append(f"({len(partial)} kernels ran a number of times that is no multiple of "
                     f"{steps}: the window did not hold {steps} whole steps, or they are not "
                     f"the step's, e.g. {short_name(partial[0].name)})")
    if skipped:
        lines.append(f"({skipped} autotuning launches skipped: {', '.join(AUTOTUNING_MARKERS)})")
    return "\n".join(lines)
