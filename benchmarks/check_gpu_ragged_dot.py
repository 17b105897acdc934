"""Is the GPU's ragged_dot cuDNN's grouped matmul or a dense dot over every expert? Compiles
and times it at a MoE layer's shapes (3072 rows, 64 experts of 2048 x 2816, groups of 48),
beside one expert's GEMM of all the rows: `python benchmarks/check_gpu_ragged_dot.py` (on a GPU;
it runs anywhere, and on CPU says what XLA:CPU does). Results: docs/tpu-gpu.md, "Mixtures of
experts" (2026-11-26, H100: a dense dot, 2.96 ms against 0.22 ms for one expert's GEMM).

Then, on a Hopper GPU, the candidate replacement: JAX's Mosaic GPU grouped matmul
(`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`, WGMMA), checked against ragged_dot on
uneven groups (some empty) and timed at the same shapes and block sizes, to decide whether
`Kernels.grouped_matmul` takes it on H100s.

And on any GPU, the grouped matmul the server runs there (pallas_kernels/grouped_matmul_gpu.py,
Triton), checked against ragged_dot on the same uneven groups and timed at its own tiles and two
others, at the shapes above and at Qwen3-30B-A3B's gate_up for batch 1 and a 256-row decode
(routing uniform), each beside its floor: the routed experts' weights read once at the
roofline's bandwidth (the device kind's published HBM figure, else the measured copy); gate_up's
product with the SwiGLU fused (the server's on GPU) against its two steps, the few-row
candidates at batch 1 (wider tiles, K split: FEW_ROWS_VARIANTS), and the MXFP4 experts' kernel
(pallas_kernels/grouped_matmul_mxfp4.py, `--quantization mxfp4`) against ragged_dot on the decoded
experts and beside the bf16 kernel on them, at Qwen3-30B-A3B's and gpt-oss-20b's shapes. Needs the
checkout importable (PYTHONPATH=$PWD)."""
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

if jax.devices()[0].device_kind.startswith("NVIDIA H"):
    import functools

    import numpy as np
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    key_x, key_w = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (rows, d_in), jnp.bfloat16)
    w = (jax.random.normal(key_w, (experts, d_in, d_out), jnp.float32) * 0.02).astype(jnp.bfloat16)
    # An empty group, a big one and a single row, the other rows spread over the rest.
    rest = rows - rows // 8 - 1
    spread = np.random.default_rng(0).multinomial(rest, np.ones(experts - 3) / (experts - 3))
    uneven = jnp.asarray(np.concatenate([[0, rows // 8, 1], spread]), jnp.int32)
    want = jax.jit(functools.partial(jax.lax.ragged_dot, preferred_element_type=jnp.float32))(
        x, w, uneven)
    for block_m, block_n, block_k, steps in [(128, 128, 64, 4), (64, 128, 64, 4),
                                             (128, 256, 64, 3)]:
        mgpu = jax.jit(functools.partial(
            ragged_dot_mgpu.ragged_dot, block_m=block_m, block_n=block_n, block_k=block_k,
            max_concurrent_steps=steps, grid_block_n=1))
        try:
            got = mgpu(x, w, group_sizes=uneven).block_until_ready()
        except Exception as error:  # noqa: BLE001 - a report, whatever failed
            print(f"mosaic gpu ragged_dot {block_m}x{block_n}x{block_k}: failed: "
                  f"{str(error).splitlines()[0][:200]}")
            continue
        max_error = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
        times = []
        for _ in range(10):
            start = time.perf_counter()
            mgpu(x, w, group_sizes=uneven).block_until_ready()
            times.append(time.perf_counter() - start)
        print(f"mosaic gpu ragged_dot {block_m}x{block_n}x{block_k} ({steps} stages): "
              f"{min(times) * 1e3:.3f} ms, {flops / min(times) / 1e12:.1f} TFLOP/s, max |error| "
              f"{max_error:.3g} against ragged_dot in float32 (outputs up to "
              f"{float(jnp.max(jnp.abs(want))):.3g})")


# Candidates for steps of few rows (a batch-1 decode: 8 routed rows), where each program's serial
# loop over K, not the bytes, set the time on the H200 (2026-11-27): 128-wide column tiles (a
# weight row's 256 bytes a load, not 64), longer K steps, and K split over 4 or 8 programs.
FEW_ROWS_VARIANTS = [{"block_n": 128, "block_k": 128},
                     {"block_n": 128, "block_k": 128, "num_k_splits": 4},
                     {"block_n": 128, "block_k": 64, "num_k_splits": 8},
                     {"block_n": 64, "block_k": 128, "num_k_splits": 4}]

if jax.default_backend() == "gpu":
    import functools

    import numpy as np

    from moe_layer_check import timed
    from xlaserve.pallas_kernels import grouped_matmul_gpu as gpu

    import accelerator_lib

    # The floor's bandwidth is the roofline's (accelerator_check.py's): the published HBM figure
    # of the device kind, else the measured copy. The H200 run of 2026-11-27 timed its own
    # copy here (a fresh output buffer each call, each call waited on): 2.28 TB/s, where the
    # check's in-place copy measured 4.07, so every floor it printed was 1.8-2.1x too lenient.
    copy_gbps = accelerator_lib.copy_bandwidth_gbps(1 << 30, 20)
    published = accelerator_lib.published_hbm_gbps(jax.devices()[0].device_kind)
    bandwidth = (published or copy_gbps) * 1e9
    print(f"copy bandwidth {copy_gbps / 1e3:.2f} TB/s; floors at {bandwidth / 1e12:.2f} TB/s "
          f"({'the device kind' if published else 'the copy'})")
    rng = np.random.default_rng(1)
    cases = [("v2-lite 3072 rows", 3072, 64, 2048, 2816),
             ("qwen3 gate_up batch 1", 8, 128, 2048, 1536),
             ("qwen3 gate_up 256 rows", 2048, 128, 2048, 1536)]
    for name, m, e, k, n in cases:
        key_x, key_w = jax.random.split(jax.random.key(m))
        x = jax.random.normal(key_x, (m, k), jnp.bfloat16)
        w = (jax.random.normal(key_w, (e, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
        sizes = jnp.asarray(rng.multinomial(m, np.ones(e) / e), jnp.int32)
        if m > 1000:  # an empty group and a big one too
            sizes = sizes.at[0].set(0).at[1].add(sizes[0])
        want = jax.jit(functools.partial(jax.lax.ragged_dot, preferred_element_type=jnp.float32))(
            x, w, sizes)
        experts_read = int(jnp.sum(sizes > 0))
        floor = experts_read * k * n * 2 / bandwidth
        routed = 2 * m * k * n
        block_m = gpu.block_rows(m, e)
        variants = [{}, {"block_m": block_m, "block_n": 64}, {"block_m": 2 * block_m}]
        if m <= 64:  # few rows: 0.11 ms on the H200 whatever the tile; wider tiles, split K
            variants += FEW_ROWS_VARIANTS
        for tiles in variants:
            kernel = jax.jit(functools.partial(gpu.grouped_matmul_gpu, **tiles))
            try:
                got = kernel(x, w, sizes).block_until_ready()
            except Exception as error:  # noqa: BLE001 - a report, whatever failed
                print(f"grouped_matmul_gpu {name} {tiles or 'default'}: failed: "
                      f"{str(error).splitlines()[0][:200]}")
                continue
            seconds = timed(kernel, x, w, sizes, iters=10)
            max_error = float(jnp.max(jnp.abs(got - want)))
            print(f"grouped_matmul_gpu {name} {tiles or 'default'}: {seconds * 1e3:.3f} ms, "
                  f"{seconds / floor:.2f}x its floor ({floor * 1e3:.3f} ms: {experts_read} "
                  f"experts' weights), {routed / seconds / 1e12:.1f} TFLOP/s routed, max |error| "
                  f"{max_error:.3g} against ragged_dot in float32")

    # The fused SwiGLU (gate_up [E, K, 2, I] -> silu(gate) * up, bf16 out) and the MXFP4 experts
    # (gpt-oss's blocks and scales decoded in the kernel; --quantization mxfp4), each checked against
    # its two-step or decoded form and timed beside its floor.
    from xlaserve.pallas_kernels import grouped_matmul_mxfp4 as mxfp4
    from xlaserve.weights.formats.mxfp4 import decode_mxfp4

    for name, m, e, k, i, options in [
            ("qwen3 swiglu batch 1", 8, 128, 2048, 768, {}),
            *(("qwen3 swiglu batch 1", 8, 128, 2048, 768, v) for v in FEW_ROWS_VARIANTS),
            ("qwen3 swiglu 256 rows", 2048, 128, 2048, 768, {})]:
        key_x, key_w = jax.random.split(jax.random.key(m + 1))
        x = jax.random.normal(key_x, (m, k), jnp.bfloat16)
        gate_up = (jax.random.normal(key_w, (e, k, 2, i), jnp.float32) * 0.02).astype(jnp.bfloat16)
        sizes = jnp.asarray(rng.multinomial(m, np.ones(e) / e), jnp.int32)
        both = gpu.grouped_matmul_gpu(x, gate_up.reshape(e, k, -1), sizes).reshape(m, 2, i)
        want = jax.nn.silu(both[:, 0]) * both[:, 1]
        fused = jax.jit(functools.partial(gpu.grouped_swiglu_gpu, out_dtype=jnp.bfloat16,
                                          **options))
        name = f"{name} {options or 'default'}"
        try:
            got = fused(x, gate_up, sizes).block_until_ready()
        except Exception as error:  # noqa: BLE001 - a report, whatever failed
            print(f"grouped_swiglu_gpu {name}: failed: {str(error).splitlines()[0][:200]}")
            continue
        floor = int(jnp.sum(sizes > 0)) * k * 2 * i * 2 / bandwidth
        seconds = timed(fused, x, gate_up, sizes, iters=10)
        print(f"grouped_swiglu_gpu {name}: {seconds * 1e3:.3f} ms, {seconds / floor:.2f}x its "
              f"floor ({floor * 1e3:.3f} ms), max |error| "
              f"{float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))):.3g} against the two "
              "steps")
    for name, m, e, k, n in [("gpt-oss-20b gate_up batch 1", 8, 32, 2880, 5760),
                             ("gpt-oss-20b gate_up 256 rows", 1024, 32, 2880, 5760)]:
        x = jax.random.normal(jax.random.key(m + 2), (m, k), jnp.bfloat16)
        blocks = jnp.asarray(rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8))
        scales = jnp.asarray(rng.integers(118, 131, (e, n, k // 32), dtype=np.uint8))
        sizes = jnp.asarray(rng.multinomial(m, np.ones(e) / e), jnp.int32)
        decoded = jnp.asarray(decode_mxfp4(np.asarray(blocks), np.asarray(scales), jnp.bfloat16))
        want = jax.jit(functools.partial(jax.lax.ragged_dot, preferred_element_type=jnp.float32))(
            x, decoded, sizes)
        kernel = jax.jit(mxfp4.grouped_matmul_mxfp4)
        try:
            got = kernel(x, blocks, scales, sizes).block_until_ready()
        except Exception as error:  # noqa: BLE001 - a report, whatever failed
            print(f"grouped_matmul_mxfp4 {name}: failed: {str(error).splitlines()[0][:200]}")
            continue
        experts_read = int(jnp.sum(sizes > 0))
        floor = experts_read * (k * n // 2 + k // 32 * n) / bandwidth
        seconds = timed(kernel, x, blocks, scales, sizes, iters=10)
        bf16 = jax.jit(gpu.grouped_matmul_gpu)
        bf16_seconds = timed(bf16, x, decoded, sizes, iters=10)
        print(f"grouped_matmul_mxfp4 {name}: {seconds * 1e3:.3f} ms, {seconds / floor:.2f}x its "
              f"floor ({floor * 1e3:.3f} ms), the bf16 kernel on the decoded experts "
              f"{bf16_seconds * 1e3:.3f} ms, max |error| "
              f"{float(jnp.max(jnp.abs(got - want))):.3g} against ragged_dot on them")
