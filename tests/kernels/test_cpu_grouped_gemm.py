"""The experts' grouped GEMM on the CPU over packed experts (native/grouped_gemm_cpu.cc) against a
float64 numpy reference and the CPU's tiled loop (model/grouped_matmul.py): float32 and bfloat16
experts (widened, and in k-pairs for VDPBF16PS where the CPU has AVX512_BF16), 1 to 300 rows
(decode's groups of one row, tiles and their remainders, several row blocks), odd K and N, empty
groups, every row in one group, rows past the groups' total zero; a layer of a stack; and packing
the experts of a model (model/weight_types/packed.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.grouped_reference import grouped_reference
from xlaserve.model.grouped_matmul import grouped_matmul_tiled
from xlaserve.native import KernelUnavailable, gemm_cpu

try:
    gemm_cpu.load()
except KernelUnavailable as error:  # no compiler here: the experts run in XLA's tiled loop
    pytest.skip(f"the native CPU GEMM does not build here: {error}", allow_module_level=True)

grouped = jax.jit(gemm_cpu.packed_grouped_matmul, static_argnames=("n", "layer", "bf16_pairs"))
tiled = jax.jit(grouped_matmul_tiled)
needs_pairs = pytest.mark.skipif(not gemm_cpu.bf16_pairs_supported(),
                                 reason="k-pair panels need a CPU with AVX512_BF16")
# (weight dtype, k-pair panels)
LAYOUTS = [pytest.param(np.float32, False, id="f32"),
           pytest.param(jnp.bfloat16, False, id="bf16_widened"),
           pytest.param(jnp.bfloat16, True, id="bf16_pairs", marks=needs_pairs)]


def _x_used(x, pairs):
    """k-pair panels multiply x rounded to bfloat16 (as XLA's bfloat16 dot does)."""
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)) if pairs else x


def _check(x, weights, sizes, pairs, k):
    got = grouped(jnp.asarray(x), gemm_cpu.pack_groups(weights, pairs), jnp.asarray(sizes),
                  n=weights.shape[2], bf16_pairs=pairs)
    assert got.dtype == jnp.float32 and got.shape == (x.shape[0], weights.shape[2])
    x_used = _x_used(x, pairs)
    weights32 = np.asarray(weights.astype(jnp.float32))
    tolerance = dict(rtol=1e-5, atol=1e-4 * np.sqrt(k))
    expected = grouped_reference(x_used, weights32, sizes)
    np.testing.assert_allclose(np.asarray(got), expected, **tolerance)
    # XLA's tiled loop on the same (rounded) inputs, in float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(tiled(x_used, weights32, sizes)),
                               **tolerance)
    return got


@pytest.mark.parametrize("dtype,pairs", LAYOUTS)
@pytest.mark.parametrize("rows,k,n,group_sizes", [
    (1, 256, 192, [0, 0, 1, 0]),  # one token's row of a decode step
    (8, 128, 100, [1, 0, 1, 1, 1, 0, 1, 1, 1, 0, 0, 1]),  # decode: one row per group
    (16, 24, 40, [3, 0, 5, 1, 0, 7, 0, 0]),  # groups smaller and larger than a tile
    (13, 40, 19, [13, 0, 0]),  # every row in the first group, N under one panel
    (13, 40, 70, [0, 0, 13]),  # and in the last
    (20, 64, 33, [1, 0, 2, 0, 0, 3, 0, 0]),  # 6 of 20 rows: the rest zero
    (300, 1600, 70, [40, 0, 200, 0, 60]),  # row blocks of 96, K in two blocks
], ids=["one_row", "decode", "ragged", "all_first", "all_last", "rows_past_total", "300_rows"])
def test_each_group_is_multiplied_by_its_own_expert(dtype, pairs, rows, k, n, group_sizes):
    rng = np.random.default_rng(rows * k + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    weights = jnp.asarray(rng.standard_normal((len(group_sizes), k, n)).astype(np.float32), dtype)
    _check(x, weights, np.array(group_sizes, np.int32), pairs, k)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16_widened"])
def test_odd_k(dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 37)).astype(np.float32)
    weights = jnp.asarray(rng.standard_normal((4, 37, 45)).astype(np.float32), dtype)
    assert not gemm_cpu.uses_bf16_pairs(weights.dtype, 37)
    _check(x, weights, np.array([2, 0, 6, 1], np.int32), False, 37)


@pytest.mark.parametrize("dtype,pairs", LAYOUTS)
def test_rows_past_the_total_and_empty_experts_are_never_read(dtype, pairs):
    """NaN in x past the groups' total and in the experts with no rows: the output stays finite,
    and zero past the total."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((12, 64)).astype(np.float32)
    x[7:] = np.nan
    weights = rng.standard_normal((5, 64, 48)).astype(np.float32)
    sizes = np.array([3, 0, 4, 0, 0], np.int32)
    weights[[1, 3, 4]] = np.nan
    packed = gemm_cpu.pack_groups(jnp.asarray(weights, dtype), pairs)
    got = np.asarray(grouped(jnp.asarray(x), packed, jnp.asarray(sizes), n=48, bf16_pairs=pairs))
    assert np.isfinite(got).all() and not got[7:].any()
    weights32 = np.asarray(jnp.asarray(weights, dtype).astype(jnp.float32))
    expected = grouped_reference(_x_used(x[:7], pairs), weights32, sizes)
    np.testing.assert_allclose(got[:7], expected, rtol=1e-5, atol=1e-3)
    empty = grouped(jnp.asarray(x), packed, jnp.zeros(5, jnp.int32), n=48, bf16_pairs=pairs)
    assert not np.asarray(empty).any()


def test_a_layer_of_a_stack_is_that_layers_experts_and_any_routing_is_one_program():
    rng = np.random.default_rng(5)
    layers = [rng.standard_normal((3, 40, 50)).astype(np.float32) for _ in range(2)]
    stack = jnp.stack([gemm_cpu.pack_groups(jnp.asarray(w)) for w in layers])
    x = rng.standard_normal((10, 40)).astype(np.float32)
    traces = []

    @jax.jit
    def layer_one(x, sizes):
        traces.append(1)  # once per trace, and a trace precedes every compile
        return gemm_cpu.packed_grouped_matmul(x, stack, sizes, 50, layer=1)

    for sizes in ([10, 0, 0], [2, 5, 3], [0, 1, 4]):
        sizes = np.array(sizes, np.int32)
        np.testing.assert_allclose(np.asarray(layer_one(x, sizes)),
                                   grouped_reference(x, layers[1], sizes), rtol=1e-5, atol=1e-4)
    assert len(traces) == 1
    with pytest.raises(ValueError, match="layer"):
        gemm_cpu.packed_grouped_matmul(jnp.asarray(x), stack, jnp.zeros(3, jnp.int32), 50, layer=2)


def test_refuses_mismatched_shapes_and_more_rows_than_x():
    packed = gemm_cpu.pack_groups(jnp.ones((3, 8, 8)))
    with pytest.raises(ValueError, match="G, ceil"):
        gemm_cpu.packed_grouped_matmul(jnp.ones((4, 8)), packed[0], jnp.ones(3, jnp.int32), 8)
    with pytest.raises(ValueError, match="one group size per matrix"):
        gemm_cpu.packed_grouped_matmul(jnp.ones((4, 8)), packed, jnp.ones(2, jnp.int32), 8)
    with pytest.raises(Exception, match="more rows than x"):
        grouped(jnp.ones((4, 8)), packed, jnp.array([2, 2, 1], jnp.int32), n=8).block_until_ready()


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_packing_the_experts_keeps_each_experts_matrix_and_its_shape(dtype):
    from xlaserve.model.weight_types.packed import PackedExperts, pack_experts

    weight = jnp.asarray(np.random.default_rng(6).standard_normal((3, 24, 2, 40)), dtype)
    packed = pack_experts(weight)
    assert isinstance(packed, PackedExperts) and packed.shape == weight.shape
    assert packed.columns == 80 and packed.bf16_pairs == gemm_cpu.uses_bf16_pairs(dtype, 24)
    for expert in range(3):
        np.testing.assert_array_equal(
            gemm_cpu.unpack_columns(packed.panels[expert], 80, packed.bf16_pairs),
            weight[expert].reshape(24, 80))
