"""Host time per engine step, by phase, with a device step that costs next to nothing.

The real EngineCore (scheduler, batch building, the step's two transfer vectors, the output
read, the detokenizer and the outputs) serves a dummy-weight Llama of 32 layers and
hidden size 64 with a 512-token vocabulary on CPU. Its step takes the same number of arguments
as Llama-3.1-8B's (169: 131 weight arguments, 32 KV caches, 6 others; runtime/executor/weight_args.py's
stacking threshold is lowered so that each matrix stays an argument of its own, as an 8B
model's do), so the per-argument costs of a call are those of the real model.

    .venv/bin/python benchmarks/bench_host_step.py                 # 1 / 32 / 256 / 512 rows + admissions
    .venv/bin/python benchmarks/bench_host_step.py --rows 256 --steps 100 --no-admissions

Each case puts N requests in decode (8-token prompts, EOS ignored) and times the engine loop's
iterations that ran a decode step of exactly N rows; the admission case keeps 256 requests
running while 768 more wait and arrive (short outputs, so requests end and are admitted every
few steps). Per iteration of the engine thread, in ms of that thread's CPU time
(time.thread_time: on a shared 2-core machine the wall time of a phase also counts the time the
thread waited for a core, which the device's own compute and other processes take), medians:
- schedule: Scheduler.schedule / schedule_continuation;
- build: the ForwardBatch and sampling metadata (GenerationSteps.stage less the staging);
- pack+put: ModelRunner.stage (the two host vectors and their transfer);
- dispatch: ModelRunner.run (the asynchronous call);
- wait: blocking on the step's tokens (wall time: the device, not host work);
- read: the rest of GenerationSteps.read (tokens to the scheduler, finished requests);
- deliver: what the engine thread spends handing a step's tokens out (detokenizing and the
  chunks themselves where that runs on the engine thread);
- other: the rest of the iteration (the inbox, the loop);
- host: the engine thread's CPU time per iteration (its own cost of a step);
- output thr: the CPU time per step of the output thread (detokenizing, stop strings,
  the chunks), where it has one: work taken off the loop (the mean over the case's steps);
- wall: the iteration's wall time.
"device" is the compiled step of the same bucket run alone in a loop (dispatch + compute +
wait), beside the figures: the engine's wait is what of it the host work did not hide.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

# The "device" (XLA's CPU client) computes on one thread, so the engine thread has a core of its
# own on a 2-core machine: with XLA's default thread pool the step's compute took both cores
# and the host phases measured 2-4x their own cost, at random.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from xlaserve.runtime.engine.core import EngineCore
from xlaserve.runtime.executor import weight_args
from xlaserve.weights.loader import default_model_file, load_tokenizer
from xlaserve.runtime.sampling.params import SamplingParams
from xlaserve.server_args import ServerArgs

# Llama-3.1-8B's structure at hidden 64, one head of 64, intermediate 128, in float32 (XLA's CPU
# dots are fastest in it; the host work does not depend on the dtype).
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 32,
    "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64,
    "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32",
}
# The 8B model's matrices are far over weight_args.SMALL_LEAF_BYTES (each an argument of its own)
# and its norms under it (stacked into one argument); at hidden 64 its matrices would be under it
# too and stack by shape into a handful of arguments. With the threshold at 1 KiB the small model
# splits as the 8B one does: 32 x (qkv, o, gate_up, down) + embedding + LM head + the norms' stack.
SMALL_LEAF_BYTES = 1024
PHASES = ("schedule", "build", "pack+put", "dispatch", "wait", "read", "deliver", "other")


class NullStep:
    """Stands in for a bucket's compiled step: an executable with the same arguments (donated as
    the step's) and outputs that computes next to nothing. Its tokens are a cheap function of
    the step's input vector, so they change from step to step and the detokenizer has text to
    make. The model's own step on this CPU is not near zero at 256 rows (~25-40 ms, most of it
    reading the KV pages), and as it runs on the core beside the engine thread it slows the
    engine's own host code by contending for the memory system (a dispatch measured 0.3 ms
    beside the 1-row step, 1.6 ms beside the 256-row one, same arguments); on a GPU or TPU the
    step does not run on the host's cores."""

    def __init__(self, program, vocab_size: int):
        self._program, self._vocab_size, self._compiled = program, vocab_size, None

    def __call__(self, *args):
        if self._compiled is None:
            outputs = self._program.out_info[0]
            vocab_size = self._vocab_size

            def null_step(weights, kv_caches, output_counts, last_tokens, page_table,
                          prompt_masks, ints, *rest):
                out = jax.tree.map(lambda o: jnp.zeros(o.shape, o.dtype), outputs)
                seqs = out.sample.tokens.shape[0]
                tokens = (jnp.sum(ints) + 131 * jnp.arange(seqs, dtype=jnp.int32)) % vocab_size
                out.sample.tokens = tokens.astype(jnp.int32)
                return out, kv_caches, output_counts, last_tokens, page_table
            self._compiled = jax.jit(null_step, donate_argnums=(1, 2, 3, 4)).lower(
                *args).compile()
        return self._compiled(*args)


class PhaseClock:
    """Wraps the engine's methods (instance attributes, this engine only) to time each phase of
    every loop iteration; an iteration starts where the loop drains its inbox (its first call,
    right after the watchdog's beat). With `null_step`, each
    bucket's program is a NullStep."""

    def __init__(self, core: EngineCore, null_step: bool = False):
        self.iterations: list[dict] = []
        self._current: dict | None = None
        self.last_staged = None  # the last step staged (ModelRunner.stage's StagedStep)
        self._wrap(core, "_drain_inbox", self._beat)
        run = core.runner.run
        programs = core.runner._programs

        def run_precompiled(staged, *args):
            # Served as at start-up: each bucket's step an executable of its own (precompile),
            # whose call costs less host time than the jitted function's; compiled here on first
            # use, for the buckets the cases reach only.
            if staged.shape not in self._compiled:
                core.runner.precompile([staged.shape], progress=False)
                self._compiled.add(staged.shape)
                if null_step:
                    for key in [k for k in programs if k[0] == staged.shape]:
                        programs[key] = NullStep(programs[key], CONFIG["vocab_size"])
            return run(staged, *args)
        self._compiled = set()
        core.runner.run = run_precompiled
        for name in ("schedule", "schedule_continuation"):
            self._timed(core.scheduler, name, "schedule", self._note_batch)
        self._timed(core.runner, "stage", "pack+put", self._note_staged)
        self._timed(core.runner, "run", "dispatch")
        self._timed(core.steps, "stage", "build")
        self._timed(core._live_requests, "deliver", "deliver")
        read = core.steps.read

        def timed_read(batch, out):
            start = time.perf_counter()
            out.sample.tokens.block_until_ready()  # the array's own: no pytree walk in Python
            self._add("wait", time.perf_counter() - start)  # wall time: the thread sleeps
            waited = time.thread_time()
            result = read(batch, out)
            self._add("read", time.thread_time() - waited)
            return result
        core.steps.read = timed_read

    def _wrap(self, owner, name, before):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            before()
            return original(*args, **kwargs)
        setattr(owner, name, wrapped)

    def _timed(self, owner, name, phase, after=None):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            start = time.thread_time()
            result = original(*args, **kwargs)
            self._add(phase, time.thread_time() - start)
            if after is not None:
                after(result)
            return result
        setattr(owner, name, wrapped)

    def _beat(self):
        now, cpu = time.perf_counter(), time.thread_time()
        if self._current is not None:
            self._current["wall"] = now - self._current["start"]
            self._current["host"] = cpu - self._current["cpu_start"]
            self.iterations.append(self._current)
        self._current = {"start": now, "cpu_start": cpu, "rows": [], "kinds": [],
                         **dict.fromkeys(PHASES, 0.0)}

    def _add(self, phase, seconds):
        if self._current is not None:
            self._current[phase] += seconds

    def _note_staged(self, staged):
        self.last_staged = staged

    def _note_batch(self, batch):
        if batch is not None and self._current is not None:
            self._current["rows"].append(len(batch.requests))
            self._current["kinds"].append(batch.kind)

    def summary(self, iterations: list[dict]) -> dict:
        """Median ms per iteration of each phase, over `iterations` (medians: on a shared
        machine a few iterations descheduled for ms would swamp a mean)."""
        out = {}
        for it in iterations:
            it["build"] -= it["pack+put"]  # GenerationSteps.stage calls ModelRunner.stage
        for phase in (*PHASES[:-1], "host", "wall"):
            out[phase] = 1e3 * statistics.median(it[phase] for it in iterations)
        out["other"] = out["host"] - sum(out[p] for p in PHASES[:-1] if p != "wait")
        return out


def device_step_ms(core: EngineCore, staged, repeats: int = 30) -> float:
    """The compiled step alone (dispatch, compute, wait), median ms; run on the idle engine's
    runner (its loop touches the runner only while it has work)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(core.runner.run(staged).sample.tokens)
        times.append(time.perf_counter() - start)
    core.flush_cache()  # the repeated step wrote K/V into freed pages: nothing may reuse them
    return 1e3 * statistics.median(times)


def output_thread_cpu(core: EngineCore) -> float:
    """CPU seconds the output thread has used (NaN where outputs are made on the loop
    thread: no such thread)."""
    thread = getattr(core._live_requests, "_thread", None)
    if thread is None:
        return float("nan")
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def serve(core: EngineCore, params: list[SamplingParams], rng) -> float:
    """Submits a request of an 8-token random prompt per entry of `params` and waits for every
    final chunk; returns the CPU seconds the output thread used meanwhile."""
    done = threading.Event()
    left = [len(params)]

    def emit(chunk):
        if chunk.finished:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    output_cpu = output_thread_cpu(core)
    for p in params:
        core.submit(rng.integers(3, CONFIG["vocab_size"], 8).tolist(), p, emit)
    done.wait()
    return output_thread_cpu(core) - output_cpu


def run_case(core: EngineCore, clock: PhaseClock, rows: int, steps: int, rng) -> dict:
    """N requests decoding together; the iterations that ran a decode of exactly N rows."""
    warmup = 8  # decode steps before timing: the bucket's compile, the first admissions
    params = SamplingParams(temperature=0.0, max_new_tokens=warmup + steps + 4, ignore_eos=True)
    first = len(clock.iterations)
    output_cpu = serve(core, [params] * rows, rng)
    decodes = [it for it in clock.iterations[first:]
               if it["rows"] and all(n == rows for n in it["rows"]) and it["kinds"][0] == "decode"]
    timed = decodes[warmup:warmup + steps]
    stepped = [it for it in clock.iterations[first:] if it["rows"]]
    return {"rows": rows, "steps": len(timed), **clock.summary(timed),
            "output thr": 1e3 * output_cpu / len(stepped)}


def run_admissions(core: EngineCore, clock: PhaseClock, running: int, waiting: int, rng) -> dict:
    """`running` requests decoding while `waiting` more queue: outputs of 8-40 tokens, so that
    requests end and others are admitted every few steps; the iterations while some wait."""
    params = [SamplingParams(temperature=0.0, max_new_tokens=int(n), ignore_eos=True)
              for n in rng.integers(8, 41, running + waiting)]
    first = len(clock.iterations)
    output_cpu = serve(core, params, rng)
    its = [it for it in clock.iterations[first:] if it["rows"]]
    timed = its[len(its) // 10:len(its) * 7 // 10]  # past the first fill, while the queue is long
    return {"rows": f"{running}+adm", "steps": len(timed), **clock.summary(timed),
            "output thr": 1e3 * output_cpu / len(its)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,32,256,512", help="running requests per case")
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps per case")
    parser.add_argument("--no-admissions", action="store_true", help="skip the admission case")
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON line per case too")
    parser.add_argument("--context-length", type=int, default=4096,
                        help="the model's max_position_embeddings: the page table is as wide as "
                             "its pages (131072: Llama-3.1-8B's, 8192 pages of 16)")
    parser.add_argument("--tokenizer-path", default=None,
                        help="the tokenizer whose detokenizing the output thread does (default: the "
                             "embedded SmolLM2's; on a machine without its package, a folder "
                             "saved from it: see docs/accelerator_check.md)")
    parser.add_argument("--save-tokenizer", default=None, metavar="DIR",
                        help="save the embedded SmolLM2's tokenizer to DIR (for --tokenizer-path "
                             "on a machine without its package) and exit")
    parser.add_argument("--null-step", action="store_true",
                        help="run each bucket's step as a NullStep: same arguments, no compute")
    args = parser.parse_args(argv)
    if args.save_tokenizer:
        load_tokenizer(default_model_file()).save_pretrained(args.save_tokenizer)
        return
    cases = [int(n) for n in args.rows.split(",")]
    folder = tempfile.mkdtemp(prefix="xlaserve-host-step-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**CONFIG, "max_position_embeddings": args.context_length}, f)
    weight_args.SMALL_LEAF_BYTES = SMALL_LEAF_BYTES
    most = max(cases + [256])
    core = EngineCore(ServerArgs(
        model_path=folder, load_format="dummy",
        tokenizer_path=args.tokenizer_path or default_model_file(),
        dtype="float32", matmul_backend="xla", max_running_requests=most,
        max_total_tokens=most * 160, max_prefill_tokens=4096, chunked_prefill_size=4096,
        disable_precompile=True, random_seed=0,
        disable_overlap_schedule=args.disable_overlap_schedule, watchdog_timeout=600.0))
    weight_count = len(core.runner._weight_args)
    print(f"step arguments: {weight_count} weights + {CONFIG['num_hidden_layers']} KV caches + 6 "
          f"= {weight_count + CONFIG['num_hidden_layers'] + 6} (Llama-3.1-8B: 169)")
    clock = PhaseClock(core, null_step=args.null_step)
    rng = np.random.default_rng(0)
    results = []
    for rows in cases:
        result = run_case(core, clock, rows, args.steps, rng)
        # The case's last step: a decode of `rows` rows at its longest.
        result["device"] = device_step_ms(core, clock.last_staged)
        results.append(result)
    if not args.no_admissions:
        results.append(run_admissions(core, clock, 256, 768, rng))
    core.shutdown()
    header = ["rows", "steps", *PHASES, "host", "output thr", "wall", "device"]
    print(" ".join(f"{h:>9}" for h in header))
    for r in results:
        print(" ".join(f"{r[h]:>9}" if isinstance(r.get(h), (int, str)) else
                       f"{r.get(h, float('nan')):9.3f}" for h in header))
        if args.json:
            print(json.dumps(r))



if __name__ == "__main__":
    main()
