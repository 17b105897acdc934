"""The CPU few-row matmul (C++ through XLA's FFI) against numpy in float64: float32 and bfloat16
weights, W or W^T, every way it splits the work (blocks of rows of W, column ranges of a wide W,
rows of a transposed W), and sizes that are not multiples of its 16-float vectors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.native.matmul_cpu import MAX_ROWS, few_row_matmul

matmul = jax.jit(few_row_matmul, static_argnames=("transposed",))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows,k,n", [(1, 576, 3072), (2, 1536, 576), (3, 64, 49152),
                                      (MAX_ROWS, 40, 19), (1, 17, 70000)],
                         ids=["row_blocks", "two_rows", "wide_columns", "tails", "wide_tails"])
@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w_t"])
def test_equals_numpy(dtype, rows, k, n, transposed):
    rng = np.random.default_rng(rows * k + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32), dtype)
    expected = x.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    y = matmul(jnp.asarray(x), w.T if transposed else w, transposed=transposed)
    assert y.dtype == jnp.float32 and y.shape == (rows, n)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-4 * np.sqrt(k))


def test_refuses_too_many_rows_and_other_dtypes():
    with pytest.raises(ValueError, match="M<=16"):
        few_row_matmul(jnp.ones((MAX_ROWS + 1, 8)), jnp.ones((8, 8)))
    with pytest.raises(ValueError, match="float32/bfloat16"):
        few_row_matmul(jnp.ones((1, 8)), jnp.ones((8, 8), jnp.float16))


def test_the_native_matmul_is_used_only_where_it_measured_faster(monkeypatch):
    from xlaserve.runtime import kernels

    if not kernels._matmul_builds():
        pytest.skip("the native CPU matmul does not build here")
    for faster in (True, False):
        monkeypatch.setattr(kernels, "_native_matmul_is_faster", lambda shape, dtype: faster)
        chosen = kernels.kernels_for(matmul_shape=(64, 256), dtype="float32").few_row_matmul
        assert (chosen is not None) == faster
    monkeypatch.undo()
    assert isinstance(kernels._native_matmul_is_faster((64, 256), "float32"), bool)
