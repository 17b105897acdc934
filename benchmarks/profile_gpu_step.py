"""Where a decode step's device time goes on a GPU, kernel by kernel: a dummy-weight Engine puts
`--rows` requests into steady decode and brackets exactly `--steps` decode steps with
cudaProfilerStart / cudaProfilerStop, so that Nsight Compute, started with
`--profile-from-start off`, profiles those steps' kernels and nothing else (not the start-up's
compiles and GEMM autotuning, not the prefill). Then `--summarize` reads ncu's CSV into a table:
per kernel, launches and microseconds per step, share of the step, DRAM bytes; per category
(attention, GEMMs, scatters, other fusions); and the kernels' sum against the roofline floor.

On a GPU machine, from the repository root, in one device call (not yet run on a GPU: an
estimate of 2-3 minutes for Llama-3.1-8B on an H200 is the Engine's start with 2 programs to
compile, where 12 took 104 s, ~20 prefill steps, and the window, in which ncu serializes and
measures each of a few hundred kernels a step; `--steps 1` where time is short):

    ncu --clock-control none --cache-control none --profile-from-start off \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv \\
        python benchmarks/profile_gpu_step.py --model-config llama-3.1-8b --rows 256 \\
        --context 256 --steps 3 > $OUT/ncu_step.csv 2> $OUT/ncu_step.err
    python benchmarks/profile_gpu_step.py --summarize $OUT/ncu_step.csv

`--clock-control none` leaves the clocks where serving runs them (ncu locks base clocks by
default, which slows every kernel); `--cache-control none` keeps the L2 as the step left it
(ncu flushes it before each kernel by default, which makes the small fusions, whose inputs the
kernel before them just wrote, look slower than they run; the attention profile of
docs/results/h200-2026-11-26 was taken so). The script's own lines go to stdout
before ncu's CSV; the summarizer skips them but the window's ("profile_gpu_step window: {...}"),
from which it takes the step count and the roofline floor. Without ncu the same command runs the
window with the profiler calls doing nothing, and its wall time per step is the step's (with
the pipeline drained at both ends); on the CPU the calls are no-ops with a note.

How the window is bracketed: the engine dispatches every step through one call,
`ModelRunner.run`, on its loop thread. The script wraps that call on the running engine's runner
(no engine code changes). A call is a steady decode step when every one of the `--rows` requests
is running and decoding and none waits (the scheduler's state, read on the loop thread that
owns it). After `--skip` such steps, the wrapper waits for the previous step's output (so none
of its kernels falls inside), calls cudaProfilerStart, lets `--steps` steps through, waits for
the last one's output and calls cudaProfilerStop; the requests are then aborted.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ncu_summary  # noqa: E402  (plain Python: --summarize needs no JAX)

CUDART_SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


# --- cudaProfilerStart / Stop ------------------------------------------------------------------

class NoProfiler:
    """A backend without CUDA (the CPU): the window runs, nothing is bracketed."""

    description = "none (no CUDA backend: the profiler calls are no-ops)"

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


class CudartProfiler:
    """cudaProfilerStart / Stop of a CUDA runtime library, through ctypes."""

    def __init__(self, library: ctypes.CDLL, path: str):
        self._library, self.description = library, f"cudart ({path})"

    def _call(self, name: str) -> None:
        code = getattr(self._library, name)()
        if code != 0:
            raise RuntimeError(f"{name} returned CUDA error {code} ({self.description})")

    def start(self) -> None:
        self._call("cudaProfilerStart")

    def stop(self) -> None:
        self._call("cudaProfilerStop")


class TorchProfiler:
    """torch's own cudart, where no libcudart could be loaded by name."""

    description = "torch.cuda.profiler"

    def __init__(self, profiler_module):
        self._profiler = profiler_module

    def start(self) -> None:
        self._profiler.start()

    def stop(self) -> None:
        self._profiler.stop()


def cudart_candidates() -> list[str]:
    """Paths or names of libcudart to try, the one this process already loaded first (JAX's CUDA
    plugin's: the same runtime as the steps'), then the sonames the loader finds, then the
    `nvidia` pip packages' lib folders and the CUDA toolkit's."""
    loaded = []
    try:
        with open("/proc/self/maps") as maps:
            loaded = [line.split()[-1] for line in maps if "libcudart.so" in line]
    except OSError:
        pass
    folders = []
    try:
        import nvidia  # a namespace package of the CUDA pip wheels

        folders = [os.path.join(p, "*", "lib") for p in nvidia.__path__]
    except ImportError:
        pass
    found = [path for folder in folders + ["/usr/local/cuda*/lib*"]
             for path in sorted(glob.glob(os.path.join(folder, "libcudart.so*")))]
    return list(dict.fromkeys(loaded + list(CUDART_SONAMES) + found))


def cuda_profiler(backend: str):
    """The profiler calls for `backend`: ctypes on libcudart, else torch, else none on CPU."""
    if backend != "gpu":
        return NoProfiler()
    for path in cudart_candidates():
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(library, "cudaProfilerStart"):
            return CudartProfiler(library, path)
    try:
        import torch.cuda.profiler
    except ImportError:
        raise RuntimeError("no libcudart could be loaded (tried "
                           f"{', '.join(cudart_candidates())}) and torch does not import") from None
    return TorchProfiler(torch.cuda.profiler)


# --- the window --------------------------------------------------------------------------------

class StepWindow:
    """Brackets `steps` steady decode steps of a running EngineCore with `profiler`, by wrapping
    its runner's `run` (the module docstring says how). Everything here runs on the engine's
    loop thread but `install`, `uninstall` and the waits on `done`."""

    def __init__(self, core, *, rows: int, skip: int, steps: int, profiler):
        self.runner, self.scheduler = core.runner, core.scheduler
        self.rows, self.skip, self.steps, self.profiler = rows, skip, steps, profiler
        self._run = core.runner.run
        self._steady_seen = 0
        self.shapes: list[tuple] = []  # (tokens, seqs, pages) of each step in the window
        self.kv_tokens: list[float] = []  # mean tokens a row at the window's start and end
        self.wall_s: float | None = None
        self.error: Exception | None = None
        self.done = threading.Event()
        self._started_at = 0.0

    def install(self) -> None:
        self.runner.run = self._step

    def uninstall(self) -> None:
        self.runner.run = self._run

    def steady(self) -> bool:
        """Every one of the rows runs and decodes, none waits: the step is a decode step."""
        s = self.scheduler
        return (s.num_waiting == 0 and s.num_running == self.rows
                and all(r.is_decoding for r in s.running))

    def _mean_tokens(self) -> float:
        running = self.scheduler.running
        return sum(r.num_tokens for r in running) / max(1, len(running))

    def _wait_for_device(self) -> None:
        """Until the last step dispatched has run: its outputs (last_tokens among them) are ready
        together, once all of its kernels were launched and finished."""
        import jax

        jax.block_until_ready(self.runner.last_tokens)

    def _step(self, staged, token_bitmask=None):
        if self.done.is_set():
            return self._run(staged, token_bitmask)
        if not self.shapes:
            self._steady_seen = self._steady_seen + 1 if self.steady() else 0
            if self._steady_seen <= self.skip or not self._begin():
                return self._run(staged, token_bitmask)
        elif not self.steady():
            self._fail(RuntimeError("the batch changed inside the window (a request ended or "
                                    "was retracted): raise max_new_tokens or the KV pool"))
        out = self._run(staged, token_bitmask)
        self.shapes.append(tuple(staged.shape))
        if len(self.shapes) == self.steps and not self.done.is_set():
            self._end()
        return out

    def _begin(self) -> bool:
        try:
            self._wait_for_device()
            self.kv_tokens.append(self._mean_tokens())
            self.profiler.start()
            self._started_at = time.perf_counter()
            return True
        except Exception as error:
            self._fail(error)
            return False

    def _end(self) -> None:
        try:
            self._wait_for_device()
            self.wall_s = time.perf_counter() - self._started_at
            self.profiler.stop()
            self.kv_tokens.append(self._mean_tokens())
        except Exception as error:
            self.error = error
        self.done.set()

    def _fail(self, error: Exception) -> None:
        """Ends the window with `error`; a profiler already started is stopped."""
        if self.shapes:
            try:
                self.profiler.stop()
            except Exception:
                pass
        self.error = error
        self.done.set()


# --- the run -----------------------------------------------------------------------------------

def request_plan(rows: int, context: int, steps: int, skip: int,
                 max_prefill: int) -> tuple[int, int]:
    """(max_new_tokens, context length): enough output for the first request admitted to decode
    through every prefill step (each takes at least `prefill_budget` prompt tokens beside the
    decodes), the skipped steps and the window, with room to spare."""
    from xlaserve.runtime.scheduler.scheduler import prefill_budget

    ramp_steps = -(-rows * context // prefill_budget(max_prefill, rows)) + 2
    max_new = ramp_steps + skip + steps + 32
    return max_new, context + max_new


class Requests:
    """The requests' output as the engine's output thread hands it: errors and ends, counted."""

    def __init__(self):
        self.errors: list[str] = []
        self.finished = 0
        self._lock = threading.Lock()

    def emit(self, chunk) -> None:
        with self._lock:
            if chunk.error:
                self.errors.append(chunk.error)
            self.finished += chunk.finished


def wait_for_window(window: StepWindow, core, requests: Requests, timeout_s: float) -> None:
    """Until the window is done; raises where it cannot come: the engine died, a request
    failed or ended first, the time ran out."""
    deadline = time.monotonic() + timeout_s
    while not window.done.wait(0.5):
        if not core.is_alive():
            raise RuntimeError(f"the engine stopped: {core.stopped_reason()}")
        if requests.errors:
            raise RuntimeError(f"a request failed: {requests.errors[0]}")
        if requests.finished:
            raise RuntimeError(f"{requests.finished} request(s) ended before the window: "
                               "raise max_new_tokens (request_plan)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no window of {window.steps} steady decode steps in "
                               f"{timeout_s:.0f} s (--timeout-s)")
    if window.error is not None:
        raise window.error


def end_requests(core, requests: Requests, rows: int, timeout_s: float = 60.0) -> None:
    """Aborts the requests and waits for their final chunks, so the engine shuts down idle."""
    core.abort_all("the profile window is done")
    deadline = time.monotonic() + timeout_s
    while requests.finished < rows and time.monotonic() < deadline and core.is_alive():
        time.sleep(0.05)


def window_report(window: StepWindow, bench, args, profiler, hbm_gbps) -> dict:
    import jax

    kv_tokens = sum(window.kv_tokens) / len(window.kv_tokens)
    report = {"model": args.model_config, "device_kind": jax.devices()[0].device_kind,
              "rows": args.rows, "context": args.context, "steps": args.steps,
              "skip": args.skip, "shapes": [list(s) for s in sorted(set(window.shapes))],
              "kv_tokens_mean": kv_tokens, "wall_ms_per_step": window.wall_s / args.steps * 1e3,
              "startup_s": bench.startup_s, "weight_bytes": bench.weight_bytes,
              "profiler": profiler.description, "hbm_gbps": hbm_gbps}
    if hbm_gbps:
        floor_s, nbytes = bench.floor_step_s(args.rows, kv_tokens)
        report.update(floor_ms=floor_s * 1e3, floor_bytes=nbytes)
    return report


def start_bench(args, tiny_dir: str):
    """The dummy-weight Engine (accelerator_lib.ModelBench) with the two buckets the run needs:
    the decode step's (`--rows` tokens, at least 8) and the largest (a prefill step). Their
    programs compile on first use (but with --precompile): greedy requests run one of the three
    variants a bucket precompiles (step_needs.ACCELERATOR_VARIANTS), so 2 programs compile, not
    6 (Llama-3.1-8B's cold start with 12 took 104 s on an H200, accelerator_check.py)."""
    import accelerator_lib as lib

    _, context_length = request_plan(args.rows, args.context, args.steps, args.skip,
                                     args.max_prefill)
    path = (lib.write_tiny_config(tiny_dir) if args.model_config == "tiny"
            else lib.config_dir(args.model_config))
    return lib.ModelBench(path, hbm_gbps=None, max_running=args.rows,
                          context_length=context_length, max_prefill_tokens=args.max_prefill,
                          token_buckets=[args.rows], disable_precompile=not args.precompile)


def run_window(bench, args, profiler) -> StepWindow:
    """Submits the requests and waits for the window over their steady decode steps."""
    from xlaserve.runtime.sampling.params import SamplingParams

    core = bench.engine.core
    max_new, _ = request_plan(args.rows, args.context, args.steps, args.skip, args.max_prefill)
    window = StepWindow(core, rows=args.rows, skip=args.skip, steps=args.steps, profiler=profiler)
    requests = Requests()
    window.install()
    try:
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
        for prompt in bench.prompts(args.rows, args.context, args.context):
            core.submit(prompt, params, requests.emit)
        wait_for_window(window, core, requests, args.timeout_s)
        return window
    finally:
        window.uninstall()
        end_requests(core, requests, args.rows)


def profile(args, profiler=None) -> dict:
    """Starts the Engine, runs the window, prints and returns its report (`profiler`: the calls
    to bracket it with; by default this backend's, `cuda_profiler`)."""
    import jax

    import accelerator_lib as lib

    with tempfile.TemporaryDirectory(prefix="profile_gpu_step_") as tiny_dir:
        bench = start_bench(args, tiny_dir)
        try:
            profiler = profiler or cuda_profiler(jax.default_backend())
            print(f"profile_gpu_step: started in {bench.startup_s:.0f} s; profiler: "
                  f"{profiler.description}", flush=True)
            window = run_window(bench, args, profiler)
            hbm_gbps = args.hbm_gbps or lib.published_hbm_gbps(jax.devices()[0].device_kind)
            report = window_report(window, bench, args, profiler, hbm_gbps)
            print(ncu_summary.WINDOW_MARKER + json.dumps(report), flush=True)
            return report
        finally:
            bench.close()


def summarize_file(path: str, steps: int | None, top: int) -> str:
    with open(path, errors="replace") as f:
        text = f.read()
    info = ncu_summary.window_info(text)
    steps = steps or (info or {}).get("steps")
    if not steps:
        raise SystemExit(f"{path} has no 'profile_gpu_step window' line: give --steps")
    rows, skipped = ncu_summary.summarize(ncu_summary.read_launches(text))
    return ncu_summary.format_summary(rows, steps, skipped=skipped, top=top, info=info)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summarize", metavar="NCU_CSV",
                        help="print the per-kernel table of ncu's --csv output and exit")
    parser.add_argument("--model-config", default="llama-3.1-8b",
                        help="a folder of benchmarks/configs, a config.json folder, or 'tiny' "
                             "(a 2-layer model for the CPU)")
    parser.add_argument("--rows", type=int, default=256, help="requests decoding together")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens a request")
    parser.add_argument("--steps", type=int, default=None,
                        help="decode steps in the window (default 3; with --summarize: the "
                             "window line's)")
    parser.add_argument("--skip", type=int, default=2,
                        help="steady decode steps to let by before the window (at least 1: the "
                             "first may compile the decode program)")
    parser.add_argument("--max-prefill", type=int, default=4096,
                        help="prompt tokens a prefill step (the larger compiled bucket)")
    parser.add_argument("--precompile", action="store_true",
                        help="precompile every variant of both buckets at start, as a server "
                             "does (default: compile the two programs used, on first use)")
    parser.add_argument("--hbm-gbps", type=float, default=None,
                        help="HBM bandwidth of the floor (default: the device kind's published)")
    parser.add_argument("--timeout-s", type=float, default=300,
                        help="seconds after the start-up for the window to come")
    parser.add_argument("--top", type=int, default=40, help="kernels shown in the table")
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize_file(args.summarize, args.steps, args.top))
        return 0
    args.steps = args.steps or 3
    if min(args.rows, args.context, args.steps, args.skip) < 1:
        parser.error("--rows, --context, --steps and --skip must be at least 1")
    profile(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
