"""The CPU GEMM over packed weights (C++ through XLA's FFI) against numpy in float64: float32 and
bfloat16 weights, W and a [N, K] matrix used as W^T, every row count its tiles split into (6-row
tiles and the 1-5 row remainders, blocks of 96 rows), K in one block and in several (partial sums
added into y), and N that is not a multiple of the panel width."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.native import KernelUnavailable, gemm_cpu

try:
    gemm_cpu.load()
except KernelUnavailable as error:  # no compiler here: the model runs on XLA's dots
    pytest.skip(f"the native CPU GEMM does not build here: {error}", allow_module_level=True)

matmul = jax.jit(gemm_cpu.packed_matmul, static_argnames=("n",))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows,k,n", [(1, 576, 3072), (2, 1536, 576), (5, 64, 4100),
                                      (13, 40, 19), (100, 1700, 96), (7, 1, 33)],
                         ids=["decode", "two_blocks_of_k", "wide_tail", "tiles_and_rest",
                              "row_blocks", "k1"])
@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w_t"])
def test_equals_numpy(dtype, rows, k, n, transposed):
    rng = np.random.default_rng(rows * k + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32), dtype)
    expected = x.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    packed = gemm_cpu.pack_rows(w.T) if transposed else gemm_cpu.pack_columns(w)
    y = matmul(jnp.asarray(x), packed, n=n)
    assert y.dtype == jnp.float32 and y.shape == (rows, n)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-4 * np.sqrt(k))


def test_packing_round_trips_and_the_embedding_lookup_reads_the_panels():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((24, 70)).astype(np.float32))
    panel = gemm_cpu.panel_width()
    packed = gemm_cpu.pack_columns(w)
    assert packed.shape == (-(-70 // panel), 24, panel)
    np.testing.assert_array_equal(gemm_cpu.unpack_columns(packed, 70), w)
    ids = jnp.asarray([0, 69, 17, panel, 3])
    np.testing.assert_array_equal(gemm_cpu.packed_rows(gemm_cpu.pack_rows(w.T), ids), w.T[ids])


def test_refuses_mismatched_shapes_and_other_dtypes():
    packed = gemm_cpu.pack_columns(jnp.ones((8, 8)))
    with pytest.raises(ValueError, match="panels"):
        gemm_cpu.packed_matmul(jnp.ones((1, 9)), packed, 8)
    with pytest.raises(ValueError, match="panels"):
        gemm_cpu.packed_matmul(jnp.ones((1, 8)), packed, 8 + gemm_cpu.panel_width())
    with pytest.raises(ValueError, match="float32/bfloat16"):
        gemm_cpu.packed_matmul(jnp.ones((1, 8)), packed.astype(jnp.float16), 8)


def test_a_layer_of_a_stack_is_that_layers_matrix():
    rng = np.random.default_rng(1)
    weights = [rng.standard_normal((40, 50)).astype(np.float32) for _ in range(3)]
    stack = jnp.stack([gemm_cpu.pack_columns(jnp.asarray(w)) for w in weights])
    x = rng.standard_normal((7, 40)).astype(np.float32)
    for layer, w in enumerate(weights):
        y = jax.jit(gemm_cpu.packed_matmul, static_argnames=("n", "layer"))(
            jnp.asarray(x), stack, n=50, layer=layer)
        np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="layer"):
        gemm_cpu.packed_matmul(jnp.asarray(x), stack, 50, layer=3)
