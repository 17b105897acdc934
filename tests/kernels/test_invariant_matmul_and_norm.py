"""The batch-invariant Pallas matmul and RMSNorm of --enable-deterministic-inference on TPU and GPU
(pallas_kernels/invariant_matmul.py, invariant_norm.py), both platforms' forms interpreted on this
CPU: a row's result is the same bits alone and at any position among other rows, in steps of any
row count (across the kernels' row blocks, and past one), and it is the product (the norm) it
should be. Compiled for v6e and H100: tests/kernels/test_compile_invariant_kernels.py."""
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.model.layers import add_rms_norm_xla, rms_norm_xla
from xlaserve.pallas_kernels import invariant_matmul, invariant_norm

PLATFORMS = ["tpu", "gpu"]
# (rows beside the watched one, its position): within a row block, at its end, past one
ARRANGEMENTS = [(2, 1), (23, 7), (64, 63), (130, 129), (300, 5)]
# (K, N, transposed, dtype): a tiny model's, SmolLM2-135M's gate_up in bfloat16, a tied LM
# head, and (TPU) an N no tile divides
MATMULS = [(64, 192, False, "float32"), (576, 1536, False, "bfloat16"),
           (256, 384, True, "float32"), (256, 1000, True, "float32")]


def _cases():
    return [pytest.param(platform, *case, id=f"{platform}-{case[0]}x{case[1]}"
                         f"{'-transposed' if case[2] else ''}-{case[3]}")
            for platform in PLATFORMS for case in MATMULS
            if invariant_matmul.supports(case[0], case[1], platform) is None]


@pytest.mark.parametrize("platform,k,n,transposed,dtype", _cases())
def test_a_rows_product_is_the_same_bits_wherever_it_sits(platform, k, n, transposed, dtype):
    rng = np.random.default_rng(k + n)
    weight = jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n)), dtype)
    matmul = invariant_matmul.for_platform(platform, interpret=True)
    row = jnp.asarray(rng.standard_normal((1, k)), dtype)
    alone = np.asarray(matmul(row, weight, transposed=transposed))[0]
    w64 = np.asarray(weight.astype(jnp.float32), np.float64)
    expected = np.asarray(row.astype(jnp.float32), np.float64)[0] @ (w64.T if transposed else w64)
    np.testing.assert_allclose(alone, expected, rtol=1e-5, atol=1e-4)
    for rows, position in ARRANGEMENTS:
        x = jnp.asarray(rng.standard_normal((rows, k)), dtype).at[position].set(row[0])
        out = np.asarray(matmul(x, weight, transposed=transposed))
        assert out.shape == (rows, n)
        assert np.array_equal(out[position], alone), (rows, position)


def test_shapes_the_gpu_matmul_cannot_tile_are_refused_by_name():
    assert invariant_matmul.supports(100, 256, "gpu") == (
        "K = 100 (the GPU batch-invariant matmul needs a multiple of 16)")
    assert "N = 32001" in invariant_matmul.supports(4096, 32001, "gpu")
    assert invariant_matmul.supports(4096, 32001, "tpu") is None  # its last block overhangs
    with pytest.raises(ValueError, match="K = 100"):
        invariant_matmul.invariant_matmul(jnp.ones((1, 100)), jnp.ones((100, 256)),
                                          platform="gpu", interpret=True)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("hidden,dtype", [(64, "float32"), (576, "bfloat16"), (4096, "float32")])
def test_a_rows_norm_is_the_same_bits_wherever_it_sits(platform, hidden, dtype):
    rng = np.random.default_rng(hidden)
    scale = jnp.asarray(rng.standard_normal(hidden), dtype)
    norm, add_norm = invariant_norm.for_platform(platform, interpret=True)
    row, delta = (rng.standard_normal((1, hidden)).astype(np.float32) for _ in range(2))
    alone = np.asarray(norm(jnp.asarray(row), scale, 1e-6, dtype).astype(jnp.float32))[0]
    total, normed = add_norm(jnp.asarray(row), jnp.asarray(delta, dtype), scale, 1e-6,
                             jnp.bfloat16)
    # The XLA form's arithmetic, one row at a time
    np.testing.assert_allclose(alone, np.asarray(rms_norm_xla(
        jnp.asarray(row), scale, 1e-6, dtype).astype(jnp.float32))[0], rtol=1e-6, atol=1e-6)
    expected_total, expected_norm = add_rms_norm_xla(jnp.asarray(row), jnp.asarray(delta, dtype),
                                                     scale, 1e-6, jnp.bfloat16)
    assert total.dtype == expected_total.dtype == jnp.float32 and normed.dtype == jnp.bfloat16
    np.testing.assert_array_equal(total, expected_total)
    np.testing.assert_allclose(np.asarray(normed, np.float32),
                               np.asarray(expected_norm, np.float32), rtol=1e-2, atol=1e-2)
    for rows, position in ARRANGEMENTS[:4]:
        x = rng.standard_normal((rows, hidden)).astype(np.float32)
        d = rng.standard_normal((rows, hidden)).astype(np.float32)
        x[position], d[position] = row[0], delta[0]
        out = np.asarray(norm(jnp.asarray(x), scale, 1e-6, dtype).astype(jnp.float32))
        assert np.array_equal(out[position], alone), (rows, position)
        got_total, got_norm = add_norm(jnp.asarray(x), jnp.asarray(d, dtype), scale, 1e-6,
                                       jnp.bfloat16)
        assert np.array_equal(np.asarray(got_total)[position], np.asarray(total)[0])
        assert np.array_equal(np.asarray(got_norm)[position], np.asarray(normed)[0])


def test_rows_the_gpu_norm_cannot_chunk_are_refused_by_name():
    assert invariant_norm.supports(72, "gpu") == (
        "rows of 72 (the GPU batch-invariant RMSNorm needs a multiple of 16)")
    assert invariant_norm.supports(72, "tpu") is None
    assert invariant_norm.gpu_chunk(576) == 64 and invariant_norm.gpu_chunk(4096) == 256
