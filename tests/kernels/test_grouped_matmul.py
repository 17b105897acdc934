"""The experts' grouped matmul (model/grouped_matmul.py): the CPU's tiled loop, XLA's ragged_dot,
the megablox Pallas kernel (in TPU interpret mode) and the GPU kernel
(pallas_kernels/grouped_matmul_gpu.py, in interpret mode) against a float64 numpy reference, with
empty groups, groups that do not fill a tile, one group taking every row, rows past the groups'
total (zero), and bfloat16 weights; what ragged_dot compiles to for TPU v6e, the reason TPU keeps
it, and for an H100, the reason a GPU does not."""
import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from tests.compile_targets import compile_for, devices
from tests.kernels.grouped_reference import grouped_reference
from xlaserve.runtime.executor.aot import abstract
from xlaserve.model.grouped_matmul import (grouped_matmul_megablox, grouped_matmul_ragged_dot,
                                           grouped_matmul_tiled, tile_rows)
from xlaserve.pallas_kernels import grouped_matmul_gpu as gpu

IMPLEMENTATIONS = {"tiled": grouped_matmul_tiled, "ragged_dot": grouped_matmul_ragged_dot}


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("group_sizes", [
    [3, 0, 5, 1, 0, 7, 0, 0],  # empty groups, groups smaller and larger than a tile
    [16, 0, 0, 0, 0, 0, 0, 0],  # every row in the first group
    [0, 0, 0, 0, 0, 0, 0, 16],  # every row in the last group
    [2, 2, 2, 2, 2, 2, 2, 2],
    [1, 0, 2, 0, 0, 3, 0, 0],  # 6 of 16 rows: the rest must be zero
], ids=["ragged", "all_first", "all_last", "even", "fewer_rows_than_x"])
def test_each_group_is_multiplied_by_its_own_matrix(name, group_sizes):
    rng = np.random.default_rng(sum(group_sizes) + len(name))
    x = rng.standard_normal((16, 24)).astype(np.float32)
    weights = rng.standard_normal((8, 24, 40)).astype(np.float32)
    sizes = np.array(group_sizes, np.int32)
    got = jax.jit(IMPLEMENTATIONS[name])(x, weights, sizes)
    assert got.dtype == jnp.float32 and got.shape == (16, 40)
    np.testing.assert_allclose(np.asarray(got), grouped_reference(x, weights, sizes), rtol=1e-5, atol=1e-5)


def test_one_program_serves_any_routing():
    """Group sizes are data: a new routing does not recompile."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    weights = rng.standard_normal((4, 32, 8)).astype(np.float32)
    traces = []

    @jax.jit
    def tiled(*args):
        traces.append(1)  # runs once per trace, and a trace precedes every compile
        return grouped_matmul_tiled(*args)

    for sizes in ([64, 0, 0, 0], [10, 20, 30, 4], [0, 1, 0, 63]):
        sizes = np.array(sizes, np.int32)
        np.testing.assert_allclose(np.asarray(tiled(x, weights, sizes)),
                                   grouped_reference(x, weights, sizes), rtol=1e-5, atol=1e-5)
    assert len(traces) == 1


def test_bfloat16_weights_take_bfloat16_inputs_with_float32_accumulation():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((12, 64)).astype(np.float32)
    weights = jnp.asarray(rng.standard_normal((3, 64, 16)), jnp.bfloat16)
    sizes = np.array([5, 0, 7], np.int32)
    rounded_x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    expected = grouped_reference(rounded_x, np.asarray(weights.astype(jnp.float32)), sizes)
    for implementation in IMPLEMENTATIONS.values():
        got = jax.jit(implementation)(x, weights, sizes)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows,groups,tile", [(8, 128, 1), (64, 128, 1), (2048, 128, 16),
                                              (4096, 8, 64), (3, 1, 4)])
def test_a_tile_is_about_the_mean_group_size(rows, groups, tile):
    assert tile_rows(rows, groups) == tile


@pytest.mark.skipif(importlib.util.find_spec("jax.experimental.pallas.ops.tpu.megablox") is None,
                    reason="this JAX ships no megablox")
def test_megablox_matches_the_reference_in_interpret_mode():
    """One program, 300 rows: two 256-row tiles, the second padded. Interpret mode fills memory
    the kernel never writes with NaN, so rows past the groups' total fail unless zeroed."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((300, 24)).astype(np.float32)
    weights = jnp.asarray(rng.standard_normal((8, 24, 40)), jnp.bfloat16)
    rounded_x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    megablox = jax.jit(functools.partial(grouped_matmul_megablox, interpret=True))
    for sizes in ([3, 0, 5, 1, 0, 7, 0, 0],  # 16 rows: the rest of the tile, and the next one
                  [40, 0, 0, 200, 0, 0, 0, 60],  # a group across the tiles' boundary
                  [0, 0, 0, 0, 0, 0, 0, 300],
                  [0, 250, 0, 0, 0, 0, 10, 0]):  # the total ends in the second tile
        sizes = np.array(sizes, np.int32)
        got = megablox(x, weights, sizes)
        assert got.dtype == jnp.float32 and got.shape == (300, 40)
        expected = grouped_reference(rounded_x, np.asarray(weights.astype(jnp.float32)), sizes)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-4)


def test_ragged_dot_compiles_to_a_grouped_kernel_for_tpu():
    """Why TPU keeps ragged_dot (model/grouped_matmul.py): XLA compiles it to Mosaic grouped
    kernels doing one dense pass's flops, not one per expert. Qwen3-30B-A3B's gate_up, 128 tokens."""
    _, target = devices("v6e:2x2")
    mesh = Mesh(np.array(target[:1]), ("device",))
    rows, k, n, experts = 1024, 2048, 1536, 128
    compiled = compile_for(mesh, jax.jit(grouped_matmul_ragged_dot),
                           abstract((rows, k), jnp.bfloat16, mesh),
                           abstract((experts, k, n), jnp.bfloat16, mesh),
                           abstract((experts,), jnp.int32, mesh))
    hlo = compiled.as_text()
    assert "%ragged-dot-metadata = " in hlo and 'custom_call_target="tpu_custom_call"' in hlo
    assert not re.search(r"= \S+ (dot|convolution)\(", hlo)
    assert compiled.cost_analysis()["flops"] == 2 * rows * k * n


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("group_sizes", [
    [3, 0, 5, 1, 0, 7, 0, 0],  # empty groups, groups under a visit, rows past the total
    [40, 0, 0, 0, 0, 0, 0, 0],  # one group, several visits, the last part empty
    [0, 0, 0, 0, 0, 0, 0, 40],
    [17, 0, 0, 16, 0, 0, 1, 6],  # a visit and a row; exactly a visit
    [0, 0, 0, 0, 0, 0, 0, 0],  # nothing routed here (expert parallelism): all zero
], ids=["ragged", "all_first", "all_last", "edges", "none"])
def test_the_gpu_kernel_multiplies_each_group_by_its_own_matrix(group_sizes, block_m):
    rng = np.random.default_rng(sum(group_sizes) + block_m)
    x = rng.standard_normal((40, 48)).astype(np.float32)
    weights = rng.standard_normal((8, 48, 64)).astype(np.float32)
    sizes = np.array(group_sizes, np.int32)
    kernel = jax.jit(functools.partial(gpu.grouped_matmul_gpu, block_m=block_m, block_n=32,
                                       block_k=16, interpret=True))
    got = kernel(x, weights, sizes)  # 3 K steps, 2 column tiles
    assert got.dtype == jnp.float32 and got.shape == (40, 64)
    np.testing.assert_allclose(np.asarray(got), grouped_reference(x, weights, sizes), rtol=1e-5,
                               atol=1e-5)


def test_the_gpu_kernel_takes_bfloat16_with_float32_accumulation_at_its_own_tiles():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((70, 96)).astype(np.float32)
    weights = jnp.asarray(rng.standard_normal((6, 96, 80)), jnp.bfloat16)
    sizes = np.array([9, 30, 0, 1, 20, 2], np.int32)  # 62 of 70 rows
    rounded_x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    expected = grouped_reference(rounded_x, np.asarray(weights.astype(jnp.float32)), sizes)
    got = jax.jit(functools.partial(gpu.grouped_matmul_gpu, interpret=True))(x, weights, sizes)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-4)


def test_bfloat16_outputs_are_the_float32_accumulation_rounded_with_zero_rows_past_the_groups():
    # The GPU asks for the experts' outputs in the model dtype (Kernels.round_projections): the
    # kernels accumulate in float32 and write bfloat16, so the output is the float32 result
    # rounded once; rows past the groups' total stay zero.
    rng = np.random.default_rng(3)
    x = rng.standard_normal((70, 96)).astype(np.float32)
    weights = jnp.asarray(rng.standard_normal((6, 96, 80)), jnp.bfloat16)
    sizes = np.array([9, 30, 0, 1, 20, 2], np.int32)  # 62 of 70 rows
    for implementation in [*IMPLEMENTATIONS.values(),
                           functools.partial(gpu.grouped_matmul_gpu, interpret=True)]:
        f32 = jax.jit(implementation)(x, weights, sizes)
        bf16 = jax.jit(functools.partial(implementation, out_dtype=jnp.bfloat16))(x, weights, sizes)
        assert bf16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(bf16[:62].astype(jnp.float32)),
                                      np.asarray(f32[:62].astype(jnp.bfloat16).astype(jnp.float32)))
        if implementation is not grouped_matmul_ragged_dot:  # TPU's leaves them (moe.py drops)
            assert not np.asarray(bf16[62:].astype(jnp.float32)).any()


@pytest.mark.parametrize("dtype,block_m", [(jnp.float32, 16), (jnp.bfloat16, 32)])
def test_the_fused_swiglu_kernel_is_the_activation_of_each_rows_experts_gate_and_up(dtype,
                                                                                   block_m):
    # gate_up [E, K, 2, I]: silu(x @ gate) * (x @ up) per row's expert, float32 inside, rounded
    # once to the output dtype; rows past the groups' total zero. Several visits and column tiles.
    rng = np.random.default_rng(4)
    x = rng.standard_normal((70, 96)).astype(np.float32)
    gate_up = jnp.asarray(rng.standard_normal((6, 96, 2, 48)) / 8, dtype)
    sizes = np.array([9, 30, 0, 1, 20, 2], np.int32)  # 62 of 70 rows
    rounded_x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    weights = np.asarray(gate_up.astype(jnp.float32))
    gate = grouped_reference(rounded_x, weights[:, :, 0], sizes)
    up = grouped_reference(rounded_x, weights[:, :, 1], sizes)
    expected = gate / (1 + np.exp(-gate)) * up
    fused = jax.jit(functools.partial(gpu.grouped_swiglu_gpu, block_m=block_m, block_n=16,
                                      block_k=32, interpret=True, out_dtype=dtype))
    got = np.asarray(fused(x, gate_up, sizes).astype(jnp.float32))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
    assert not got[62:].any()


@pytest.mark.parametrize("sizes", [[5, 0, 33, 0], [0, 0, 0, 0], [16, 16, 16, 16], [64, 0, 0, 0],
                                   [1, 1, 1, 1]])
def test_each_row_is_in_exactly_one_visit_within_the_grid(sizes):
    """The visits cover every row once (groups 0..G-1, G for the rows past their total), never
    across a group's end, and fit the static `max_visits`."""
    rows, block_m = 64, 16
    num_visits = gpu.max_visits(rows, len(sizes), block_m)
    group, start, end = map(np.asarray, gpu.visits(jnp.asarray(sizes, jnp.int32), rows, block_m,
                                                   num_visits))
    owner = np.full(rows, -1)
    for g, a, b in zip(group, start, end):
        if g <= len(sizes):
            assert 0 < b - a <= block_m and (owner[a:b] == -1).all()
            owner[a:b] = g
    expected = np.repeat(np.arange(len(sizes) + 1), [*sizes, rows - sum(sizes)])
    np.testing.assert_array_equal(owner, expected)


@pytest.mark.parametrize("rows,groups,block_m", [(8, 128, 16), (2048, 128, 16), (32768, 128, 64),
                                                 (512, 8, 64), (4096, 64, 64)])
def test_a_visit_is_about_the_mean_group_size(rows, groups, block_m):
    assert gpu.block_rows(rows, groups) == block_m


def test_the_gpu_kernel_refuses_experts_it_cannot_tile():
    assert gpu.supports(2880, 5760) is None  # gpt-oss
    assert "multiples of 16" in gpu.supports(24, 64)
    with pytest.raises(ValueError, match="multiples of 16"):
        gpu.grouped_matmul_gpu(jnp.ones((4, 24)), jnp.ones((2, 24, 64)), jnp.array([2, 2]),
                               interpret=True)


def test_ragged_dot_is_a_dense_dot_for_an_h100_and_mosaic_gpus_grouped_matmul_compiles():
    """Why a GPU needs its own grouped matmul (docs/tpu-gpu.md, "Mixtures of experts"): XLA
    compiles ragged_dot for an H100 as a dot over every expert (the H100 timed it 13x slower
    than one expert's GEMM of the rows). The candidate, JAX's Mosaic GPU grouped matmul
    (`ragged_dot_mgpu`, Hopper's WGMMA), compiles at DeepSeek-V2-Lite's expert shapes; on the
    device it is checked and timed by benchmarks/check_gpu_ragged_dot.py."""
    import functools

    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    _, target = devices("h100")
    mesh = Mesh(np.array(target[:1]), ("device",))
    rows, k, n, experts = 1024, 2048, 2816, 64
    shapes = (abstract((rows, k), jnp.bfloat16, mesh),
              abstract((experts, k, n), jnp.bfloat16, mesh), abstract((experts,), jnp.int32, mesh))
    dense = compile_for(mesh, jax.jit(grouped_matmul_ragged_dot), *shapes).as_text()
    # The rows copied once per expert, masked to its group, then one dot over experts x K.
    assert f"bf16[{rows},{experts},{k}]" in dense and re.search(r"= f32\S+ dot\(", dense)
    mgpu = functools.partial(ragged_dot_mgpu.ragged_dot, block_m=128, block_n=128, block_k=64,
                             max_concurrent_steps=4, grid_block_n=1)
    grouped = compile_for(mesh, jax.jit(lambda x, w, sizes: mgpu(x, w, group_sizes=sizes)),
                          *shapes)
    assert 'custom_call_target="mosaic_gpu' in grouped.as_text()


@pytest.mark.parametrize("fused", [False, True], ids=["matmul", "swiglu"])
@pytest.mark.parametrize("num_k_splits", [2, 3])
def test_k_splits_sum_to_the_unsplit_product_with_zero_rows_past_the_groups(fused, num_k_splits):
    # Each (column tile, visit) as num_k_splits programs over parts of K, their float32 partial
    # products summed (and activated) after the call: the grouped product of every group's rows,
    # empty groups and rows past the total included, in the output dtype.
    rng = np.random.default_rng(5 + num_k_splits)
    x = rng.standard_normal((40, 96)).astype(np.float32)
    sizes = np.array([3, 0, 17, 1, 0, 12], np.int32)  # 33 of 40 rows
    shape = (6, 96, 2, 32) if fused else (6, 96, 64)
    weights = jnp.asarray(rng.standard_normal(shape) / 8, jnp.float32)
    kernel = gpu.grouped_swiglu_gpu if fused else gpu.grouped_matmul_gpu
    options = dict(block_m=16, block_n=16, block_k=16, interpret=True)  # 6 K steps
    split = jax.jit(functools.partial(kernel, num_k_splits=num_k_splits, **options))
    whole = jax.jit(functools.partial(kernel, **options))
    got, want = np.asarray(split(x, weights, sizes)), np.asarray(whole(x, weights, sizes))
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not got[33:].any()
    with pytest.raises(ValueError, match="do not split 4 ways"):
        jax.jit(functools.partial(kernel, num_k_splits=4, **options))(x, weights, sizes)


@pytest.mark.parametrize("rows,k,n,experts,dtype", [
    (8, 2048, 1536, 128, jnp.bfloat16),  # Qwen3-30B-A3B gate_up, batch 1
    (2048, 768, 2048, 128, jnp.bfloat16),  # its down, 256 rows
    (32768, 2048, 1536, 128, jnp.bfloat16),  # 4096 prompt tokens
    (1024, 2880, 5760, 32, jnp.bfloat16),  # gpt-oss-20b gate_up, 256 rows
    (1536, 2048, 2816, 64, jnp.float32),  # DeepSeek-V2-Lite gate_up, 256 rows, float32
], ids=["qwen3-b1", "qwen3-down-256", "qwen3-4096", "gpt-oss-256", "v2-lite-f32"])
@pytest.mark.parametrize("fused", [False, True], ids=["matmul", "swiglu"])
def test_the_gpu_kernel_compiles_for_an_h100(rows, k, n, experts, dtype, fused):
    """Triton's compiler runs on the deviceless compile (shared memory and tile checks): one
    custom call, no dot of XLA's, the grid of `max_visits`; fused, gate_up [E, K, 2, N / 2] to
    the activation [M, N / 2] in bfloat16, two column tiles a program."""
    _, target = devices("h100")
    mesh = Mesh(np.array(target[:1]), ("device",))
    if fused:
        kernel = functools.partial(gpu.grouped_swiglu_gpu, out_dtype=jnp.bfloat16)
        weights = abstract((experts, k, 2, n // 2), dtype, mesh)
    else:
        kernel, weights = gpu.grouped_matmul_gpu, abstract((experts, k, n), dtype, mesh)
    compiled = compile_for(mesh, jax.jit(kernel), abstract((rows, k), dtype, mesh), weights,
                           abstract((experts,), jnp.int32, mesh))
    hlo = compiled.as_text()
    block_m = gpu.block_rows(rows, experts)
    assert f'name = "{gpu.SWIGLU_NAME if fused else gpu.NAME}_m{block_m}"' in hlo
    assert f"grid_y = {gpu.max_visits(rows, experts, block_m)} " in hlo
    assert not re.search(r"= \S+ (dot|convolution)\(", hlo)


@pytest.mark.parametrize("fused", [False, True], ids=["matmul", "swiglu"])
def test_k_split_kernels_compile_for_an_h100_at_a_batch_1_step(fused):
    """Split K (the candidate for steps of few rows) through Triton's compiler at Qwen3-30B-A3B's
    batch-1 gate_up: a third grid axis of the splits, 128-wide column tiles."""
    _, target = devices("h100")
    mesh = Mesh(np.array(target[:1]), ("device",))
    kernel = gpu.grouped_swiglu_gpu if fused else gpu.grouped_matmul_gpu
    shape = (128, 2048, 2, 768) if fused else (128, 2048, 1536)
    compiled = compile_for(
        mesh, jax.jit(functools.partial(kernel, num_k_splits=4, block_n=128, block_k=128)),
        abstract((8, 2048), jnp.bfloat16, mesh), abstract(shape, jnp.bfloat16, mesh),
        abstract((128,), jnp.int32, mesh))
    assert "grid_z = 4 " in compiled.as_text()


@pytest.mark.parametrize("first_expert", [0, 4])
def test_the_experts_on_the_gpu_kernel_give_the_tiled_loops_output(first_expert):
    """model/moe.run_experts with the GPU kernel (interpret mode), and with TPU's gate_up as 2E
    groups, against the CPU's tiled loop:
    the sort by expert, both matmuls, the SwiGLU and the combine. This device holds 4 of 12
    experts (expert parallelism; from `first_expert`): pairs routed elsewhere sort past the
    groups' total and add nothing."""
    from xlaserve.model.layers import Kernels
    from xlaserve.model.moe import run_experts
    from xlaserve.pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention

    rng = np.random.default_rng(first_expert)
    tokens, top_k, hidden, intermediate = 24, 3, 32, 16
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(12, top_k, replace=False) for _ in range(tokens)]))
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, top_k)), jnp.float32)
    expert_weights = {
        "experts_gate_up": jnp.asarray(rng.standard_normal((4, hidden, 2, intermediate)) / 4,
                                       jnp.float32),
        "experts_down": jnp.asarray(rng.standard_normal((4, intermediate, hidden)) / 4,
                                    jnp.float32)}

    def experts_with(grouped_matmul, gate_up_as_groups=False, grouped_swiglu=None):
        kernels = Kernels(attention=ragged_paged_attention, grouped_matmul=grouped_matmul,
                          gate_up_as_groups=gate_up_as_groups, grouped_swiglu=grouped_swiglu)
        return jax.jit(lambda *a: run_experts(*a, kernels, kernels.swiglu, first_expert))(
            x, weights, experts, expert_weights)

    got = experts_with(functools.partial(gpu.grouped_matmul_gpu, interpret=True))
    expected = experts_with(grouped_matmul_tiled)
    # The GPU's gate_up with the SwiGLU fused (Kernels.grouped_swiglu), under expert parallelism
    fused = experts_with(functools.partial(gpu.grouped_matmul_gpu, interpret=True),
                         grouped_swiglu=functools.partial(gpu.grouped_swiglu_gpu, interpret=True))
    np.testing.assert_allclose(np.asarray(fused), np.asarray(expected), rtol=1e-5, atol=1e-5)
    # TPU's form of gate_up: 2E groups of [K, I], each row through both (Kernels.gate_up_as_groups)
    as_groups = experts_with(grouped_matmul_tiled, gate_up_as_groups=True)
    np.testing.assert_allclose(np.asarray(as_groups), np.asarray(expected), rtol=1e-5, atol=1e-5)
    held = (np.asarray(experts) >= first_expert) & (np.asarray(experts) < first_expert + 4)
    assert 0 < held.sum() < held.size
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
