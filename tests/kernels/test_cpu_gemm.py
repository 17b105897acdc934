"""The CPU GEMM over packed weights (C++ through XLA's FFI) against numpy in float64: float32 and
bfloat16 weights (widened, and in k-pairs for VDPBF16PS where the CPU has AVX512_BF16), W and a
[N, K] matrix used as W^T, every row count its tiles split into (6-row tiles and the 1-5 row
remainders, blocks of 96 rows), K in one block and in several (partial sums added into y), and N
that is not a multiple of the panel width."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.rounding import assert_close_to_xla
from xlaserve.native import KernelUnavailable, gemm_cpu

try:
    gemm_cpu.load()
except KernelUnavailable as error:  # no compiler here: the model runs on XLA's dots
    pytest.skip(f"the native CPU GEMM does not build here: {error}", allow_module_level=True)

matmul = jax.jit(gemm_cpu.packed_matmul, static_argnames=("n", "bf16_pairs"))
needs_pairs = pytest.mark.skipif(not gemm_cpu.bf16_pairs_supported(),
                                 reason="k-pair panels need a CPU with AVX512_BF16")
# (weight dtype, k-pair panels)
LAYOUTS = [pytest.param(np.float32, False, id="f32"),
           pytest.param(jnp.bfloat16, False, id="bf16_widened"),
           pytest.param(jnp.bfloat16, True, id="bf16_pairs", marks=needs_pairs)]


@pytest.mark.parametrize("dtype,pairs", LAYOUTS)
@pytest.mark.parametrize("rows,k,n", [(1, 576, 3072), (2, 1536, 576), (5, 64, 4100),
                                      (13, 40, 19), (100, 1700, 96), (7, 2, 33), (3, 50, 40)],
                         ids=["decode", "two_blocks_of_k", "wide_tail", "tiles_and_rest",
                              "row_blocks", "k2", "x_tail"])
@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w_t"])
def test_equals_numpy(dtype, pairs, rows, k, n, transposed):
    rng = np.random.default_rng(rows * k + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32), dtype)
    # k-pair panels multiply x rounded to bfloat16 (as XLA's bfloat16 dot does); the error of
    # ignoring that rounding (~2^-9 per product) is far above the tolerance.
    x_used = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)) if pairs else x
    expected = x_used.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    packed = gemm_cpu.pack_rows(w.T, pairs) if transposed else gemm_cpu.pack_columns(w, pairs)
    y = matmul(jnp.asarray(x), packed, n=n, bf16_pairs=pairs)
    assert y.dtype == jnp.float32 and y.shape == (rows, n)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-4 * np.sqrt(k))


def test_odd_k_in_float32_and_widened_bfloat16():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((7, 1)).astype(np.float32)
    for dtype in (np.float32, jnp.bfloat16):
        w = jnp.asarray(rng.standard_normal((1, 33)).astype(np.float32), dtype)
        assert not gemm_cpu.uses_bf16_pairs(w.dtype, 1)
        y = matmul(jnp.asarray(x), gemm_cpu.pack_columns(w), n=33, bf16_pairs=False)
        np.testing.assert_allclose(np.asarray(y), x @ np.asarray(w.astype(jnp.float32)), rtol=1e-6)


@pytest.mark.parametrize("dtype,pairs", LAYOUTS)
def test_packing_round_trips_and_the_embedding_lookup_reads_the_panels(dtype, pairs):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((24, 70)).astype(np.float32), dtype)
    panel = gemm_cpu.panel_width()
    packed = gemm_cpu.pack_columns(w, pairs)
    assert packed.shape == (-(-70 // panel), 24, panel)
    np.testing.assert_array_equal(gemm_cpu.unpack_columns(packed, 70, pairs), w)
    ids = jnp.asarray([0, 69, 17, panel, 3])
    np.testing.assert_array_equal(
        gemm_cpu.packed_rows(gemm_cpu.pack_rows(w.T, pairs), ids, pairs), w.T[ids])


def test_bfloat16_weights_default_to_k_pairs_where_the_cpu_has_avx512_bf16():
    supported = gemm_cpu.bf16_pairs_supported()
    assert gemm_cpu.uses_bf16_pairs(jnp.bfloat16, 576) == supported
    assert not gemm_cpu.uses_bf16_pairs(jnp.float32, 576)
    assert not gemm_cpu.uses_bf16_pairs(jnp.bfloat16, 575)
    with pytest.raises(ValueError, match="even K"):
        gemm_cpu.pack_columns(jnp.ones((5, 8), jnp.bfloat16), bf16_pairs=True)


def test_refuses_mismatched_shapes_and_other_dtypes():
    packed = gemm_cpu.pack_columns(jnp.ones((8, 8)))
    with pytest.raises(ValueError, match="panels"):
        gemm_cpu.packed_matmul(jnp.ones((1, 9)), packed, 8)
    with pytest.raises(ValueError, match="panels"):
        gemm_cpu.packed_matmul(jnp.ones((1, 8)), packed, 8 + gemm_cpu.panel_width())
    with pytest.raises(ValueError, match="float32/bfloat16"):
        gemm_cpu.packed_matmul(jnp.ones((1, 8)), packed.astype(jnp.float16), 8)
    with pytest.raises(ValueError, match="k-pair"):  # float32 panels are never in k-pairs
        gemm_cpu.packed_matmul(jnp.ones((1, 8)), packed, 8, bf16_pairs=True)


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


@pytest.mark.parametrize("dtype,pairs", LAYOUTS)
@pytest.mark.parametrize("rows,k,width", [(1, 576, 1536), (13, 64, 64), (100, 40, 96), (7, 30, 40)],
                         ids=["decode", "tiles_and_rest", "row_blocks", "width_not_whole_panels"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["out_f32", "out_bf16"])
def test_fused_swiglu_equals_the_matmul_then_silu_times_up(dtype, pairs, rows, k, width, out_dtype):
    # The fused kernel takes widths that are whole panels (the last case falls back to the matmul
    # and XLA's activation); both sides sum the same products, so they agree to float32 rounding.
    rng = np.random.default_rng(rows + k + width)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    weights = [jnp.asarray(rng.standard_normal((k, 2 * width)) * 0.3, dtype) for _ in range(2)]
    stack = jnp.stack([gemm_cpu.pack_columns(w, pairs) for w in weights])
    fused = jax.jit(gemm_cpu.packed_matmul_swiglu, static_argnames=("n", "layer", "bf16_pairs",
                                                                    "out_dtype"))
    for layer in range(2):
        actual = fused(x, stack, n=2 * width, layer=layer, bf16_pairs=pairs, out_dtype=out_dtype)
        y = matmul(x, stack[layer], n=2 * width, bf16_pairs=pairs)
        expected = (jax.nn.silu(y[:, :width]) * y[:, width:]).astype(out_dtype)
        assert_close_to_xla(actual, expected, out_dtype, f32_rtol=1e-5, atol=1e-5)
