"""Is the GPU's ragged_dot cuDNN's grouped matmul or a dense dot over every expert? Compiles
and times it at a MoE layer's shapes (3072 rows, 64 experts of 2048 x 2816, groups of 48),
beside one expert's GEMM of all the rows: `python benchmarks/check_gpu_ragged_dot.py` (on a GPU;
it runs anywhere, and on CPU says what XLA:CPU does). Results: docs/tpu-gpu.md, "Mixtures of
experts"."""
import time

import jax
import jax.numpy as jnp

rows, experts, d_in, d_out = 3072, 64, 2048, 2816
lhs = jnp.ones((rows, d_in), jnp.bfloat16)
rhs = jnp.ones((experts, d_in, d_out), jnp.bfloat16) * 0.01
groups = jnp.full((experts,), rows // experts, jnp.int32)
compiled = jax.jit(jax.lax.ragged_dot).lower(lhs, rhs, groups).compile()
text = compiled.as_text()
print("cudnn custom call:", "cudnn" in text.lower(), "| dense [3072,64,2048]:",
      "[3072,64,2048]" in text, "| custom-call targets:",
      sorted({line.split('custom_call_target="')[1].split('"')[0]
              for line in text.splitlines() if 'custom_call_target="' in line}))
for line in text.splitlines():
    if "ROOT" in line or "custom-call" in line or "dot(" in line or " fusion(" in line:
        print("  ", line.strip()[:220])
out = compiled(lhs, rhs, groups).block_until_ready()
times = []
for _ in range(10):
    start = time.perf_counter()
    compiled(lhs, rhs, groups).block_until_ready()
    times.append(time.perf_counter() - start)
flops = 2 * rows * d_in * d_out
print(f"ragged_dot {min(times) * 1e3:.3f} ms, {flops / min(times) / 1e12:.1f} TFLOP/s "
      f"(grouped work); a dense dot over every expert would be {experts}x the FLOPs")
dense = jax.jit(lambda a, b: a @ b[0]).lower(lhs, rhs).compile()
dense(lhs, rhs).block_until_ready()
start = time.perf_counter()
for _ in range(10):
    dense(lhs, rhs).block_until_ready()
print(f"one expert's dense GEMM of all rows: {(time.perf_counter() - start) / 10 * 1e3:.3f} ms")
