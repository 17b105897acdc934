"""The one command to run on a GPU (or TPU) machine: is xlaserve correct there, and how far from
the hardware's floor is it? In under 10 minutes on an H100 / H200:

    python benchmarks/accelerator_check.py [--out accelerator_check.json] [--hbm-gbps 3350]
    python benchmarks/accelerator_check.py --quick      # CPU-sized, for a test: a couple of minutes

1. the environment: Python, package versions, devices, device memory, optional packages;
2. a device copy's bandwidth (the roofline's, unless the device kind names a published figure);
3. decode steps at batch 1 / 32 / 256, a cold start and offline throughput of dummy-weight
   Llama-3.1-8B and Qwen3-30B-A3B (its first 8 layers, to fit an H100 and compile in time)
   against the roofline: a decode step cannot beat (weights + KV it reads) / HBM bandwidth;
4. the Pallas attention kernel compiled for this device (on CPU: the GPU kernel interpreted)
   against the jnp reference on NaN-poisoned decode, prefill, mixed and ragged batches, float32
   and bfloat16: max abs error, pass / fail; then bench_attention.py's timings against the HBM
   bandwidth;
5. the experts' grouped matmul (benchmarks/moe_layer_check.py) against ragged_dot and its floor;
   a warm start of the first model (its steps from the executable cache);
6. the server: launch_server on a 2-layer dummy model in a subprocess, /health, one completion
   through the openai SDK (skipped, with the reason, when fastapi / uvicorn / openai are missing).

The figures go to --out (JSON) and, beside it, report.md (every figure and check) and steps.svg
(step time over rows, beside the floor): benchmarks/accelerator_report.py.

Every step is guarded (a failure is recorded and the rest runs) and the JSON (--out) is rewritten
after each, so a run cut short keeps what it measured. Exit code 0 only if every correctness
check passed and no step failed. The models run first: they are what a first run on a new
machine is for, and a cold start (every program compiled, GEMMs autotuned) is slowest there.
Each step has its own share of the time budget (the plan's `budgets`): past it, a step skips
what it has left (the next batch, the next attention case) and says so, so one slow step cannot
starve the others, and the whole run stays inside the device machine's 600 s per command. The
attention cases, and a serving step stored in the executable cache, are compiled for an H100 in
CI (tests/test_accelerator_check.py), so a shape Triton refuses shows there first.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import accelerator_lib as lib  # noqa: E402
import accelerator_report as report  # noqa: E402
import bench_attention  # noqa: E402
from moe_layer_check import check_moe_layer  # noqa: E402

TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # as tests/kernels: bf16 output is rounded

# Sizes per mode. "full" is an accelerator's; "quick" is sized for a 2-core CPU, where the
# attention kernel runs interpreted (seconds per call).
PLANS = {
    "full": dict(
        attention_heads=dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16),  # Llama 8B
        ragged_heads=dict(num_q_heads=14, num_kv_heads=2, head_dim=64, page_size=16),  # Qwen 0.5B
        longest=2048, extra_decodes=32, prefill=[(512, 512), (200, 200), (17, 17), (1, 1), (64, 64)],
        mixed=[(1, 1000), (128, 300), (1, 17), (64, 64), (1, 2048), (33, 100), (1, 1)],
        ragged=(16, 300), copy_bytes=1 << 30, iters=20,
        bench_batches=bench_attention.BATCHES, bench_dtype="bfloat16",
        bench_heads=dict(num_q_heads=16, num_kv_heads=4, head_dim=128),
        latent_heads=dict(num_q_heads=16, row_dim=576, value_dim=512, page_size=16),  # V3, tp 8
        # A decode step is (T(long) - T(short)) / (long - short): `short` must outlast the
        # prefill of the biggest batch, 256 x 128 tokens at up to 4096 a step (about 9 steps).
        # Qwen3-30B-A3B's first 8 of 48 layers: its whole 61 GB do not fit an H100 beside the
        # KV cache at this process's 75%, and its first 24 took 267 s to compile on an H200
        # (2026-11-27: 12 programs at 18-22 s, the first 65 s), past the run's share for it
        # (every layer has the same shapes: the step's figures against its floor hold for the
        # weights it reads).
        models=["llama-3.1-8b", "qwen3-30b-a3b@8"], batches=[1, 32, 256], input_len=128,
        short=16, long=80, max_running=256, context=256, max_prefill=4096,
        # A verified row of 5 tokens (4 drafts, SGLang's usual chain) at batch 1 and 32: both
        # fit the buckets the decode runs compile (8 and 256 tokens), so no program more.
        verify_batches=[1, 32], verify_tokens=5,
        offline=dict(num_prompts=512, input_len=(32, 64), output_len=128),
        # --lora: 4 slots of rank 16 on every module, as predict_accelerators.py --lora 16,4.
        lora=dict(slots=4, rank=16),
        server_timeout_s=300, time_budget_s=540,  # the device machine stops a command at 600 s
        # Seconds each step may take before it skips what it has left (a model: its own name).
        # The first H200 run (2026-11-26) took 106 s for Qwen2.5-0.5B, 112 s for Llama-3.1-8B
        # (its cold start 104 s), 58 s for the attention checks and 5.5 s for their timing. The
        # second (2026-11-27) spent the models' whole shares (120 and 150 s) on their cold
        # starts (118 and 149 s) and measured nothing; measured from the executable cache
        # after, Qwen's figures took ~25 s and Llama's ~30 s past start-up. The server, which
        # compiled its own steps beside this process (152 s), now loads the first model's.
        # Issue 51 put Qwen3-30B-A3B and the MoE layer in Qwen2.5-0.5B's place, a warm start
        # (the first model again, from the executable cache: 24 s on the H200) and the server on
        # the 2-layer model (a few small programs to compile) in place of the first model's.
        # The third H200 run (2026-11-27) took 155 s for Llama-3.1-8B (cold start 146 s).
        budgets={"llama-3.1-8b": 180, "qwen3-30b-a3b@8": 180, "attention_correctness": 35,
                 "latent_attention_correctness": 15, "attention_timing": 15, "moe_layer": 20,
                 "warm_start": 35, "server": 60,
                 # --lora's engine: a second cold start of the first model (~150 s on an H200)
                 # and 6 decode-step figures; past the default 540 s with both models, so
                 # --lora goes with one (--model-configs llama-3.1-8b).
                 "lora": 200}),
    "quick": dict(
        attention_heads=dict(num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16),
        ragged_heads=dict(num_q_heads=6, num_kv_heads=2, head_dim=32, page_size=16),
        longest=64, extra_decodes=0, prefill=[(10, 10), (16, 16), (1, 1), (17, 17)],
        mixed=[(1, 17), (8, 40), (3, 16), (1, 2), (5, 5)],
        ragged=(5, 24), copy_bytes=256 << 20, iters=3,
        bench_batches={"decode": (8, 1, 256), "prefill": (2, 64, 64)}, bench_dtype="float32",
        bench_heads=dict(num_q_heads=4, num_kv_heads=2, head_dim=32),
        latent_heads=dict(num_q_heads=4, row_dim=48, value_dim=32, page_size=16),
        models=["tiny"], batches=[1, 8], input_len=8, short=4, long=12, max_running=8,
        verify_batches=[1], verify_tokens=5,
        context=64, max_prefill=64, offline=dict(num_prompts=16, input_len=(8, 16), output_len=8),
        lora=dict(slots=2, rank=4),
        server_timeout_s=150, time_budget_s=None, budgets={}),
}


# --- the steps ---------------------------------------------------------------------------------

def show_environment() -> dict:
    env = lib.environment()
    print(json.dumps(env, indent=1), flush=True)
    return env


def attention_batches(plan: dict, rng) -> dict[str, tuple[dict, list[tuple[int, int]]]]:
    """The correctness check's batches: name -> (head layout, [(q_len, kv_len)] per sequence)."""
    heads, longest = plan["attention_heads"], plan["longest"]
    decode_lens = lib.boundary_lengths(heads["page_size"], longest) + list(
        rng.integers(1, longest + 1, plan["extra_decodes"]))
    return {
        "decode": (heads, [(1, int(n)) for n in decode_lens]),
        "prefill": (heads, plan["prefill"]),
        "mixed": (heads, plan["mixed"]),
        "ragged": (plan["ragged_heads"], lib.random_sequences(rng, *plan["ragged"], longest)),
    }


def check_attention(plan: dict, out_of_time=lambda: False, latent: bool = False) -> dict:
    """The platform's Pallas kernel against the reference on every batch in both dtypes;
    `latent`: the multi-head latent attention kernel, on the decode, prefill and mixed batches
    at plan["latent_heads"] (DeepSeek-V3's rows at tp 8)."""
    name, kernel = lib.kernel_under_test(
        jax.default_backend(), "mla_ragged_paged_attention" if latent else "ragged_paged_attention")
    rng = np.random.default_rng(0)
    batches = attention_batches(plan, rng)
    make_case, value_dim = lib.make_attention_case, None
    if latent:
        batches = {b: (plan["latent_heads"], seqs) for b, (_, seqs) in batches.items()
                   if b != "ragged"}
        make_case, value_dim = lib.make_latent_attention_case, plan["latent_heads"]["value_dim"]
    label = "latent" if latent else "attention"
    cases = []
    # bfloat16 first: the dtype a server runs, where float32's cases (the reference compiled at
    # `highest`, 4-28 s each on an H100) spent the step's whole share on 2026-11-27.
    for dtype in ("bfloat16", "float32"):
        for batch, (shape, seqs) in batches.items():
            if out_of_time():
                result = {"skipped": "the step's time budget is spent"}
                cases.append({"batch": batch, "dtype": dtype, **result})
                print(f"  {label} {batch:<8} {dtype:<9} SKIP", flush=True)
                continue
            case = make_case(rng, seqs, dtype=jnp.dtype(dtype), **shape)
            start = time.perf_counter()  # compile and run: compile costs show on a new device
            try:
                result = lib.compare_with_reference(kernel, case, TOLERANCE[dtype], value_dim)
            except Exception as error:  # one case failing to compile must not hide the others
                result = {"passed": False, "error": _describe(error)}
            cases.append({"batch": batch, "dtype": dtype, "num_seqs": len(seqs), **shape, **result,
                          "seconds": round(time.perf_counter() - start, 1)})
            print(f"  {label} {batch:<8} {dtype:<9} {report.status(result)} {report.error_text(result)}",
                  flush=True)
    return {"kernel": name, "cases": cases,
            "passed": all(c.get("passed", True) for c in cases)}


def measure_bandwidth(plan: dict, hbm_flag: float | None) -> dict:
    copy = lib.copy_bandwidth_gbps(plan["copy_bytes"], plan["iters"])
    published = lib.published_hbm_gbps(jax.devices()[0].device_kind)
    hbm, source = next((v, s) for v, s in ((hbm_flag, "--hbm-gbps"), (published, "device kind"),
                                           (copy, "measured copy")) if v)
    return {"copy_gbps": copy, "copy_bytes": plan["copy_bytes"], "hbm_gbps": hbm, "hbm_source": source}


def time_attention(plan: dict, hbm_gbps: float, out_of_time=lambda: False) -> dict:
    found = bench_attention.implementations(jax.default_backend())
    rows = []
    for row in bench_attention.attention_timings(
            found, plan["bench_batches"], dtype=jnp.dtype(plan["bench_dtype"]),
            iters=plan["iters"], page_size=16, **plan["bench_heads"]):
        row["of_hbm"] = row["gb_s"] / hbm_gbps
        rows.append(row)
        if out_of_time():
            return {"dtype": plan["bench_dtype"], **plan["bench_heads"], "rows": rows,
                    "cut_short": "the step's time budget is spent"}
    return {"dtype": plan["bench_dtype"], **plan["bench_heads"], "rows": rows}


def check_server(model_path: str, timeout_s: float, flags: list[str] | None = None,
                 out_of_time=None) -> dict:
    """`flags`: the first model's engine flags (its steps load from the executable cache).
    `out_of_time` is unused: the server's own `timeout_s` (at most the step's budget) bounds it."""
    if jax.default_backend() == "tpu":
        return {"skipped": "a TPU chip serves one process: this one holds it"}
    missing = [name for name in lib.SERVER_NEEDS if not lib.importable(name)]
    if missing:
        return {"skipped": f"not importable here: {', '.join(missing)} (carry them as wheels: "
                           "docs/accelerator_check.md)"}
    return {"model": model_path, **lib.server_check(model_path, timeout_s=timeout_s, flags=flags)}


def model_bench(plan: dict, model_path: str, hbm_gbps: float, **options) -> lib.ModelBench:
    """The plan's engine of a model: the same flags for every start, so a second one loads the
    steps the first stored in the executable cache. `options`: more Engine arguments."""
    return lib.ModelBench(model_path, hbm_gbps=hbm_gbps, max_running=plan["max_running"],
                          context_length=plan["context"], max_prefill_tokens=plan["max_prefill"],
                          token_buckets=plan["batches"], **options)


def benchmark_lora(plan: dict, model_path: str, hbm_gbps: float, base: dict, scratch: str,
                   save, out_of_time=lambda: False) -> dict:
    """The model served with --enable-lora (issue 53): the plan's slots of its rank on every
    module, filled with random PEFT adapters written here (bench_lora.write_adapter: what is
    timed is what the slots and their product cost, not what an adapter says). Decode steps of
    rows with no adapter (the slots' cost alone) and of rows spread over every adapter, each
    beside the model's own step without LoRA at that batch (`base`: its results, measured just
    before in this process)."""
    from bench_lora import write_adapter
    from xlaserve.weights.loader import read_config

    slots, rank = plan["lora"]["slots"], plan["lora"]["rank"]
    config, _ = read_config(model_path, "dummy")
    names = [f"adapter{i}" for i in range(slots)]
    paths = [write_adapter(os.path.join(scratch, "lora", name), config, rank, seed)
             for seed, name in enumerate(names)]
    base_ms = {d["batch"]: d["step_ms"] for d in base.get("decode", []) if "step_ms" in d}
    bench = model_bench(plan, model_path, hbm_gbps, max_loras_per_batch=slots,
                        max_lora_rank=rank, lora_target_modules=["all"],
                        lora_paths=[f"{name}={path}" for name, path in zip(names, paths)])
    try:
        result = {"model": os.path.basename(model_path.rstrip("/")), "slots": slots, "rank": rank,
                  "startup_s": bench.startup_s,
                  "slot_bytes": bench.engine.core.runner.lora.nbytes, "decode": []}
        bench.generate_seconds(bench.prompts(2, 8, 8), 4, names[:2])  # warm the whole path

        def decode(batch, active):
            step = bench.decode_step(batch, plan["input_len"], plan["short"], plan["long"],
                                     adapters=names[:active])
            step["base_step_ms"] = base_ms.get(batch)
            if batch in base_ms:
                step["vs_base"] = base_ms[batch] / step["step_ms"]
            print(f"  LoRA, {active} adapters, batch {batch}: {report.step_text(step)}"
                  f"{report.vs_base_text(step)}", flush=True)
            return step

        for batch in plan["batches"]:
            for active in (0, slots):
                result["decode"].append(figure({"batch": batch, "adapters": active},
                                               lambda: decode(batch, active), out_of_time))
                save()
        return result
    finally:
        bench.close()


def figure(entry: dict, measure, out_of_time) -> dict:
    """`entry` with `measure()`'s figures: skipped once the step's budget is spent, the error
    where it raised (one batch failing, out of memory say, keeps the others)."""
    if out_of_time():
        return {**entry, "skipped": "the step's time budget is spent"}
    try:
        return {**entry, **measure()}
    except Exception as error:
        return {**entry, "error": _describe(error)}


def benchmark_model(plan: dict, name: str, model_path: str, hbm_gbps: float, result: dict,
                    save, out_of_time=lambda: False) -> dict:
    """Fills `result`, which is already in the results, saving after each figure: a run stopped
    mid-model keeps the figures it had, and one batch failing (out of memory, say) keeps the rest."""
    bench = model_bench(plan, model_path, hbm_gbps)
    try:
        result.update(startup_s=bench.startup_s, dtype=np.dtype(bench.dtype).name,
                      weight_bytes_per_step=bench.weight_bytes, server_flags=bench.server_flags())
        bench.generate_seconds(bench.prompts(2, 8, 8), 4)  # warm the whole path once

        def decode(batch):
            step = bench.decode_step(batch, plan["input_len"], plan["short"], plan["long"])
            print(f"  {name} batch {batch}: {report.step_text(step)}", flush=True)
            return step

        def verify(batch):  # speculative decoding's verified rows
            figures = bench.verify_step(batch, plan["input_len"], plan["verify_tokens"])
            print(f"  {name} verify {plan['verify_tokens']} tokens x {batch} rows: "
                  f"{figures['verify_ms']:.2f} ms against a decode step's "
                  f"{figures['decode_ms']:.2f} ms ({figures['verify_over_decode']:.2f}x)",
                  flush=True)
            return figures

        for key, measure, batches in (("decode", decode, plan["batches"]),
                                      ("verify", verify, plan["verify_batches"])):
            result[key] = []
            for batch in batches:
                result[key].append(figure({"batch": batch}, lambda: measure(batch), out_of_time))
                save()
        result["offline"] = figure({}, lambda: bench.offline_throughput(
            max_running=plan["max_running"], **plan["offline"]), out_of_time)
        return result
    finally:
        bench.close()


# --- running, recording, summing up -----------------------------------------------------------

class Run:
    """The results so far, rewritten to --out after every step."""

    def __init__(self, out: str, time_budget_s: float | None, budgets: dict | None = None):
        self.out, self.results = out, {"mode": None}
        self.deadline = time.monotonic() + time_budget_s if time_budget_s else None
        self.budgets = budgets or {}
        self.step_deadline = None

    def out_of_time(self) -> bool:
        """The whole run's budget, or the running step's own, is spent."""
        now = time.monotonic()
        return any(d is not None and now > d for d in (self.deadline, self.step_deadline))

    def step(self, name: str, fn, *args, into: dict | None = None) -> dict:
        """Runs `fn(*args)` guarded; a step named in the budgets gets `out_of_time` as its last
        argument, true once its own share (or the run's) is spent."""
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        if self.out_of_time():
            result = {"skipped": "the time budget is spent (--time-budget-s)"}
        else:
            budget = self.budgets.get(name)
            if budget is not None:
                self.step_deadline = time.monotonic() + budget
                args = (*args, self.out_of_time)
            try:
                result = fn(*args)
            except Exception as error:
                result = {"error": _describe(error), "traceback": traceback.format_exc()[-4000:]}
                print(result["traceback"], file=sys.stderr, flush=True)
            finally:
                self.step_deadline = None
        result["seconds"] = round(time.perf_counter() - start, 1)
        (self.results if into is None else into)[name] = result
        self.save()
        return result

    def save(self) -> None:
        with open(self.out, "w") as f:
            json.dump(self.results, f, indent=1, default=str)


def failures(results, path="") -> list[str]:
    """Where a step raised or a check did not pass."""
    if isinstance(results, list):
        return [f for i, item in enumerate(results) for f in failures(item, f"{path}[{i}]")]
    if not isinstance(results, dict):
        return []
    own = [path] if "error" in results or results.get("passed") is False else []
    return own + [f for key, value in results.items() for f in failures(value, f"{path}/{key}")]


def _describe(error: Exception) -> str:
    """Type and message, cut: a compiler's message can carry a whole IR dump."""
    return f"{type(error).__name__}: {error}"[:2000]


def warm_start(plan: dict, model_path: str, out_of_time=None) -> dict:
    """A second start of a model's engine: its steps load from the executable cache the first
    start wrote. `out_of_time` is unused: one start is the whole step."""
    bench = model_bench(plan, model_path, hbm_gbps=1.0)  # its flags: the first start's
    try:
        return {"model": os.path.basename(model_path.rstrip("/")), "startup_s": bench.startup_s}
    finally:
        bench.close()


def run_steps(run: Run, plan: dict, args, tiny_dir: str) -> None:
    tiny = lib.write_tiny_config(os.path.join(tiny_dir, "tiny"))
    models = [tiny if name == "tiny" else lib.config_dir(name, tiny_dir)
              for name in args.model_configs or plan["models"]]

    run.step("environment", show_environment)
    bandwidth = run.step("bandwidth", measure_bandwidth, plan, args.hbm_gbps)
    hbm = bandwidth.get("hbm_gbps") or args.hbm_gbps or 1.0  # 1.0: a failed measure, figures moot
    run.results["models"] = {}
    for path in models:
        name = "tiny" if path == tiny else os.path.basename(path.rstrip("/"))
        partial = run.results["models"][name] = {}
        run.step(name, benchmark_model, plan, name, path, hbm, partial, run.save,
                 into=run.results["models"])
    if args.lora and models:
        first = os.path.basename(models[0].rstrip("/"))
        run.step("lora", benchmark_lora, plan, models[0], hbm,
                 run.results["models"].get(first, {}), tiny_dir, run.save)
    run.step("attention_correctness", check_attention, plan)
    run.step("latent_attention_correctness", functools.partial(check_attention, latent=True), plan)
    run.step("attention_timing", time_attention, plan, hbm)
    run.step("moe_layer", check_moe_layer, hbm, args.quick, plan["iters"])
    if models:
        run.step("warm_start", warm_start, plan, models[0])
    if args.skip_server:
        run.results["server"] = {"skipped": "--skip-server"}
    else:
        timeout_s = min(plan["server_timeout_s"], plan["budgets"].get("server", float("inf")))
        # The 2-layer model: a first model as big as Llama-3.1-8B does not fit beside this
        # process; in --quick mode it is the first model too, and its steps load from the cache.
        flags = run.results["models"].get("tiny", {}).get("server_flags")
        run.step("server", check_server, tiny, timeout_s, flags)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CPU-sized everything (the test's mode)")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--lora", action="store_true",
                        help="also time the first model served with LoRA adapter slots (issue "
                             "53): a second cold start, ~200 s on an H200, so with one model")
    parser.add_argument("--model-configs", nargs="+", default=None, metavar="NAME_OR_DIR",
                        help="folders of benchmarks/configs or paths to config.json folders "
                             "(default: qwen2.5-0.5b llama-3.1-8b; --quick: a 2-layer model)")
    parser.add_argument("--hbm-gbps", type=float, default=None,
                        help="HBM bandwidth of the roofline (default: H100 3350, H200 4800, "
                             "else the measured device copy)")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="skip the steps that would start after this many seconds "
                             "(default: 540, none with --quick)")
    parser.add_argument("--out", default="accelerator_check.json")
    parser.add_argument("--report-dir", default=None,
                        help="where report.md and steps.svg go (default: --out's folder)")
    args = parser.parse_args(argv)
    plan = PLANS["quick" if args.quick else "full"]
    run = Run(args.out, args.time_budget_s or plan["time_budget_s"], plan["budgets"])
    run.results["mode"] = "quick" if args.quick else "full"
    started = time.perf_counter()
    tiny_dir = tempfile.mkdtemp(prefix="accelerator_check_tiny_")
    try:
        run_steps(run, plan, args, tiny_dir)
    finally:
        shutil.rmtree(tiny_dir, ignore_errors=True)
    run.results["failures"] = failures(run.results)
    run.results["passed"] = not run.results["failures"]
    run.results["elapsed_s"] = round(time.perf_counter() - started, 1)
    run.save()
    report.print_summary(run.results)
    written = report.write_report(run.results,
                                  args.report_dir or os.path.dirname(os.path.abspath(args.out)))
    print(f"report: {', '.join(written)}")
    print(f"\nwritten to {args.out} ({run.results['elapsed_s']:.0f} s)")
    return 0 if run.results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
