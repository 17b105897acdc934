"""The experts' grouped matmul on this device against XLA's ragged_dot and against its floor: a
step of the one device run (benchmarks/accelerator_check.py, "moe_layer") and its own command.

    PYTHONPATH=$PWD python benchmarks/moe_layer_check.py            # on a GPU: Qwen3-30B-A3B's
    PYTHONPATH=$PWD python benchmarks/moe_layer_check.py --quick    # CPU: tiny, interpreted

For each case (a layer's gate_up and down at a decode batch of 1, 32 and 256 rows, Qwen3-30B-A3B's
128 experts of 2048 x 1536 and 768 x 2048, top 8, a uniform random routing): the largest
difference from ragged_dot in float32 over the output's largest value (pass: under 1e-2 in
bfloat16), the kernel's time, and its floor, the routed experts' weights read once at the
roofline's HBM bandwidth (the issue's goal: within 2x of it). On a GPU the kernel is
pallas_kernels/grouped_matmul_gpu.py as the server runs it; on a CPU (`--quick`) the same kernel
in interpret mode, for the test (its time means nothing there).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from xlaserve.pallas_kernels import grouped_matmul_gpu as gpu  # noqa: E402

# (name, tokens, experts, top k, hidden, moe intermediate): Qwen3-30B-A3B, and a CPU-sized one.
FULL = [("qwen3-30b-a3b", tokens, 128, 8, 2048, 768) for tokens in (1, 32, 256)]
QUICK = [("tiny", tokens, 8, 2, 64, 32) for tokens in (1, 8)]
TOLERANCE = 1e-2  # bfloat16 inputs, float32 accumulation in both: the order of the sums differs


def routed_sizes(rng, tokens: int, experts: int, top_k: int) -> np.ndarray:
    """Group sizes of `tokens` tokens each routed to `top_k` distinct experts, uniformly."""
    picks = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    return np.bincount(picks.reshape(-1), minlength=experts).astype(np.int32)


def timed(fn, *args, iters: int) -> float:
    """Seconds of the fastest of `iters` calls, each waited for (a call is ~0.1-1 ms: the wait
    is small beside it, and a kernel's own time is what the floor compares)."""
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def check_moe_layer(hbm_gbps: float, quick: bool = False, iters: int = 20,
                    out_of_time=lambda: False) -> dict:
    """The cases' rows (module docstring); `passed` when every kernel output matched."""
    interpret = jax.default_backend() != "gpu"
    kernel = jax.jit(lambda x, w, sizes: gpu.grouped_matmul_gpu(x, w, sizes, interpret=interpret))
    reference = jax.jit(lambda x, w, sizes: jax.lax.ragged_dot(
        x, w, sizes, preferred_element_type=jnp.float32))
    rng = np.random.default_rng(0)
    rows = []
    for name, tokens, experts, top_k, hidden, intermediate in (QUICK if quick else FULL):
        sizes = routed_sizes(rng, tokens, experts, top_k)
        for projection, k, n in (("gate_up", hidden, 2 * intermediate),
                                 ("down", intermediate, hidden)):
            if out_of_time():
                rows.append({"model": name, "tokens": tokens, "projection": projection,
                             "skipped": "the step's time budget is spent"})
                continue
            key_x, key_w = jax.random.split(jax.random.key(len(rows)))
            x = jax.random.normal(key_x, (tokens * top_k, k), jnp.bfloat16)
            w = (jax.random.normal(key_w, (experts, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
            got, want = kernel(x, w, sizes), reference(x, w, sizes)
            error = float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))
            routed_experts = int(np.sum(sizes > 0))
            floor_s = routed_experts * k * n * 2 / (hbm_gbps * 1e9)
            seconds = timed(kernel, x, w, sizes, iters=iters)
            reference_s = timed(reference, x, w, sizes, iters=iters)
            rows.append({"model": name, "tokens": tokens, "projection": projection,
                         "rows": tokens * top_k, "experts": experts, "k": k, "n": n,
                         "routed_experts": routed_experts, "relative_error": error,
                         "passed": bool(error < TOLERANCE), "ms": seconds * 1e3,
                         "floor_ms": floor_s * 1e3, "of_floor": seconds / floor_s,
                         "ragged_dot_ms": reference_s * 1e3, "interpreted": interpret})
            print(f"  moe {name} {tokens} tokens {projection}: {seconds * 1e3:.3f} ms, "
                  f"{seconds / floor_s:.2f}x its floor ({floor_s * 1e3:.3f} ms, {routed_experts} "
                  f"experts), ragged_dot {reference_s * 1e3:.3f} ms, error {error:.1e}",
                  flush=True)
    return {"rows": rows, "passed": all(r.get("passed", True) for r in rows)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU-sized, interpreted")
    parser.add_argument("--hbm-gbps", type=float, default=3350.0,
                        help="the floor's bandwidth (default: an H100 SXM's 3350)")
    args = parser.parse_args(argv)
    print(json.dumps(check_moe_layer(args.hbm_gbps, args.quick), indent=1))


if __name__ == "__main__":
    main()
