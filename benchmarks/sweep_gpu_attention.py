"""The Pallas GPU attention kernel's launch parameters, timed on a GPU: which split-KV count,
warps per program, pipeline depth and KV block give the fastest call on Llama-3.1-8B's heads
(32 q / 8 kv, head dim 128, bfloat16, 16-token pages), per batch shape. Each variant is checked
against the reference (max abs error) before it is timed.

    python benchmarks/sweep_gpu_attention.py [--out sweep.json] [--time-budget-s 170]
    python benchmarks/sweep_gpu_attention.py --quick          # CPU, interpreted: for a test
    python benchmarks/sweep_gpu_attention.py --profile-case decode_256x256   # run for ncu
    python benchmarks/sweep_gpu_attention.py --heads qwen2.5-0.5b --cases decode_256x256 --stage-one-only

A call is timed as the model step runs it, inside one compiled program: `unroll` calls in one
jit, the cache threaded through (donated), dispatched `repeats` times without waiting
(bench_attention.device_seconds), so host dispatch hides behind the device and the figure is
device time per call: the kernel and its jnp bookkeeping (the K/V scatter, the query gather,
the output scatter, a split merge; the metadata, the same in every call, XLA may compute once).
Stage one tries split counts x warps at the default pipeline and block; stage two, at the best
of those, KV blocks x pipeline depths. Every case has its share of the time budget; the JSON
is rewritten after every variant, so a run cut short keeps what it timed.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_attention  # noqa: E402
from xlaserve.pallas_kernels.ragged_paged_attention import kernel_gpu, reference  # noqa: E402

LLAMA_HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
# --heads: whose attention is swept (Qwen2.5-0.5B: 2 kv heads, so a decode grid has a quarter of
# Llama's programs at the same rows, and the split-KV rule splits where Llama's does not).
HEADS = {"llama-3.1-8b": LLAMA_HEADS,
         "qwen2.5-0.5b": dict(num_q_heads=14, num_kv_heads=2, head_dim=64)}
# name -> (seqs, new tokens each, kv length); first the ones a serving step meets most.
CASES = {
    "decode_256x256": (256, 1, 256),   # accelerator_check's offline run: 256 rows, short context
    "decode_1x4096": (1, 1, 4096),     # batch-1 latency at a long context (split KV)
    "decode_64x1024": (64, 1, 1024),   # bench_attention's decode batch
    "decode_8x4096": (8, 1, 4096),
    "prefill_8x512": (8, 512, 512),
}
QUICK_CASES = {"decode_2x64": (2, 1, 64), "prefill_2x32": (2, 32, 32)}
QUICK_HEADS = dict(num_q_heads=4, num_kv_heads=2, head_dim=16)


def timed_call(batch: dict, params: dict, *, unroll: int, repeats: int, interpret: bool):
    """(seconds per call, output of one call) for the kernel with `params`."""
    fn = functools.partial(kernel_gpu.ragged_paged_attention, sm_scale=0.1, interpret=interpret,
                           **params)
    rest = {k: v for k, v in batch.items() if k != "kv_cache"}

    @functools.partial(jax.jit, donate_argnums=0)
    def calls(cache, rest):
        # Every call's output is returned: an unused one would let XLA drop that call's kernel
        # (a first version returned only the last and timed 1 kernel per `unroll` calls).
        outs = []
        for _ in range(unroll):
            out, cache = fn(kv_cache=cache, **rest)
            outs.append(out)
        return outs, cache

    state = {"cache": jnp.copy(batch["kv_cache"])}
    outs, state["cache"] = calls(state["cache"], rest)  # the compile; the output checked below
    first = np.asarray(outs[0].astype(jnp.float32))

    def dispatch():
        outs, state["cache"] = calls(state["cache"], rest)
        return outs, state["cache"]

    return bench_attention.device_seconds(dispatch, repeats) / unroll, first


def reference_output(batch: dict) -> np.ndarray:
    with jax.default_matmul_precision("highest"):
        up = {k: v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v
              for k, v in batch.items()}
        out, _ = reference.ragged_paged_attention(**up, sm_scale=0.1)
    return np.asarray(out)


def stage_one(shape: tuple, default_splits: int | None, num_blocks: int, quick: bool) -> list[dict]:
    """The first variant is the kernel's default."""
    warps = [4] if quick else [4, 8]
    if shape[1] > 1:  # prefill: the item size, not split KV, is the knob
        q_blocks = [None, 16] if quick else [None, 8, 16, 32]
        return [dict(q_block=q, num_warps=w) for q in q_blocks for w in warps]
    splits = [default_splits] + [s for s in ([1, 2] if quick else [1, 2, 4, 8, 16])
                                 if s != default_splits and s <= num_blocks]
    # And the default with one-token items' q, output and new K/V through XLA (the form before
    # the kernel did them itself, 2026-11-27): the same call, both ways, on one machine.
    return ([dict(num_kv_splits=s, num_warps=w) for s in splits for w in warps]
            + [dict(num_kv_splits=default_splits, num_warps=4, decode_io_in_kernel=False)])


def stage_two(best: dict, quick: bool) -> list[dict]:
    pages, stages = ([4], [1, 2]) if quick else ([2, 4, 8], [2, 3, 4])
    return [{**best, "kv_block_pages": p, "num_stages": s}
            for p, s in itertools.product(pages, stages)]


def run_case(name, shape, heads, page_size, dtype, args, deadline, save, result):
    batch = bench_attention.make_batch(*shape, page_size=page_size, dtype=dtype, **heads)
    nbytes, _ = bench_attention.traffic_and_flops(*shape, itemsize=dtype.itemsize, **heads)
    want = reference_output(batch)
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    pages_per_seq = -(-shape[2] // page_size)
    block_pages = kernel_gpu.default_kv_block_pages(page_size, pages_per_seq)
    num_blocks = -(-pages_per_seq // block_pages)
    # What the kernel picks for a decode batch (one item a row); a prefill's items depend on
    # q_block, and its knob is q_block, not the splits.
    default_splits = (kernel_gpu.default_num_kv_splits(shape[0], heads["num_kv_heads"], num_blocks)
                      if shape[1] == 1 else None)
    first = stage_one(shape, default_splits, num_blocks, args.quick)
    result.update(shape=list(shape), bytes=nbytes, default_params=first[0], variants=[])
    seen = set()

    def try_variant(params):
        key = json.dumps(params, sort_keys=True)
        if key in seen:
            return
        seen.add(key)
        if time.monotonic() > deadline:
            result["variants"].append({"params": params, "skipped": "the case's budget is spent"})
            return
        row = {"params": params}
        try:
            seconds, got = timed_call(batch, {k: v for k, v in params.items() if v is not None},
                                      unroll=args.unroll, repeats=args.repeats,
                                      interpret=args.interpret)
            error = float(np.max(np.abs(got - want)))
            row.update(us=seconds * 1e6, gb_s=nbytes / seconds / 1e9, max_abs_error=error,
                       correct=bool(error <= tolerance))
        except Exception as error:  # a variant Triton refuses (shared memory) is a result
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        result["variants"].append(row)
        save()
        print(f"  {name:<16} {json.dumps(params):<70} " + (
            f"{row['us']:9.1f} us {row['gb_s']:7.0f} GB/s err {row['max_abs_error']:.1e}"
            if "us" in row else row.get("error", row.get("skipped", ""))), flush=True)

    for params in first:
        try_variant(params)
    timed = [r for r in result["variants"] if r.get("correct")]
    if timed and not args.stage_one_only:
        best = min(timed, key=lambda r: r["us"])["params"]
        for params in stage_two(best, args.quick):
            try_variant(params)


def profile_case(name: str, heads: dict, page_size: int, dtype) -> None:
    """The default variant of one case, 5 calls after a warm one: a short program for ncu."""
    batch = bench_attention.make_batch(*CASES[name], page_size=page_size, dtype=dtype, **heads)
    timed_call(batch, {}, unroll=1, repeats=1, interpret=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="sweep_gpu_attention.json")
    parser.add_argument("--time-budget-s", type=float, default=170)
    parser.add_argument("--cases", nargs="+", default=None, help=f"of {list(CASES)}")
    parser.add_argument("--quick", action="store_true", help="tiny cases, interpreted (CPU)")
    parser.add_argument("--profile-case", default=None, help="run one case's default for ncu")
    parser.add_argument("--heads", default="llama-3.1-8b", choices=list(HEADS))
    parser.add_argument("--stage-one-only", action="store_true",
                        help="split counts x warps only (no KV block / pipeline depth stage)")
    args = parser.parse_args()
    args.interpret = args.quick or jax.default_backend() != "gpu"
    args.unroll, args.repeats = (1, 1) if args.quick else (4, 10)
    heads, cases = (QUICK_HEADS, QUICK_CASES) if args.quick else (HEADS[args.heads], CASES)
    dtype, page_size = jnp.dtype(jnp.float32 if args.quick else jnp.bfloat16), 16
    if args.profile_case:
        return profile_case(args.profile_case, heads, page_size, dtype)
    names = args.cases or list(cases)
    results = {"device": jax.devices()[0].device_kind, "heads": heads, "dtype": dtype.name,
               "page_size": page_size, "unroll": args.unroll, "repeats": args.repeats, "cases": {}}

    def save():
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    start = time.monotonic()
    for i, name in enumerate(names):
        share = (args.time_budget_s - (time.monotonic() - start)) / (len(names) - i)
        results["cases"][name] = {}
        run_case(name, cases[name], heads, page_size, dtype, args, time.monotonic() + share, save,
                 results["cases"][name])
    print(f"\n{'case':<16} {'default':>22} {'best':>10}  best params")
    for name, case in results["cases"].items():
        timed = [r for r in case["variants"] if r.get("correct")]
        if not timed:
            print(f"{name:<16} no correct variant timed")
            continue
        default = next((r for r in timed if r["params"] == case["default_params"]), None)
        best = min(timed, key=lambda r: r["us"])
        shown = f"{default['us']:8.1f} us {default['gb_s']:6.0f} GB/s" if default else "-"
        print(f"{name:<16} {shown:>22} {best['us']:7.1f} us  {json.dumps(best['params'])} "
              f"{best['gb_s']:.0f} GB/s")
    wrong = [(n, r["params"]) for n, c in results["cases"].items() for r in c["variants"]
             if r.get("correct") is False]
    print(f"incorrect variants: {wrong}" if wrong else "every timed variant matched the reference")
    save()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
