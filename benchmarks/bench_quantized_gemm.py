"""Times the CPU matmul over quantized weights (native/quantized_gemm_cpu.cc) side by side with the
packed float GEMM (native/gemm_cpu.cc) on bfloat16 and float32 panels, on the same shapes.

    python benchmarks/bench_quantized_gemm.py [--shapes 2048x8192 8192x2048 576x1536 1536x576]
        [--rows 1 8 64 256] [--formats q8_0 q4_0 q5_0 q5_1 q4_k q6_k i8_row] [--iters 5]
        [--runs 5]

A shape is KxN (y [M, N] = x [M, K] @ W.T): a Llama-3.2-1B-ish MLP's two matmuls, and the
embedded default model's (SmolLM2-135M: hidden 576, intermediate 1536). Each run times every
implementation in turn (so that a noisy machine moves them together); the figure is the median
over runs of the mean of `iters` calls. Columns: milliseconds, GB/s of weight bytes read (the
figure that matters at M = 1, where a matmul streams its weight once), GFLOP/s (2MNK / time: the
one that matters at large M), and speed relative to bfloat16 panels (bf16's time over this one's:
above 1 is faster). A format whose block does not divide K (the K-quants' 256 at K = 576) is left
out, as llama.cpp's files store such tensors in another format (Q5_0 in a Q4_K_M file, Q5_1 in a
Q5_K_M one).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.native import gemm_cpu
from xlaserve.native import quantized_gemm_cpu as quantized


def cpu_description() -> str:
    """lscpu's model name, the vector extensions that matter here, and the cores JAX sees."""
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    except OSError:
        lines = []
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    flags = fields.get("Flags", "").split()
    wanted = ["avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "asimd"]
    return (f"{fields.get('Model name', 'unknown CPU').strip()}; flags: "
            f"{' '.join(f for f in wanted if f in flags) or 'none of ' + ' '.join(wanted)}; "
            f"{fields.get('CPU(s)', '?').strip()} CPUs")


def implementations(k: int, n: int, formats: list[str], rng) -> dict:
    """name -> (jitted f(x), weight bytes) for a KxN weight in every layout."""
    dense = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32) * 0.02)
    out = {}
    for name, dtype in (("bf16", jnp.bfloat16), ("f32", jnp.float32)):
        weight = dense.astype(dtype)
        pairs = gemm_cpu.uses_bf16_pairs(weight.dtype, k)
        packed = gemm_cpu.pack_columns(weight, pairs)
        call = jax.jit(lambda x, w, p=pairs: gemm_cpu.packed_matmul(x, w, n, bf16_pairs=p))
        out[name + (" (pairs)" if pairs else "")] = (
            lambda x, call=call, w=packed: call(x, w), weight.nbytes)
    for fmt in formats:
        block = quantized.FORMATS[fmt][0]
        if k % block:
            continue
        rows = jnp.asarray(quantized.random_rows(fmt, n, k, rng))
        call = jax.jit(lambda x, w, f=fmt: quantized.quantized_matmul(x, w, fmt=f, k=k))
        out[fmt] = (lambda x, call=call, w=rows: call(x, w), rows.nbytes)
    return out


def time_call(call, x, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        y = call(x)
    y.block_until_ready()
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["2048x8192", "8192x2048", "576x1536",
                                                         "1536x576"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--formats", nargs="+", choices=list(quantized.FORMATS),
                        default=["q8_0", "q4_0", "q5_0", "q5_1", "q4_k", "q6_k", "i8_row"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    print(cpu_description())
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; panel width "
          f"{gemm_cpu.panel_width()}, bf16 pairs {gemm_cpu.bf16_pairs_supported()}")
    print(f"{'K x N':>11} {'M':>4} {'weights':<12} {'ms':>8} {'GB/s':>7} {'GFLOP/s':>8} "
          f"{'vs bf16':>7}")
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        impls = implementations(k, n, args.formats, rng)
        for m in args.rows:
            x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            for call, _ in impls.values():
                call(x).block_until_ready()  # compile
            times = {name: [] for name in impls}
            for _ in range(args.runs):
                for name, (call, _) in impls.items():
                    times[name].append(time_call(call, x, args.iters))
            medians = {name: statistics.median(t) for name, t in times.items()}
            bf16 = next(t for name, t in medians.items() if name.startswith("bf16"))
            for name, seconds in medians.items():
                print(f"{shape:>11} {m:>4} {name:<12} {seconds * 1e3:8.3f} "
                      f"{impls[name][1] / seconds / 1e9:7.1f} {2 * m * n * k / seconds / 1e9:8.1f} "
                      f"{bf16 / seconds:7.2f}")


if __name__ == "__main__":
    main()
