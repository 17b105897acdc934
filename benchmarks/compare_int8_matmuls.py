"""Weight-only int8 against W8A8 for one matmul, compiled for H100 and TPU v6e (issue 32, item 3):
which int8 formulation should a step's matmuls use on each accelerator, from the compiled
programs (no accelerator is used: runtime/executor/aot.py's compile-only targets).

    .venv/bin/python benchmarks/compare_int8_matmuls.py
    .venv/bin/python benchmarks/compare_int8_matmuls.py --tokens 8,256 --targets h100

Formulations of y = x [T, K] @ W [K, N], x bfloat16, float32 out:
- bf16: the float weight, the baseline.
- int8 (weight-only, `--quantization int8` today): layers.linear's own Int8Matrix branch, the int8
  values converted to bfloat16 inside the dot, the float32 result scaled per column.
- w8a8: x quantized per row (token) to int8 as it runs (scale max |row| / 127, rounded to
  nearest), an int8 x int8 dot accumulating in int32, scaled by the row scale x the column scale.
  The same int8 values and column scales as `int8`: one quantized weight serves both.
- w8a8nk: w8a8 with the weight stored [N, K] (K contiguous), as fp8_weights.py stores FP8's.
Per (target, matmul shape, T): flops and bytes accessed (XLA's cost analysis; the deviceless GPU
executable has none, so predict_accelerators.xla_costs runs the CPU client's analysis on its
optimised HLO), temp bytes (memory analysis), the operand types the optimised HLO's dots really
multiply ("bf16<-s8": an int8 operand converted inside the kernel), the kernel each dot is in, and
predicted time = max(bytes / HBM bandwidth, flops / peak), the peak int8's where both operands
of every dot are s8. The numerics table (CPU, real values) gives each formulation's error.
These are predictions from compiled programs, not measurements; the GPU's GEMM tiling is XLA's
default there, not an autotuned one (deviceless compiles cannot autotune), and the cost analysis
does not price a transpose inside a kernel. On H100 the row scales do not fuse into the GEMM
(fp8_weights.fp8_matmul says the same): here, the program's last op, they cost a pass over the
float32 output (T x N x 4 bytes written and read again); in a model step they fuse into the
consumer.
"""
from __future__ import annotations

import argparse
import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, run as a script

from benchmarks.predict_accelerators import xla_costs  # noqa: E402
from xlaserve.runtime.executor import aot  # noqa: E402
from xlaserve.model import layers  # noqa: E402
from xlaserve.model.weight_types.int8 import INT8_MAX, Int8Matrix, quantize  # noqa: E402

# Data sheets, dense: (HBM bytes/s, bf16 FLOP/s, int8 OP/s). H100 SXM5: 3.35 TB/s, 989 TFLOP/s,
# 1979 TOPS; TPU v6e per chip: 1638 GB/s, 918 TFLOP/s, 1836 TOPS.
PEAKS = {"h100": (3.35e12, 989e12, 1979e12), "v6e": (1.638e12, 918e12, 1836e12)}
# The compile-only topology each target's one device comes from (libtpu refuses v6e:1x1).
TOPOLOGY = {"h100": "h100", "v6e": "v6e:2x2"}
# Llama-3.1-8B's largest matmuls: gate_up (4096 -> 2 x 14336) and down (14336 -> 4096).
SHAPES = [(4096, 28672), (14336, 4096)]


def bf16(x, weight, _scales):
    return jax.lax.dot_general(x, weight, (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)


def weight_only(x, values, scales):
    """layers.linear on an Int8Matrix: the serving code's own int8 matmul."""
    return layers.linear(x, Int8Matrix(values, scales, "bfloat16"), kernels=None)


def quantize_rows(x):
    """x [T, K] -> (int8 [T, K], float32 [T]): each row divided by max |row| / 127 (1 for a row of
    zeros), rounded to nearest."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=1)
    row_scales = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    x_int8 = jnp.clip(jnp.round(x32 / row_scales[:, None]), -INT8_MAX, INT8_MAX)
    return x_int8.astype(jnp.int8), row_scales


def w8a8(x, values, scales, weight_k_axis: int):
    """x quantized per row, int8 x int8 into int32, both scales after. `weight_k_axis` 1: the
    weight is stored [N, K], K contiguous (Hopper's 8-bit tensor-core MMA takes both operands
    K-major, fp8_weights.py stores FP8 values so; a [K, N] one is transposed inside the GEMM)."""
    x_int8, row_scales = quantize_rows(x)
    y = jax.lax.dot_general(x_int8, values, (((1,), (weight_k_axis,)), ((), ())),
                            preferred_element_type=jnp.int32)
    return y.astype(jnp.float32) * scales * row_scales[:, None]


# name: (function, weight dtype, weight stored [N, K] instead of [K, N])
FORMULATIONS = {"bf16": (bf16, "bfloat16", False), "int8": (weight_only, "int8", False),
                "w8a8": (functools.partial(w8a8, weight_k_axis=0), "int8", False),
                "w8a8nk": (functools.partial(w8a8, weight_k_axis=1), "int8", True)}
# A program of one matmul whose weight fits the TPU's on-chip memory gets it prefetched there
# across runs ("cross-program prefetch": the cost analysis then charged the 58.7 MB int8 down
# weight 5 times, 294 MB); a step of 32 layers cannot keep its weights so, hence off.
TPU_OPTIONS = {"xla_max_cross_program_prefetches": 0}


def hlo_dots(hlo: str) -> list[tuple[str, str]]:
    """(operand types, kernel) of every dot and convolution in an optimised module. An operand
    made by a convert inside the kernel reads "bf16<-s8", one transposed inside it "s8^T" (on
    H100 the int8 [K, N] weight is: the tensor cores take 8-bit operands K-major); the kernel is
    the fusion's kind (GPU: the Triton GEMM emitter's name) or "fusion"/"unfused" on TPU."""
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    made_by = r"%([\w.\-]+) = \w+\[[^\]]*\]\S* {}\(%([\w.\-]+)\)"
    converts = dict(re.findall(made_by.format("convert"), hlo))
    transposes = dict(re.findall(made_by.format("transpose"), hlo))
    callers = {}
    for line in hlo.splitlines():
        called = re.search(r" fusion\(.*?calls=%([\w.\-]+)", line)
        if called:
            kind = re.search(r'"kind":"([^"]+)"', line)
            callers[called.group(1)] = kind.group(1) if kind else "fusion"
    found = []
    for block in re.split(r"\n(?=(?:ENTRY )?%[\w.\-]+ \()", hlo):
        name = re.match(r"(?:ENTRY )?%([\w.\-]+) \(", block)
        kernel = callers.get(name.group(1), "unfused") if name else "unfused"
        for operands in re.findall(r" (?:dot|convolution)\(%([\w.\-]+), %([\w.\-]+)\)", block):
            described = []
            for operand in operands:
                source = converts.get(operand)
                described.append(f"{types.get(operand)}<-{types.get(source)}" if source
                                 else f"{types.get(operand)}^T" if operand in transposes
                                 else types.get(operand, "?"))
            found.append((" x ".join(described), kernel))
    return found


def compile_one(target: str, formulation: str, tokens: int, k: int, n: int):
    """The compiled matmul on the target's first device."""
    _, devices = aot.target_devices(TOPOLOGY[target])
    replicated = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), P())
    fn, weight_dtype, n_k = FORMULATIONS[formulation]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in
            (((tokens, k), jnp.bfloat16), ((n, k) if n_k else (k, n), weight_dtype),
             ((n,), jnp.float32))]
    options = TPU_OPTIONS if devices[0].platform == "tpu" else {}
    return jax.jit(fn).trace(*args).lower().compile(compiler_options=options)


def predict(target: str, formulation: str, tokens: int, k: int, n: int) -> dict:
    compiled = compile_one(target, formulation, tokens, k, n)
    dots = hlo_dots(compiled.as_text())
    costs = xla_costs(compiled)
    bandwidth, bf16_peak, int8_peak = PEAKS[target]
    int8_dots = bool(dots) and all(re.fullmatch(r"s8(\^T)? x s8(\^T)?", types) for types, _ in dots)
    peak = int8_peak if int8_dots else bf16_peak
    seconds = max(costs["bytes"] / bandwidth, costs["flops"] / peak)
    return {"target": target, "formulation": formulation, "tokens": tokens, "k": k, "n": n,
            **costs, "temp": compiled.memory_analysis().temp_size_in_bytes, "dots": dots,
            "seconds": seconds,
            "bound": "memory" if costs["bytes"] / bandwidth >= costs["flops"] / peak else "compute"}


def relative_errors(tokens: int = 64, k: int = 4096, n: int = 1024, seed: int = 0) -> dict:
    """||y - y_exact|| / ||y_exact|| of each formulation on the CPU, against the float32 product of
    the same bfloat16 x and float weight, for Gaussian activations and for activations with a few
    outlier channels (20x, as LLM hidden states have: the row's int8 step grows with its max)."""
    rng = np.random.default_rng(seed)
    weight = jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.bfloat16)
    int8 = quantize(weight, 1, jnp.bfloat16)
    plain = rng.standard_normal((tokens, k))
    outliers = plain.copy()
    outliers[:, rng.choice(k, 8, replace=False)] *= 20
    errors = {}
    for name, x in (("gaussian", plain), ("outliers", outliers)):
        x = jnp.asarray(x, jnp.bfloat16)
        exact = np.asarray(x, np.float32) @ np.asarray(weight, np.float32)
        for formulation, (fn, _, n_k) in FORMULATIONS.items():
            w = weight if formulation == "bf16" else int8.values.T if n_k else int8.values
            y = np.asarray(jax.jit(fn)(x, w, int8.scales))
            errors[(name, formulation)] = np.linalg.norm(y - exact) / np.linalg.norm(exact)
    return errors


def print_table(rows) -> None:
    print("\nPredicted from compiled programs (not measured); one device; "
          "time = max(bytes / HBM, flops / peak), the int8 peak where every dot is s8 x s8")
    print(f"{'target':<7}{'K x N':>12}{'T':>6} {'form':<7}{'GFLOP':>8}{'MB':>9}{'temp MB':>9}"
          f"{'us':>9} {'bound':<8}{'vs bf16':>8}  dots (operand types, kernel)")
    base = {}
    for r in rows:
        key = (r["target"], r["k"], r["n"], r["tokens"])
        if r["formulation"] == "bf16":
            base[key] = r["seconds"]
        speedup = f"{base[key] / r['seconds']:.2f}x" if key in base else ""
        dots = "; ".join(f"{types} ({kernel})" for types, kernel in r["dots"])
        print(f"{r['target']:<7}{r['k']:>6}x{r['n']:<5}{r['tokens']:>6} {r['formulation']:<7}"
              f"{r['flops'] / 1e9:>8.1f}{r['bytes'] / 1e6:>9.1f}{r['temp'] / 1e6:>9.1f}"
              f"{r['seconds'] * 1e6:>9.1f} {r['bound']:<8}{speedup:>8}  {dots}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="v6e,h100", help=f"of {','.join(PEAKS)}")
    parser.add_argument("--tokens", default="8,256,4096", help="rows of x (T) to compile")
    parser.add_argument("--no-numerics", action="store_true", help="skip the CPU error table")
    args = parser.parse_args(argv)
    targets = args.targets.split(",")
    unknown = [t for t in targets if t not in PEAKS]
    if unknown:
        parser.error(f"unknown target(s) {unknown}; known: {', '.join(PEAKS)}")
    aot.use_compile_only_packages()
    rows = []
    for target in targets:
        try:
            aot.target_devices(TOPOLOGY[target])
        except aot.TargetUnavailable as error:
            print(f"{target}: {error}", file=sys.stderr)
            continue
        for k, n in SHAPES:
            for tokens in (int(t) for t in args.tokens.split(",")):
                rows += [predict(target, f, tokens, k, n) for f in FORMULATIONS]
    print_table(rows)
    if not args.no_numerics:
        print("\nRelative error against the float32 product (CPU, x 64 x 4096 bfloat16, "
              "W 4096 x 1024 ~ N(0, 0.02)):")
        for (activations, formulation), error in relative_errors().items():
            print(f"  {activations:<9} {formulation:<7} {error:.2e}")


if __name__ == "__main__":
    main()
