"""Compiles one mixture-of-experts layer's two grouped matmuls for TPU (compile-only: libtpu, no
TPU needed) with both TPU implementations of model/grouped_matmul.py, XLA's `ragged_dot` and
JAX's Pallas megablox `gmm`, and prints what the compiled programs tell.

    python benchmarks/bench_grouped_matmul_tpu.py [--target v6e:2x2] [--tokens 1 16 128 512]
        [--layouts full tp4 ep4]

The shapes are Qwen3-30B-A3B's per device (128 experts, top 8, hidden 2048, expert width 768):
`full` on one device, `tp4` with each expert's width split over 4 (192), `ep4` with the experts
split over 4 (32, full width). gate_up is [M, 2048] x [E, 2048, 2 * width], down [M, width] x
[E, width, 2048], M = 8 x tokens, bfloat16 weights.

Columns: compile seconds (trace, lower, compile; rough where the machine is shared), GFLOP and
GB from `cost_analysis()` with the flops as a multiple of one dense pass over the rows (2 M K N;
G would mean every row times every expert), temporaries (`memory_analysis()`), the largest VMEM
a Mosaic kernel reserves, and what the HLO holds. A Mosaic kernel's flops and bytes are the
estimate it declares, not traffic measured: XLA's ragged_dot declares every expert's weights,
megablox one expert's weights per tile it may visit (M / tm + E - 1).
"""
from __future__ import annotations

import argparse
import re
import time

# Qwen3-30B-A3B per device: (experts, hidden, expert width)
LAYOUTS = {"full": (128, 2048, 768), "tp4": (128, 2048, 192), "ep4": (32, 2048, 768)}
TOP_K = 8
# Entry instructions that are no work of their own.
_BOOKKEEPING = ("parameter(", "constant(", "bitcast(", "get-tuple-element(", "tuple(",
                "PrepareAsyncCall", "AllocateBuffer")


def describe(hlo: str) -> tuple[str, float]:
    """(what the compiled program holds, in a line; the largest VMEM a Mosaic kernel reserves,
    MiB)."""
    entry = hlo[hlo.index("\nENTRY") + 1:].split("\n}")[0].splitlines()[1:]
    work = [line for line in entry if not any(word in line for word in _BOOKKEEPING)]
    kernels = [line for line in work if 'custom_call_target="tpu_custom_call"' in line]
    names = [re.search(r"%([\w.-]+) = ", line).group(1) for line in kernels]
    tiling = re.search(r'ragged_dot_tiling="([^"]+)"', hlo)
    vmem = [int(size) for line in kernels
            for size in re.findall(r'"used_scoped_memory_configs":\[[^]]*"size":"(\d+)"', line)]
    dense = len(re.findall(r"= \S+ (?:dot|convolution)\(", hlo))
    loops = sum(" while(" in line for line in work)
    line = (f"Mosaic {'+'.join(names)}{f' tiles {tiling.group(1)}' if tiling else ''}; "
            f"{len(work) - len(kernels)} other ops ({loops} while), {dense} dense dots")
    return line, max(vmem, default=0) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v6e:2x2")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()

    from xlaserve.runtime.executor import aot

    aot.use_compile_only_packages()  # before JAX starts a backend
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from xlaserve.model.grouped_matmul import (grouped_matmul_megablox, grouped_matmul_ragged_dot,
                                               megablox_tiling)

    implementations = {"ragged_dot": grouped_matmul_ragged_dot, "megablox": grouped_matmul_megablox}
    _, devices = aot.target_devices(args.target)
    mesh = Mesh(np.array(devices[:1]), ("device",))  # the shapes are per device
    print(f"{args.target} ({devices[0].device_kind}), top {TOP_K}, bfloat16")
    print(f"{'layout':>6} {'matmul':>7} {'M':>5} {'impl':>10} {'compile s':>9} {'GFLOP':>7} "
          f"{'x2MKN':>5} {'GB':>6} {'temp MiB':>8} {'VMEM MiB':>8}  HLO")
    for layout in args.layouts:
        experts, hidden, width = LAYOUTS[layout]
        for matmul, (k, n) in {"gate_up": (hidden, 2 * width), "down": (width, hidden)}.items():
            for tokens in args.tokens:
                rows = TOP_K * tokens
                shapes = (aot.abstract((rows, k), jnp.bfloat16, mesh),
                          aot.abstract((experts, k, n), jnp.bfloat16, mesh),
                          aot.abstract((experts,), jnp.int32, mesh))
                for name, implementation in implementations.items():
                    start = time.perf_counter()
                    with jax.set_mesh(mesh):
                        compiled = jax.jit(implementation).trace(*shapes).lower().compile()
                    seconds = time.perf_counter() - start
                    cost = compiled.cost_analysis()
                    hlo, vmem = describe(compiled.as_text())
                    if name == "megablox":
                        hlo += f"; gmm tiles {','.join(map(str, megablox_tiling(rows, k, n)))}"
                    print(f"{layout:>6} {matmul:>7} {rows:>5} {name:>10} {seconds:>9.1f} "
                          f"{cost['flops'] / 1e9:>7.2f} {cost['flops'] / (2 * rows * k * n):>5.2f} "
                          f"{cost['bytes accessed'] / 1e9:>6.3f} "
                          f"{compiled.memory_analysis().temp_size_in_bytes / 2**20:>8.2f} "
                          f"{vmem:>8.1f}  {hlo}", flush=True)


if __name__ == "__main__":
    main()
