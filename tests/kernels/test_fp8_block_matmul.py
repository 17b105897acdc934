"""The block-scaled FP8 matmul (pallas_kernels/fp8_block_matmul.py) in Pallas interpret mode on
the CPU, against float64: x's 1 x block_k group quantization within e4m3's rounding, and the
kernel's product against the float64 sum of the same FP8 operands times their scales (float32
accumulation error only), across row padding, several row and column tiles and K blocks.
Its H100 compile is tests/executor/test_compile_fp8.py's."""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.model.test_fp8_weights import e4m3_half_ulp
from xlaserve.pallas_kernels.fp8_block_matmul import block_fp8_matmul, quantize_groups, supports


def test_quantize_groups_scales_each_token_and_k_block_to_448():
    x = np.random.default_rng(0).standard_normal((5, 96)).astype(np.float32)
    x[1, 32:64] = 0.0  # a group of zeros: scale 1, values 0
    values, scales = quantize_groups(jnp.asarray(x), 32)
    groups = x.astype(np.float64).reshape(5, 3, 32)
    expected = np.abs(groups).max(axis=2) / 448
    expected[1, 1] = 1.0
    np.testing.assert_allclose(np.asarray(scales), expected, rtol=1e-7)
    quotient = groups / expected[:, :, None]
    got = np.asarray(values, np.float64).reshape(5, 3, 32)
    assert (np.abs(got - quotient) <= e4m3_half_ulp(quotient) * (1 + 1e-6)).all()
    assert not got[1, 1].any()


@pytest.mark.parametrize("rows,k,n,block_k", [(5, 256, 96, 128), (70, 128, 64, 32),
                                              (16, 512, 160, 128)])
def test_block_fp8_kernel_is_the_float64_blockwise_product_of_its_fp8_operands(rows, k, n, block_k):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    values = np.clip(rng.standard_normal((n, k)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    scales = rng.uniform(1e-4, 1e-2, (k // block_k, n)).astype(np.float32)
    kernel = jax.jit(functools.partial(block_fp8_matmul, block_k=block_k, interpret=True))
    y = np.asarray(kernel(x, jnp.asarray(values), jnp.asarray(scales)), np.float64)
    assert y.shape == (rows, n)
    x_fp8, x_scales = quantize_groups(x, block_k)
    x64 = (np.asarray(x_fp8, np.float64).reshape(rows, -1, block_k)
           * np.asarray(x_scales, np.float64)[:, :, None]).reshape(rows, k)
    w64 = values.astype(np.float64) * np.repeat(scales.astype(np.float64), block_k, axis=0).T
    expected = x64 @ w64.T
    bound = 1e-6 * (np.abs(x64) @ np.abs(w64).T)
    assert (np.abs(y - expected) <= bound + 1e-12).all()


def test_the_kernel_says_which_shapes_it_cannot_multiply():
    assert supports(4096, 14336, 128) is None
    assert "power of two" in supports(4096, 4096, 96)
    assert "not a whole number of 128-wide blocks" in supports(4096, 4160, 128)
    assert "not a multiple of 16" in supports(4100, 4096, 128)
    with pytest.raises(ValueError, match="block FP8 matmul"):
        block_fp8_matmul(jnp.ones((2, 96)), jnp.ones((64, 96), jnp.float8_e4m3fn),
                         jnp.ones((1, 64)), 128, interpret=True)
